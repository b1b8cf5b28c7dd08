"""Checkpoint input and output: safetensors folders (`safetensors`), name maps (`names`), and
loading or writing each family's checkpoints (`checkpoints`)."""
