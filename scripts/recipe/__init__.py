"""The recipe that made the drafters shipped for SmolLM2-135M-Instruct (see ../README.md)."""
