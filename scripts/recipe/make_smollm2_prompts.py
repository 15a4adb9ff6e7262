"""What did the drafters first train on? Prompts made from text on this machine, none from the benchmarks.

Training prompts for the shipped SmolLM2 drafters, built from text on this machine.

Nothing comes from the benchmark sets (GSM8K, MATH-500, HumanEval, MBPP, MT-Bench):
- docstrings of the CPython standard library (explain / summarize / use-it-in-code),
- Python coding tasks phrased from those docstrings ("Write a Python function that ..."),
- arithmetic and algebra word problems generated from templates with random numbers,
- short writing tasks over a fixed list of everyday topics.
The four kinds are interleaved, so any prefix of the file is a balanced mix.

    python scripts/recipe/make_smollm2_prompts.py OUT.jsonl [--n 2000] [--seed 0]
"""

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

NAMES = ["Ana", "Ben", "Chloe", "Dev", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jonas",
         "Kemi", "Liam", "Maya", "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells",
         "stamps", "eggs", "tickets", "coins", "flowers", "toy cars", "bottles"]
TOPICS = ["learning a new language", "keeping a small garden", "saving money", "cooking rice",
          "riding a bicycle in a city", "the water cycle", "how a library works", "sleep",
          "volcanoes", "the history of the printing press", "recycling", "a rainy day",
          "how bees make honey", "working from home", "the moon", "chess for beginners",
          "public transport", "drinking enough water", "writing a good email", "wind energy",
          "the solar system", "caring for a cat", "morning routines", "planning a picnic"]
WRITING = ["Write a short paragraph about {t}.", "Give three practical tips about {t}.",
           "Explain {t} to a ten-year-old.", "Write a short blog post introduction about {t}.",
           "List the pros and cons of {t}.", "Write a friendly email to a colleague about {t}.",
           "Describe {t} in five sentences."]


def stdlib_modules():
    """(module name, parsed source) of every CPython standard-library module but the tests."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if {"site-packages", "dist-packages"} & set(f.parts) or "test" in f.parts[-2] or f.name.startswith("test"):
            continue
        try:
            tree = ast.parse(f.read_text(errors="ignore"))
        except (SyntaxError, ValueError):
            continue
        yield (f.stem if f.parent == root else f"{f.parent.name}.{f.stem}"), tree


def docstrings(limit_len=(60, 600)):
    out = []
    for mod, tree in stdlib_modules():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and limit_len[0] <= len(doc) <= limit_len[1]:
                    out.append((mod, node.name, doc))
    return out


def doc_prompt(rng, mod, name, doc):
    forms = [
        f"Explain in simple words what `{mod}.{name}` in the Python standard library does, with a short example.\n\nIts documentation:\n{doc}",
        f"Summarize this documentation of `{mod}.{name}` in two or three sentences:\n\n{doc}",
        f"Here is the docstring of `{name}` from Python's `{mod}` module:\n\n{doc}\n\nWhen would a programmer use it?",
    ]
    return rng.choice(forms)


def code_prompt(rng, mod, name, doc):
    first = doc.strip().split("\n\n")[0].replace("\n", " ").rstrip(".")
    forms = [
        f"Write a Python function `{name}` that does the following: {first}.",
        f"Implement in Python: {first}. Include a docstring and a short usage example.",
        f"Write a short Python program that uses `{mod}.{name}` and explain each line.",
    ]
    return rng.choice(forms)


def math_prompt(rng):
    a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(2, 12)
    n1, n2 = rng.sample(NAMES, 2)
    it = rng.choice(ITEMS)
    forms = [
        f"{n1} has {a} {it}. {n1} buys {c} packs with {b} {it} in each pack. How many {it} does {n1} have now?",
        f"{n1} had {a + b} {it} and gave {b} of them to {n2}. Then {n1} found {c} more. How many {it} does {n1} have?",
        f"A shop sells {it} for ${c} each. {n1} buys {b} and pays with a ${c * b + a} bill. How much change does {n1} get?",
        f"{n1} reads {b} pages a day for {c} days, then {a} pages on the last day. How many pages did {n1} read in total?",
        f"Solve for x: {c}x + {a} = {c * b + a}. Show your steps.",
        f"What is {a * c} divided by {c}, plus {b} times {c}? Explain step by step.",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"If {c} workers build a wall in {b} days, how many days would {c * 2} workers need, working at the same rate?",
        f"Compute the sum of the integers from 1 to {a + 10}.",
        f"What is {a}% of {b * 20}? Show the calculation.",
        f"Simplify the fraction {a * c}/{b * c}.",
        f"Find the value of {a}^2 - {b}^2 using the difference of squares.",
    ]
    return rng.choice(forms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    docs = docstrings()
    rng.shuffle(docs)
    kinds = [lambda i: doc_prompt(rng, *docs[(2 * i) % len(docs)]),
             lambda i: code_prompt(rng, *docs[(2 * i + 1) % len(docs)]),
             lambda i: math_prompt(rng),
             lambda i: rng.choice(WRITING).format(t=rng.choice(TOPICS))]
    with open(args.out, "w") as f:
        for i in range(args.n):
            f.write(json.dumps({"text": kinds[i % len(kinds)](i // len(kinds))}) + "\n")
    print(f"{args.out}: {args.n} prompts ({len(docs)} docstrings available)")


if __name__ == "__main__":
    main()
