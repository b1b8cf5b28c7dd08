"""The decoding loops: plain (`plain`), speculative (`speculative`, `session`) and what they share
(`common`). They use the Target and Drafter interfaces only, never a family module."""
