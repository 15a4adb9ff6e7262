"""The drafter as a model: its config, the DFlash / DFlash 2 blocks (their dynamic conv and
path selector run through ``kernels``, whose twins define them), and checkpoint loading; and
what is read of the target it drafts for (``target_model``: mlx-lm's language model and its
args)."""
