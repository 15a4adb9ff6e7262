"""Context lookup: a draft copied from the sequence itself (prompt-lookup decoding).

Where the sequence's last n tokens (n = 4, else 3) occurred before, the tokens that
followed them then are a draft.  A small target repeats its prompt and itself a great
deal (names, numbers, code, its own loops), and there such a copy is accepted far more
often than the drafter's guess; elsewhere the drafter drafts.  A copy is a draft like any
other to the verify step: at T>0 its rows ``q`` are one-hot, so a copied token is
accepted with the target's own probability of it and a rejection samples the target's
distribution without it, which keeps the output exactly the target's.
"""

from typing import Dict, List, Sequence, Tuple

import mlx.core as mx

MIN_N, MAX_N = 3, 4


class Lookup:
    """The latest occurrence of every n-gram (MIN_N <= n <= MAX_N) of the tokens read so
    far (the prompt, then each token once it is known), kept up to date token by token."""

    def __init__(self, tokens: Sequence[int] = (), min_n: int = MIN_N, max_n: int = MAX_N):
        self.min_n, self.max_n = min_n, max_n
        self.tokens: List[int] = []
        self.ends: Dict[Tuple[int, ...], int] = {}  # n-gram -> where its latest occurrence ends
        self.match = None  # where the last n tokens' previous occurrence ended (longest n)
        self.extend(tokens)

    @property
    def repeating(self) -> bool:
        """Whether the last tokens occurred before: the next token likely continues the copy."""
        return self.match is not None

    def extend(self, tokens: Sequence[int]):
        for t in tokens:
            self.tokens.append(int(t))
            end = len(self.tokens)
            self.match = None
            for n in range(self.min_n, min(self.max_n, end) + 1):
                gram = tuple(self.tokens[end - n : end])
                self.match = self.ends.get(gram, self.match)
                self.ends[gram] = end

    def draft(self, length: int) -> List[int]:
        """Up to ``length`` tokens to follow the last one read: what followed the previous
        occurrence of the last n tokens (the longest n that occurred before).  A copy that
        runs into the present continues with itself (a loop of period p repeats), so a
        match always yields ``length`` tokens; no match, none."""
        if self.match is None:
            return []
        seq, out = self.tokens, []
        for i in range(length):
            j = self.match + i
            out.append(seq[j] if j < len(seq) else out[j - len(seq)])
        return out


def one_hot_rows(draft: mx.array, vocab_size: int) -> mx.array:
    """The rows a copied draft was drawn from: all mass on the copied token."""
    return (mx.arange(vocab_size)[None, :] == draft[:, None]).astype(mx.float32)
