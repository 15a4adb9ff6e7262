"""How fast is a long prompt's first token cold, from the prefix cache's memory, and from its disk after a restart?

Time to first token of a long prompt on the built-in pair (DFlash on, in-process engine):
cold, from the prefix cache's memory tier, and from its disk tier after the engine restarts
(dflash_ssd_cache; a fresh temporary directory each run).

The prompts are worked GSM8K answers from the shipped prompt set (about --tokens tokens),
then a question that differs each time, so every start reuses all but the question.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python scripts/experiments/ssd_cache_restart.py --tokens 1000,2500
"""

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from dflash2_mlx.backend.engine import Engine
from dflash2_mlx.backend.settings import ModelSettings
from dflash2_mlx.builtin.defaults import default_pair

if __package__:  # imported as scripts.experiments.ssd_cache_restart
    from .chat_prefix_cache import worked_answers
else:  # run as python scripts/experiments/ssd_cache_restart.py: its folder is on sys.path
    from chat_prefix_cache import worked_answers


async def first_token(engine, prompt):
    tic = time.perf_counter()
    stream = engine.stream_generate(prompt, max_tokens=4)
    await stream.__anext__()
    seconds = time.perf_counter() - tic
    async for last in stream:
        pass
    return seconds, last


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", default="1000,2500", help="Prompt sizes, comma-separated (about).")
    args = p.parse_args()
    target, drafter = default_pair()
    disk = Path(tempfile.mkdtemp(prefix="dflash2-ssd-"))

    def engine():
        e = Engine(target, ModelSettings(dflash_enabled=True, dflash_draft_model=drafter, dflash_ssd_cache=True),
                   model_id="builtin", ssd_cache_dir=disk)
        asyncio.run(e.start())
        return e

    for tokens in (int(t) for t in args.tokens.split(",")):
        text = worked_answers(tokens)
        e = engine()
        cold, c = asyncio.run(first_token(e, text + "\n\nQ: Which answer is the largest?"))
        memory, m = asyncio.run(first_token(e, text + "\n\nQ: Which answer is the smallest?"))
        asyncio.run(e.stop())  # memory entries go to disk
        e = engine()
        ssd, d = asyncio.run(first_token(e, text + "\n\nQ: How many questions are there?"))
        stats = e.get_stats()
        asyncio.run(e.stop())
        print(f"prompt {c.prompt_tokens} tokens: first token cold {cold * 1e3:.0f} ms; memory tier "
              f"{memory * 1e3:.0f} ms ({m.cached_tokens} cached); disk tier after a restart {ssd * 1e3:.0f} ms "
              f"({d.cached_tokens} cached, {stats['prefix_cache_ssd_hits']} disk hit)", flush=True)


if __name__ == "__main__":
    main()
