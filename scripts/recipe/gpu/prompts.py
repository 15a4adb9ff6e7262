"""Which prompts does the GPU run answer, in what order? Prompt files interleaved, repeats and
benchmark-contaminated prompts dropped.

    python scripts/recipe/gpu/prompts.py OUT.jsonl IN.jsonl [IN.jsonl ...]

Takes one prompt from each input in turn (so any prefix of OUT is a balanced mix, and a
generation cut short by its time budget still answers every kind), keeps text prompts only,
drops a prompt seen before and one sharing 13 words in a row with a prompt of the five
benchmark sets (``dflash2_mlx.train.contamination``).  Run here for the prompts made from
text on this machine, and on the GPU machine to mix in those the target wrote itself.
"""

import json
import sys
from itertools import zip_longest

from dflash2_mlx.train.contamination import contaminated
from dflash2_mlx.train.data import read_prompts


def main(argv):
    if len(argv) < 2:
        sys.exit(__doc__)
    out, inputs = argv[0], argv[1:]
    sources = [[p for _, p in read_prompts(path) if isinstance(p, str)] for path in inputs]
    seen, kept, dropped = set(), [], 0
    for row in zip_longest(*sources):
        for text in row:
            if text is None or text in seen:
                continue
            seen.add(text)
            if contaminated(text):
                dropped += 1
                continue
            kept.append(text)
    with open(out, "w") as f:
        f.write("".join(json.dumps({"text": t}) + "\n" for t in kept))
    print(f"{out}: {len(kept)} prompts from {', '.join(f'{p} ({len(s)})' for p, s in zip(inputs, sources))}; "
          f"{dropped} dropped as contaminated")


if __name__ == "__main__":
    main(sys.argv[1:])
