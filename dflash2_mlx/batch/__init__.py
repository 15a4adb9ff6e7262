"""Batched DFlash: several sequences drafted together and verified in one target pass.

Each cycle picks one block size b for the batch (fixed, or the adaptive policy fed with
every sequence's acceptance), drafts every sequence's block [anchor, MASK...], verifies all
blocks in ONE target pass over [S, b] rows, and lets each sequence keep its own accepted
prefix plus the target's bonus token, with its own sampling parameters, logits processors,
random stream, max_tokens and stop tokens.  Sequences join between cycles (prefilled
together) and leave (finished or aborted).

- ``generator.py``: ``BatchGenerator`` (``insert`` / ``remove`` / ``next`` /
  ``extract_cache``), sequences waiting, joining and leaving;
- ``cycle.py``: ``BatchCycle``, the batched draft -> verify -> accept;
- ``sequence.py``: one sequence's state (``BatchSequence``) and its ``Response`` tokens;
- ``join.py``: the joiners' batched prefill and its groups (``prefill_groups``);
- ``cache.py``: the batched target caches and the one drafter pass over all blocks;
- ``policy.py``: the batch's block size (``BatchCosts``, ``batch_policy``);
- ``generate.py``: the Python API (``batch_generate``, ``stream_batch_generate``).

Copies (``loop/lookup.py``): a sequence whose last tokens occurred before verifies the
tokens that followed them then instead of its draft, within the batch's block (no propose
for it; at T>0 its rows q are one-hot), where its own copies' acceptance promises more than
the drafter's (a fixed block size always copies, as a single stream does).

Random draws: each sampled sequence owns a PRNG key (``loop.random_keys.RandomStream``),
swapped in around its draws, so it draws exactly what a single stream seeded the same way
draws, whatever else is in the batch; a sequence without a seed gets a key drawn from the
global generator.

Lossless per sequence: every emitted token is the target's choice in the pass that verified
it (greedy) or passed rejection sampling against the target's own distribution (sampled),
by the single stream's accept rule (``request/sampling.py``: ``verify_lazy`` is
``verify_greedy`` / ``verify_sampled`` on all rows at once); the batch only changes which
rows share a matmul.
"""

from .cycle import BatchCycle
from .generate import BatchResult, batch_generate, stream_batch_generate
from .generator import BatchGenerator
from .join import prefill_groups
from .policy import BatchCosts, batch_policy
from .sequence import BatchSequence, Response

__all__ = ["BatchCosts", "BatchCycle", "BatchGenerator", "BatchResult", "BatchSequence",
           "Response", "batch_generate", "batch_policy", "prefill_groups",
           "stream_batch_generate"]
