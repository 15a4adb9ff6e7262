"""Measuring drafters and the loop.

    evaluate.py      the paper's offline figures (Recall@k by position, oracle tau) and
                     real-run tau of drafters: ``dflash2-mlx eval``
    bench.py         plain decoding, DFlash v1 and DFlash 2 side by side with a T=0 parity
                     check: ``dflash2-mlx bench``
    bench_serve.py   the server under concurrent clients, batched against one at a time:
                     ``dflash2-mlx bench serve``
    kernel_bench.py  the Metal kernels against their pure-MLX twins: ``dflash2-mlx bench kernels``
    profile.py       where a cycle's time goes
    runs.py          one generation as the commands record it, and the tally over runs
    prompts.py       the prompts the commands run (all of a set, or a seeded sample)
    report.py        report files (json, markdown, figures) and their table / plot helpers
"""
