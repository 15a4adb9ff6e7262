"""How does the drafter learn the benchmark domains' forms without their items? Prompts shaped like them.

Training prompts shaped like the five benchmark domains, built from text on this machine.

The first prompt set (make_smollm2_prompts.py) taught the drafter templated arithmetic and
docstring summaries; on the benchmark sets its acceptance fell well below that on its own
held-out prompts (HISTORY.md). These prompts take the *forms* of the five domains without any
of their items:
- multi-step word problems about money, time, rates and shares (GSM8K's form),
- competition-style problems written in LaTeX (MATH's form),
- Python stubs to complete: a standard-library signature and its docstring (HumanEval's form),
- one-line "Write a python function to ..." tasks (MBPP's form),
- open questions: writing, role-play, reasoning, STEM, humanities (MT-Bench's form).
The five kinds are interleaved, so any prefix of the file is a balanced mix.

    python scripts/recipe/make_domain_prompts.py OUT.jsonl [--n 1280] [--seed 1]
"""

import argparse
import ast
import json
import random

from dflash2_mlx.train.contamination import contaminated

if __package__:  # imported as scripts.recipe.make_domain_prompts (the tests)
    from .make_smollm2_prompts import ITEMS, NAMES, TOPICS, stdlib_modules
else:  # run as python scripts/recipe/make_domain_prompts.py: its folder is on sys.path
    from make_smollm2_prompts import ITEMS, NAMES, TOPICS, stdlib_modules

JOBS = [("baker", "loaves"), ("farmer", "baskets of tomatoes"), ("florist", "bouquets"),
        ("tailor", "shirts"), ("painter", "rooms"), ("teacher", "worksheets"),
        ("carpenter", "chairs"), ("beekeeper", "jars of honey"), ("potter", "bowls")]


def gsm_prompt(r):
    n1, n2, n3 = r.sample(NAMES, 3)
    it = r.choice(ITEMS)
    job, goods = r.choice(JOBS)
    a, b, c, d = r.randint(3, 40), r.randint(2, 15), r.randint(2, 9), r.randint(10, 90)
    p = r.choice([10, 20, 25, 30, 40, 50, 75])
    forms = [
        f"A {job} makes {a} {goods} on Monday, twice as many on Tuesday, and {b} fewer on Wednesday than on Tuesday. Each sells for ${c}. How much money does the {job} earn over the three days?",
        f"{n1} earns ${d} per hour and works {c} hours a day, {b % 5 + 3} days a week. {n1} spends {p}% of the weekly pay on rent. How much is left each week?",
        f"{n1} is {b} years older than {n2}, and {n3} is twice as old as {n2}. If {n2} is {a} years old, what is the sum of their ages?",
        f"A car drives at {d} miles per hour for {c} hours and then at {d - 5} miles per hour for {b} hours. How many miles does it travel in total?",
        f"{n1} wants to buy a bike that costs ${d * 10}. {n1} has saved ${a * 5} and saves ${b * 2} every week. How many weeks until {n1} can buy the bike?",
        f"A store marks a jacket at ${d * 2} and then offers {p}% off. {n1} also has a ${c} coupon used after the discount. How much does {n1} pay?",
        f"There are {a * 4} students in a class. {p}% of them play soccer and a quarter of the rest play chess. How many students play neither?",
        f"{n1} bakes {a} cookies and {n2} bakes {b} more than {n1}. They pack the cookies into boxes of {c}. How many full boxes can they fill together?",
        f"A recipe uses {c} cups of flour for {b} pancakes. How many cups of flour are needed for {b * a} pancakes?",
        f"{n1} reads {a} pages on Monday and {p}% more on Tuesday. The book has {a * 9} pages. How many pages are left after Tuesday?",
        f"A tank holds {d * 10} liters. It is filled at {a} liters per minute while {b} liters per minute leak out. How long does it take to fill the empty tank?",
        f"{n1} buys {c} notebooks at ${b} each and {a} pens at ${c}.{p % 100:02d} each. How much does {n1} spend in total?",
        f"{n1}, {n2} and {n3} share ${d * 6} in the ratio {c}:{b}:{a % 7 + 1}. How much does {n2} get?",
        f"A train leaves at {c}:{p % 60:02d} and the trip takes {b} hours and {d % 60} minutes. At what time does it arrive?",
        f"{n1} has {a} {it}. {n1} gives a third of them to {n2}, rounded down, and then buys {b} packs of {c}. How many {it} does {n1} have now?",
        f"A gym charges a ${d} joining fee and ${a} a month. How much does a membership cost for {b} months, and what is the average cost per month?",
        f"{n1} runs {c} kilometers every weekday and twice that on each weekend day. How many kilometers does {n1} run in {b % 4 + 2} weeks?",
        f"A school orders {a} boxes of {it} with {b * 2} in each box. {p}% of them are used in the first month. How many are left?",
    ]
    return r.choice(forms)


def math_prompt(r):
    a, b, c = r.randint(2, 12), r.randint(2, 20), r.randint(1, 30)
    m = r.choice([3, 5, 7, 9, 11, 13])
    x1, y1, x2, y2 = (r.randint(-9, 9) for _ in range(4))
    forms = [
        f"Find all real $x$ such that ${a}x^2 - {a * (b + c)}x + {a * b * c} = 0$.",
        f"What is the remainder when ${a}^{{{b + 10}}}$ is divided by ${m}$?",
        f"Compute $\\dbinom{{{b + 4}}}{{{a % 5 + 2}}}$.",
        f"How many positive divisors does ${a * b * c}$ have?",
        f"Find the distance between the points $({x1},{y1})$ and $({x2},{y2})$. Express your answer in simplest radical form.",
        f"If $f(x) = {a}x + {b}$ and $g(x) = x^2 - {c}$, what is $f(g({a % 4 + 1}))$?",
        f"Simplify $\\sqrt{{{a * a * b}}}$.",
        f"Evaluate $\\log_{{{a % 3 + 2}}} {(a % 3 + 2) ** (b % 6 + 2)}$.",
        f"The sum of two numbers is ${b + c}$ and their difference is ${abs(b - c)}$. What is the larger number?",
        f"What is the greatest common divisor of ${a * b}$ and ${a * c + a}$?",
        f"Two fair {a % 4 + 4}-sided dice are rolled. What is the probability that the sum is ${a % 4 + 5}$? Express your answer as a common fraction.",
        f"The first term of an arithmetic sequence is ${c}$ and the common difference is ${a}$. What is the ${b + 10}$th term?",
        f"Find the sum of the infinite geometric series $\\frac{{{a}}}{{{1}}} + \\frac{{{a}}}{{{m}}} + \\frac{{{a}}}{{{m * m}}} + \\cdots$.",
        f"Solve for $x$: $|{a}x - {b}| = {c}$. Enter all solutions, separated by commas.",
        f"What is the sum of the interior angles of a convex polygon with ${b + 3}$ sides, in degrees?",
        f"Compute $({a} + {b}i)({c} - {a}i)$, where $i^2 = -1$.",
        f"Express ${b * 7 + c}_{{10}}$ in base ${a % 6 + 2}$.",
        f"Find the slope of the line through $({x1},{y1})$ and $({x2},{y2 + 10})$. Express your answer as a common fraction.",
        f"How many ways are there to arrange the letters of the word {r.choice(['BANANA', 'LETTER', 'PEPPER', 'COOKIE', 'PUZZLE', 'BALLOON', 'SUCCESS'])}?",
        f"What is the area of the triangle with vertices $(0,0)$, $({a},0)$ and $({x1},{b})$?",
        f"If $x + \\frac{{1}}{{x}} = {a}$, what is $x^2 + \\frac{{1}}{{x^2}}$?",
        f"Find the determinant of $\\begin{{pmatrix}} {a} & {b} \\\\ {c} & {m} \\end{{pmatrix}}$.",
        f"What is the smallest positive integer $n$ such that ${a}n \\equiv {c % m} \\pmod{{{m}}}$?",
        f"How many zeros are at the end of ${b + 10}!$?",
        f"Let $p(x) = x^3 - {a}x^2 + {b}x - {c}$. Find the sum of the squares of the roots of $p$.",
        f"A circle has circumference ${2 * a}\\pi$. What is its area? Express your answer in terms of $\\pi$.",
    ]
    return r.choice(forms)


def stubs(limit_len=(40, 500)):
    """(signature source, docstring) of public, documented stdlib functions."""
    out = []
    for _, tree in stdlib_modules():
        for node in tree.body:  # module-level functions: no self, readable on their own
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if doc and limit_len[0] <= len(doc) <= limit_len[1]:
                    ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
                    out.append((f"def {node.name}({ast.unparse(node.args)}){ret}:", doc))
    return out


def humaneval_prompt(r, sig, doc):
    body = "\n".join(("    " + line) if line.strip() else "" for line in doc.splitlines())
    head = r.choice(["", "from typing import List\n\n\n", "import math\n\n\n", "from typing import List, Optional\n\n\n"])
    return f'{head}{sig}\n    """ {body.lstrip()}\n    """\n'


def mbpp_prompt(r):
    things = ["list", "tuple", "string", "dictionary", "list of lists", "set", "list of tuples"]
    tasks = [
        "find the {q} element in a {t}", "remove {w} from a {t}", "count the number of {w} in a {t}",
        "check whether a {t} contains {w}", "sort a {t} by {k}", "find the sum of {w} in a {t}",
        "reverse the order of {w} in a {t}", "group the {w} of a {t} by {k}",
        "find the index of the {q} element in a {t}", "merge two {t}s and remove {w}",
    ]
    q = r.choice(["largest", "smallest", "second largest", "most frequent", "first repeated", "last even", "median"])
    w = r.choice(["duplicates", "even numbers", "negative numbers", "vowels", "empty strings", "odd values",
                  "consecutive duplicates", "prime numbers", "whitespace characters", "uppercase letters"])
    k = r.choice(["length", "the second item", "the sum of digits", "frequency", "the last character"])
    numeric = [
        "check whether a given number is a {p}", "find the {n} of a given number",
        "find the {n} for every number in a list", "convert a {f} to {g}",
        "find the nth {s} number", "count the numbers up to n that are {p}s",
    ]
    p = r.choice(["prime", "perfect square", "palindrome", "Armstrong number", "power of two", "perfect number", "happy number"])
    n = r.choice(["sum of digits", "factorial", "number of divisors", "largest prime factor", "binary representation", "digital root"])
    f, g = r.choice([("decimal number", "binary"), ("binary string", "a decimal integer"), ("roman numeral", "an integer"),
                     ("temperature in Celsius", "Fahrenheit"), ("snake case string", "camel case"), ("tuple", "a dictionary")])
    s = r.choice(["Fibonacci", "Lucas", "triangular", "pentagonal", "Catalan", "hexagonal", "tetrahedral"])
    task = r.choice(tasks + numeric).format(q=q, t=r.choice(things), w=w, k=k, p=p, n=n, f=f, g=g, s=s)
    return r.choice(["Write a function to ", "Write a python function to "]) + task + "."


CONCEPTS = ["inflation", "natural selection", "supply and demand", "photosynthesis", "the greenhouse effect",
            "opportunity cost", "quantum entanglement", "machine learning", "the placebo effect", "plate tectonics",
            "compound interest", "the French Revolution", "the Renaissance", "entropy", "democracy",
            "the scientific method", "vaccination", "game theory", "impressionism", "the Cold War",
            "blockchains", "antibiotic resistance", "the Industrial Revolution", "cognitive dissonance"]
ROLES = ["a famous chef", "a ship's captain in 1850", "a tour guide in Rome", "a detective", "a nutritionist",
         "a startup founder", "a medieval knight", "a math tutor", "a park ranger", "an astronaut",
         "a museum curator", "a career coach", "a poet", "a customer support agent"]


def mt_prompt(r):
    t, c1, c2 = r.choice(TOPICS), *r.sample(CONCEPTS, 2)
    role = r.choice(ROLES)
    n1 = r.choice(NAMES)
    forms = [
        f"Compose an engaging blog post about {t}, with a catchy title and three sections.",
        f"Write a persuasive speech of about 200 words on why everyone should care about {c1}.",
        f"Pretend you are {role}. Describe a typical day in your life and the biggest challenge you face.",
        f"Imagine you are {role}. A visitor asks you about {t}. How do you answer?",
        f"Explain {c1} in simple terms and give two real-world examples.",
        f"What are the main differences between {c1} and {c2}? Answer in a short table and a summary.",
        f"Describe the historical significance of {c1} and its influence on the modern world.",
        f"Draft a professional email to your manager asking for feedback on a report about {t}. Keep it short.",
        f"Write a short story of about 150 words that starts with: \"{n1} opened the door and froze.\"",
        f"Suggest five creative ideas for a school project about {c1}, with one sentence on each.",
        f"A bat and a ball cost ${r.randint(2, 9)}.{r.choice(['10', '20', '50'])} in total. The bat costs ${r.randint(1, 2)}.00 more than the ball. How much does the ball cost? Explain your reasoning.",
        f"{n1} is taller than {r.choice(NAMES)}, who is taller than {r.choice(NAMES)}. Is {n1} the tallest? Explain step by step.",
        f"Write a haiku about {t}, then explain the imagery you chose.",
        f"Give me a one-week plan to get better at {t}, one line per day.",
        f"Critique the following claim in a balanced way: \"{c1.capitalize()} is the most important idea of the last century.\"",
        f"How would you explain {c1} to a high-school student who has never heard of it? Use an analogy.",
        f"Write a product description for a new app that helps people with {t}.",
        f"List the key steps of {c1} as a numbered list, then name one common misconception about it.",
    ]
    return r.choice(forms)


def domain_prompts(n: int, seed: int = 1):
    """(up to ``n`` distinct prompts, the five kinds in turn; how many stdlib stubs there were)."""
    r = random.Random(seed)
    sigs = stubs()
    r.shuffle(sigs)
    kinds = [lambda i: gsm_prompt(r), lambda i: math_prompt(r),
             lambda i: humaneval_prompt(r, *sigs[i % len(sigs)]), lambda i: mbpp_prompt(r), lambda i: mt_prompt(r)]
    seen, out, i = set(), [], 0
    while len(out) < n and i < 20 * n:  # skip repeats: a repeated prompt teaches nothing new
        text = kinds[len(out) % len(kinds)](i)
        i += 1
        if text in seen or contaminated(text):  # a few templates can write a benchmark item
            continue
        seen.add(text)
        out.append(text)
    return out, len(sigs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=1280)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    prompts, stubs_available = domain_prompts(args.n, args.seed)
    with open(args.out, "w") as f:
        f.writelines(json.dumps({"text": text}) + "\n" for text in prompts)
    print(f"{args.out}: {len(prompts)} distinct prompts ({stubs_available} stdlib stubs available)")


if __name__ == "__main__":
    main()
