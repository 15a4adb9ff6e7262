"""Stop strings over streamed text: emit what cannot be the start of a stop string, hold
back the rest, and cut the text at the first stop string."""

from typing import Optional, Sequence, Tuple


class StopMatcher:
    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.text = ""  # everything generated so far
        self.sent = 0  # how much of it has been emitted
        self.text_after_stop = ""  # what followed the stop string in the piece that hit it
        self.hit: Optional[str] = None  # the stop string that hit (Anthropic's stop_sequence)

    def add(self, piece: str) -> Tuple[str, bool]:
        """Add generated text; returns (text safe to emit now, whether a stop string hit)."""
        start = max(0, self.sent - max((len(s) for s in self.stops), default=0))
        self.text += piece
        hits = [(i, -len(s)) for s in self.stops for i in [self.text.find(s, start)] if i >= 0]
        if hits:
            end, neg = min(hits)
            self.text_after_stop = self.text[end - neg:]
            self.hit = self.text[end:end - neg]
            out, self.text = self.text[self.sent:end], self.text[:end]
            self.sent = end
            return out, True
        end = len(self.text) - self._held_back()
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out, False

    def flush(self) -> str:
        """The held-back tail, once generation has ended without a stop string."""
        out, self.sent = self.text[self.sent:], len(self.text)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text) - self.sent), longest, -1):
                if self.text.endswith(s[:n]):
                    longest = n
                    break
        return longest
