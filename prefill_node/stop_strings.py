"""Stop strings: matched by the prefill node on the detokenised text it streams (the token-id
stop rule of both nodes is `engine.sequence.finish_reason`)."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Finds the first stop string in a growing text. `push(piece)` returns the text that
    is safe to stream (a suffix that could still become a stop string is held back) and
    whether a stop string was found (the text then ends right before it)."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = [s for s in stop if s]
        self.pending = ""

    def push(self, piece: str) -> tuple[str, bool]:
        if not self.stop:
            return piece, False
        text = self.pending + piece
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.pending = ""
            return text[: min(hits)], True
        held = max((n for s in self.stop for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
        cut = len(text) - held
        self.pending = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        rest, self.pending = self.pending, ""
        return rest
