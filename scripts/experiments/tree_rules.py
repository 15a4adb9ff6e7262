"""Which ranking of drafted paths gives trees the most accepted tokens per verify pass?

Greedy decoding is lossless, so the anchors a T=0 run visits and the drafter's lattice at
each of them are fixed by plain decoding's text: this script decodes each prompt plainly,
reads the drafter's lattice at every anchor once (the target's features of the text so
far, as the loop feeds them), and then replays runs offline for each ranking rule: a cycle
grows a tree of the budget's nodes, accepts the longest path that matches the text, and
moves on by the accepted tokens plus the target's own. Prints tau (tokens per cycle) per rule
and budget, and the chain's (the walk alone) and the oracle's (the true tokens while they
are in each position's candidates) beside them.

Prompts: the five benchmark sets' prompts from --skip on (the bench itself reads the first
ones), so a rule is chosen on other prompts than it is judged on.

    python scripts/experiments/tree_rules.py [--per-set 6] [--skip 10] [--max-tokens 64] [--bounds]

``--bounds`` adds a re-ranker fitted on the very runs it is judged on (an optimistic bound on
any re-ranking of the lattice), the same with the previous anchor's lattice as a second
opinion, and trees and chains that both take the copy the context offers (``loop/lookup.py``).
"""

import argparse
import time

import mlx.core as mx
import numpy as np

from dflash2_mlx import load
from dflash2_mlx.builtin.bench_sets import SHIPPED_BENCH_DIR
from dflash2_mlx.kernels.selector import top_candidates
from dflash2_mlx.loop.draft_context import DraftContext
from dflash2_mlx.loop.lookup import Lookup
from dflash2_mlx.loop.target import attach
from dflash2_mlx.request.prompt import encode_prompt
from dflash2_mlx.train.data import read_prompts
from dflash2_mlx.tree.accept import lattice
from dflash2_mlx.tree.grow import Tree, grow, log_softmax


def plain_text(model, ids, n):
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=n):
        out.append(int(tok))
    return out


def lattices(model, drafter, ids, text, block):
    """Per anchor i (text[i], the context the prompt and text[:i]): (cand, scores, unary)."""
    target = attach(model, drafter)
    seq = mx.array([ids + text[:-1]])
    _, feats = target(seq, target.make_cache())
    mx.eval(feats)
    P, out = len(ids), []
    mask = drafter.config.mask_token_id
    for i, anchor in enumerate(text[:-1]):
        ctx = DraftContext(drafter)
        ctx.add(feats[:, : P + i])
        hidden = drafter(mx.array([[anchor] + [mask] * (block - 1)]), ctx.fed())
        cand, scores = lattice(drafter, hidden, anchor)
        logits = drafter.logits(hidden[0, 1:])
        top, _ = top_candidates(logits, cand.shape[-1])  # the lattice's candidates, in the draft vocabulary
        unary = np.take_along_axis(log_softmax(np.array(logits.astype(mx.float32))), np.array(top), axis=-1)
        out.append((cand, scores, unary))
    return out


def accepted(tree, truth):
    """The longest path of ``tree`` that follows ``truth`` (the text after the anchor)."""
    kids = tree.children()
    node, n = 0, 0
    while n < len(truth) and int(truth[n]) in kids[node]:
        node = kids[node][int(truth[n])]
        n += 1
    return n


def run(lats, text, tree_of):
    """tau of a T=0 run whose cycle at anchor i verifies tree_of(i)."""
    i, cycles, tokens = 0, 0, 0
    while i < len(lats):
        a = accepted(tree_of(i), text[i + 1:])
        cycles += 1
        tokens += a + 1
        i += a + 1
    return tokens, cycles


def oracle(lats, text):
    def tree_of(i):
        cand = lats[i][0]
        n = 0
        while n < len(cand) and n + 1 < len(text) - i and text[i + 1 + n] in set(cand[n].tolist()):
            n += 1
        return Tree(np.array([text[i]] + text[i + 1 : i + 1 + n]), np.arange(-1, n), np.arange(n + 1))
    return tree_of


def rule(name, temp=1.0, alpha=None):
    """A tree grower over one anchor's (cand, scores, unary)."""
    def make(lat, anchor, budget):
        cand, scores, unary = lat
        if alpha is None:
            s = scores
        else:  # the selector's conditional rows mixed with the drafter's own marginals
            s = alpha * log_softmax(scores) + (1 - alpha) * unary[:, None, :]
        return grow(anchor, cand, s, budget, temp)
    make.name = name
    return make


def best_first(name, temp):
    """Best first from the anchor without the walk's path first (what the walk-first rule,
    which keeps a tree at least the chain every cycle, gives up)."""
    def make(lat, anchor, budget):
        cand, scores, _ = lat
        return grown(anchor, cand, log_softmax(scores / temp), budget)
    make.name = name
    return make


def grown(anchor, cand, logp, budget):
    """The ``budget`` nodes of highest path log-probability under ``logp`` [D, k, k]
    (row a of position t: the log-probabilities of t's candidates after candidate a)."""
    import heapq

    tokens, parents, depths, index, total, frontier = [anchor], [-1], [0], [0], [0.0], []

    def offer(node):
        if depths[node] < len(cand):
            for c, lp in enumerate(logp[depths[node], index[node]]):
                heapq.heappush(frontier, (-(total[node] + lp), node, c))

    offer(0)
    while len(tokens) <= budget and frontier:
        neg, parent, c = heapq.heappop(frontier)
        tokens.append(int(cand[depths[parent], c]))
        parents.append(parent)
        depths.append(depths[parent] + 1)
        index.append(c)
        total.append(-neg)
        offer(len(tokens) - 1)
    return Tree(np.array(tokens), np.array(parents), np.array(depths))


def features(lat, t, a, before=None):
    """Per candidate of position t + 1 under predecessor a: what the lattice says of it (the
    selector's row at T=1 and 1.5, the drafter's marginal, rank, the row's confidence, the
    depth), and with ``before`` (the previous anchor's lattice) its marginal there."""
    cand, scores, unary = lat
    k = cand.shape[1]
    s1, s15, u = log_softmax(scores[t, a]), log_softmax(scores[t, a] / 1.5), unary[t]
    depth = np.zeros((k, len(cand)))
    depth[:, t] = 1
    cols = [s1, s15, u, np.exp(s1), np.exp(u), np.log1p(np.arange(k)), np.arange(k) == 0,
            np.full(k, s1.max()), np.full(k, u.max()), np.full(k, np.log1p(a)),
            s1[:, None] * depth, u[:, None] * depth, depth]
    if before is not None:
        seen = np.full(k, -20.0)
        if t + 1 < len(before[0]):
            where = {int(x): j for j, x in enumerate(before[0][t + 1])}
            for c in range(k):
                j = where.get(int(cand[t, c]))
                seen[c] = before[2][t + 1, j] if j is not None else -20.0
        cols += [seen, seen > -20.0]
    return np.column_stack(cols).astype(np.float64)


def fitted(data, with_before: bool):
    """A re-ranker fitted on the very runs it is judged on (logistic regression of "this
    candidate is the text's token, given its parent is" on ``features``): an optimistic
    bound on what any re-ranking of the lattice can give a tree."""
    X, Y = [], []
    for text, lats in data:
        for i, lat in enumerate(lats):
            a = 0
            for t in range(min(len(lat[0]), len(text) - i - 1)):
                X.append(features(lat, t, a, (lats[i - 1] if i else lat) if with_before else None))
                hit = lat[0][t] == text[i + 1 + t]
                Y.append(hit)
                if not hit.any():
                    break
                a = int(np.flatnonzero(hit)[0])
    X, Y = np.concatenate(X), np.concatenate(Y).astype(np.float64)
    mu, sd = X.mean(0), X.std(0) + 1e-6
    Xn = np.column_stack([(X - mu) / sd, np.ones(len(X))])
    w = np.zeros(Xn.shape[1])
    for _ in range(30):  # Newton's method, a little L2
        p = 1 / (1 + np.exp(-Xn @ w))
        H = (Xn * (p * (1 - p))[:, None]).T @ Xn + 1e-2 * np.eye(w.size)
        w -= np.linalg.solve(H, Xn.T @ (p - Y) + 1e-2 * w)

    def tree_of(lats, i, anchor, budget):
        lat = lats[i]
        before = (lats[i - 1] if i else lat) if with_before else None
        D, k = lat[0].shape
        logp = np.zeros((D, k, k))  # the fitted log-probabilities, each candidate on its own
        for t in range(D):
            for a in range(k if t else 1):
                z = np.column_stack([(features(lat, t, a, before) - mu) / sd, np.ones(k)]) @ w
                logp[t, a] = -np.logaddexp(0, -z)
        return grown(anchor, lat[0], logp, budget)
    return tree_of


def trie_tree(paths) -> Tree:
    """The tree that holds every path of ``paths`` (token lists after the anchor, which is
    not read), shared prefixes once."""
    nodes = sorted({tuple(p[:n]) for p in paths for n in range(1, len(p) + 1)}, key=len)
    at = {(): 0}
    for i, node in enumerate(nodes, 1):
        at[node] = i
    return Tree(np.array([-1] + [n[-1] for n in nodes]), np.array([-1] + [at[n[:-1]] for n in nodes]),
                np.array([0] + [len(n) for n in nodes]))


def paths(tree):
    kids = tree.children()
    return [tree.tokens[tree.path_to(i)[1:]].tolist() for i in range(1, tree.tokens.size) if not kids[i]]


def copying(ids, text, tree_of, length, budget):
    """``tree_of`` with the copy the context offers at anchor i (``loop/lookup.py``, up to
    ``length`` deep) as one more path, the tree's own paths cut back until both fit the
    budget; None for ``budget``: the copy alone where there is one (a chain with copies)."""
    def make(i):
        copy = Lookup(ids + text[: i + 1]).draft(length)
        if not copy:
            return tree_of(i, budget)
        if budget is None:
            return trie_tree([copy])
        for b in range(budget, -1, -1):
            tree = trie_tree(paths(tree_of(i, b)) + [copy] if b else [copy])
            if tree.size <= budget:
                return tree
    return make


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--per-set", type=int, default=6)
    ap.add_argument("--skip", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--save", help="keep the decoded texts and lattices in this scratch file")
    ap.add_argument("--bounds", action="store_true",
                    help="also the fitted re-ranker's bound and trees that hold the context's copy")
    args = ap.parse_args()
    model, tok, drafter = load()
    block = drafter.config.block_size
    prompts = []
    for path in sorted(SHIPPED_BENCH_DIR.glob("*.jsonl")):
        got = read_prompts(path, limit=args.skip + args.per_set)[args.skip:]
        prompts += [p for _, p in got]
    tic = time.perf_counter()
    data, prompt_ids = [], []
    for p in prompts:
        ids = encode_prompt(tok, p).tolist()
        text = plain_text(model, ids, args.max_tokens)
        data.append((text, lattices(model, drafter, ids, text, block)))
        prompt_ids.append(ids)
    if args.save:  # the texts and lattices, as arrays (np.load reads them back)
        arrays = {}
        for i, (text, lats) in enumerate(data):
            arrays[f"text{i}"] = np.array(text)
            for j, name in enumerate(("cand", "scores", "unary")):
                arrays[f"{name}{i}"] = np.stack([lat[j] for lat in lats])
        np.savez_compressed(args.save, **arrays)
    print(f"{len(prompts)} prompts, {args.max_tokens} tokens each, drafter block {block}: lattices in "
          f"{time.perf_counter() - tic:.0f} s")
    rules = [rule("selector T=1"), rule("selector T=0.7", 0.7), rule("selector T=1.5 (shipped)", 1.5),
             rule("selector T=2", 2.0), rule("marginals", alpha=0.0), rule("mix 0.5", alpha=0.5),
             rule("mix 0.5 T=1.5", 1.5, alpha=0.5), rule("mix 0.75", alpha=0.75),
             best_first("no walk first, T=1.5", 1.5)]

    def tau(tree_of_text):
        t = c = 0
        for text, lats in data:
            a, b = run(lats, text, tree_of_text(text, lats))
            t, c = t + a, c + b
        return t / c

    chain = tau(lambda text, lats: lambda i: rule("walk")(lats[i], text[i], block - 1))
    best = tau(lambda text, lats: oracle(lats, text))
    print(f"chain (the walk, block {block}): tau {chain:.3f}   oracle over the top {data[0][1][0][0].shape[-1]}: {best:.3f}")
    print("rule".ljust(26) + "".join(f"  tree {b:>2}" for b in args.budgets))
    for r in rules:
        row = [tau(lambda text, lats: lambda i: r(lats[i], text[i], b)) for b in args.budgets]
        print(r.name.ljust(26) + "".join(f"  {x:6.3f} ({x / chain:.2f}x)" for x in row))
    if not args.bounds:
        return
    for name, before in (("fitted (in-sample bound)", False), ("fitted + previous lattice", True)):
        grow_fitted = fitted(data, before)
        row = [tau(lambda text, lats: lambda i: grow_fitted(lats, i, text[i], b)) for b in args.budgets]
        print(name.ljust(26) + "".join(f"  {x:6.3f} ({x / chain:.2f}x)" for x in row))
    # Copies in both: the chain takes the copy where there is one (as a fixed block does);
    # the tree holds it beside its own paths.
    ids_of = {id(lats): ids for (_, lats), ids in zip(data, prompt_ids)}
    walk, shipped = rule("walk"), rule("", 1.5)

    def with_copy(text, lats, budget):
        grower = lambda i, b: walk(lats[i], text[i], block - 1) if budget is None else shipped(lats[i], text[i], b)
        return copying(ids_of[id(lats)], text, grower, block - 1, budget)

    chain_copy = tau(lambda text, lats: with_copy(text, lats, None))
    print(f"with copies (up to {block - 1} deep) in both: chain {chain_copy:.3f}")
    row = [tau(lambda text, lats, b=b: with_copy(text, lats, b)) for b in args.budgets]
    print("selector T=1.5 + copy".ljust(26) + "".join(f"  {x:6.3f} ({x / chain_copy:.2f}x)" for x in row))


if __name__ == "__main__":
    main()
