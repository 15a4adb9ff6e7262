"""The drafter as a model: its config, the DFlash / DFlash 2 blocks (their dynamic conv and path selector run through ``kernels``, whose twins define them), and checkpoint loading."""
