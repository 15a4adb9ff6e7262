"""The drafter as a model: its config, the DFlash / DFlash 2 blocks, the dynamic conv and the path selector (the pure-MLX twins that define them), and checkpoint loading."""
