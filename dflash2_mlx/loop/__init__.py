"""One stream's draft -> propose -> verify -> accept cycle and what it calls (its sampling
and accept rule: ``request/sampling.py``).

    cycle.py              the loop (``dflash_steps``), one cycle (``cycle``),
                          the sequence's state (``Sequence``: caches, history, settle)
    plain.py              plain decode steps, pipelined, with the policy's shadow probes
    clock.py              which cycles are timed for the adaptive policy, and how
    kv_quant.py           mlx-lm's KV cache quantization as the cycle applies it
    stats.py              the draft statistics yielded with each token
    target.py             the target: tapped features, cache snapshot and rollback
    verifiers.py          how it verifies: chain, row-exact pass, one-row steps, tree, path,
                          composed in one place (``compose``)
    draft_context.py      the drafter's context of committed tokens (window, sinks)
    random_keys.py        per-sequence random keys
    lookup.py             copies: drafts copied from the sequence itself
    scoring.py            a prompt's own log-probabilities
    prompt_cache_file.py  mlx_lm.cache_prompt's files
"""
