"""Pure-functional model code: shared layers, the dense target, the drafter."""
