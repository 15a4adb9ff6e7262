"""The lattice of one drafter pass, and exact acceptance over a verified tree.

Acceptance walks the tree from the anchor with the target's own token at each node: greedy,
the argmax of the node's log-probabilities (as a plain decode step picks it); sampled, a
draw from the target's distribution there (``sampling.probs``: the same temperature and
filters as a plain step).  If a child of the node holds that token the walk moves to it and
goes on, else the token is emitted and the cycle ends.  Every emitted token is thus drawn
from the target's distribution given the tokens before it, whatever the tree holds, so the
output's distribution is the target's exactly.  (The chain's ``min(1, p/q)`` rule is not
used here: applied child by child to a tree built from top-k candidates it is biased.)

A sampled tree's first path was drawn from the drafter's rows ``q`` as a chain's draft is.
At a node of that path the drawn child is judged as the chain judges it: accepted with
probability min(1, p/q) of its token; on rejection the token comes from normalize(max(p -
q, 0)), and if another child holds it the walk moves there.  The emitted token is then
drawn from min(p, q) + max(p - q, 0) = p, as at any other node, so the output stays exact;
and the walk goes on with at least the chain's probability at every node of the path (the
chain's min(1, p/q), plus what the residual puts on the siblings).
"""

from typing import List, Optional, Tuple

import mlx.core as mx
import numpy as np

from .. import kernels
from ..kernels.selector import top_candidates
from ..request.sampling import SamplingParams, log_softmax, probs
from .grow import Tree

# Candidates per position of a DFlash 1 drafter's lattice (DFlash 2 uses its selector's).
V1_TOP_K = 16


def lattice(drafter, hidden: mx.array, anchor: int, logits: Optional[mx.array] = None) -> Tuple[np.ndarray, np.ndarray]:
    """Candidates [D, k] (token ids) and scores [D, k, k] of block positions 1..D from the
    drafter states ``hidden`` [1, D + 1, H] of [anchor, MASK ...] (``logits``: the drafter's
    of those positions, when the caller has them)."""
    h = hidden[0, 1:]
    logits = drafter.logits(h) if logits is None else logits
    if drafter.version == 1:
        cand, unary = top_candidates(logits, min(V1_TOP_K, logits.shape[-1]))
        cand = drafter.token_ids(cand)
        k = cand.shape[-1]
        scores = mx.broadcast_to(unary[:, None, :].astype(mx.float32), (cand.shape[0], k, k))
    else:
        sel = drafter.candidate_selector
        cand, unary = top_candidates(logits, min(sel.top_k, logits.shape[-1]))
        if drafter.vocab is not None:
            cand = drafter.vocab[cand]
        gate = sel.hidden_projection(h)
        scores, _, _ = kernels.select(unary, cand, gate, mx.array(anchor), sel.predecessor_codebook,
                                      sel.successor_codebook, 0.0, None)
    mx.eval(cand, scores)
    return np.array(cand), np.array(scores.astype(mx.float32))


def node_rows(logits: mx.array, history: mx.array, tree: Tree, nodes: List[int], processors) -> mx.array:
    """Log-probabilities of the rows of ``nodes``, each after the logits processors with the
    tokens its own path follows."""
    rows = logits[mx.array(nodes)].astype(mx.float32)
    if processors:
        out = []
        for j, node in enumerate(nodes):
            tokens = mx.concatenate([history, mx.array(tree.tokens[tree.path_to(node)].astype(np.int32))])
            row = rows[j : j + 1]
            for proc in processors:
                row = proc(tokens, row)
            out.append(row)
        rows = mx.concatenate(out)
    return log_softmax(rows)


def accept(tree: Tree, logits: mx.array, history: mx.array, processors: Optional[list],
           params: SamplingParams, q: Optional[mx.array] = None) -> Tuple[List[int], int, mx.array]:
    """Walk the verified ``tree`` (``logits`` [n, V], the pass's rows; ``q`` [tree.drawn, V],
    the rows its drawn path came from): (the accepted path's nodes, the anchor first; the
    target's token after it; the log-probabilities of the path's rows)."""
    children = tree.children()
    if params.greedy and not processors:  # every row at once: one read
        rows = log_softmax(logits.astype(mx.float32))
        top = mx.argmax(rows, axis=-1).tolist()
        path = [0]
        while top[path[-1]] in children[path[-1]]:
            path.append(children[path[-1]][top[path[-1]]])
        return path, top[path[-1]], rows[mx.array(path)]
    path, rows = [0], []
    while True:
        node = path[-1]
        row = node_rows(logits, history, tree, [node], processors)
        rows.append(row)
        if params.greedy:
            token = int(mx.argmax(row, axis=-1).item())
        else:
            p = probs(row, params)[0]
            if node < tree.drawn:  # the drawn child first, as the chain judges its draft
                drawn = int(tree.tokens[node + 1])
                if (mx.random.uniform() * q[node, drawn] < p[drawn]).item():
                    path.append(node + 1)
                    continue
                p = mx.maximum(p - q[node], 0)
            noise = mx.random.gumbel(shape=(row.shape[-1],))
            token = int(mx.argmax(mx.log(p) + noise).item())
        if token not in children[node]:
            return path, token, mx.concatenate(rows)
        path.append(children[node][token])
