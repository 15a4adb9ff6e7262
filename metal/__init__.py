"""The Metal kernel bodies (``*.metal``), shipped as package data and read by ``kernels.sources``."""
