"""What this machine is and how to use it well: splitting multi-row CPU passes over two streams, and ``dflash2-mlx doctor``."""
