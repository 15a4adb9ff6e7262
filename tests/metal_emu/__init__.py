"""The CPU emulation harness of the Metal kernels (``emulate``) and the inputs the kernel tests share (``cases``)."""
