"""Prompt lookup: draft the continuation of an earlier occurrence of the context's suffix.

A request's context (prompt + every emitted token) often repeats itself: a summary quotes
its passage, an edited function copies most of its lines, extracted fields are spans of the
input. Prompt lookup proposes, for the longest suffix n-gram (n from `hi` down to `lo`) that
occurred earlier in the context, the tokens that followed its most recent earlier
occurrence. It needs no weights, and its law is a point mass at each proposed token, which
the verifier takes as is: the output law stays the target's.

`ContextIndex` keeps, per n, a dict from each n-gram to the last position it ended at,
indexed incrementally: a step costs a few dict operations per new token, never a scan of
the context. The first fill (a whole prompt) builds the tuples in C (`zip` of shifted
slices). Trees (k candidates) take the k most recent DISTINCT continuations of the longest
matching n-grams; that search is a vectorised scan of the context, done only for trees.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

FEW = 8  # new n-grams indexed one by one; more (a prompt) through shifted slices built in C


def check_lookup_range(lo: int, hi: int) -> None:
    """The --prompt-lookup-min / --prompt-lookup-max pair."""
    if lo < 1:
        raise ValueError(f"--prompt-lookup-min: expected >= 1, got {lo}")
    if hi < lo:
        raise ValueError(f"--prompt-lookup-max: expected >= --prompt-lookup-min ({lo}), got {hi}")


class ContextIndex:
    """One request's context and its n-gram index (lo <= n <= hi). `tokens` is held, not
    copied: its owner appends the tokens it emits, and the next lookup indexes them."""

    def __init__(self, tokens: list[int], lo: int = 2, hi: int = 5) -> None:
        check_lookup_range(lo, hi)
        self.lo, self.hi = lo, hi
        self.tokens = tokens
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self._shortest = self._last[lo]  # every match's first test (`match`)
        self._indexed = 0  # n-grams ending before this position are in the tables

    def _index(self) -> None:
        """Index every n-gram ending before the last token: the suffix itself must find an
        EARLIER occurrence, whose next token is then known."""
        end = len(self.tokens) - 1
        if end <= self._indexed:
            return
        toks = self.tokens
        if end - self._indexed <= FEW:  # a step's few new tokens: one tuple each, sliced per n
            for last in range(self._indexed, end):
                window = tuple(toks[max(0, last - self.hi + 1) : last + 1])  # the n-grams ending at `last`
                for n, table in self._last.items():
                    if n <= len(window):
                        table[window[-n:]] = last
        else:
            for n, table in self._last.items():
                start = max(self._indexed, n - 1)  # position of the last token of the first new n-gram
                shifted = [toks[start - n + 1 + j : end - n + 1 + j] for j in range(n)]
                table.update(
                    zip(zip(*shifted, strict=True), range(start, end), strict=True)
                )  # later positions overwrite: most recent wins
        self._indexed = end

    def match(self, k: int, tail: Sequence[int] = ()) -> tuple[list[int], int]:
        """Up to k tokens following the most recent earlier occurrence of the longest matching
        suffix, and that suffix's length n (([], 0): no n-gram of the suffix occurred before).
        `tail`: tokens taken to follow the context without being part of it (drafts whose
        verification is still on the device): the suffix and the continuation read the context
        and then them, the occurrences are the indexed context's."""
        if k <= 0:
            return [], 0
        self._index()
        toks, tail, lo = self.tokens, list(tail) if tail else [], self.lo
        size = len(toks) + len(tail)
        if size <= lo:
            return [], 0
        # Every earlier occurrence of a longer suffix ends with one of the shortest: without that,
        # no n matches. So the usual step of a row with no match costs one lookup of its last lo
        # tokens, and no suffix is built.
        shortest = toks[-lo:] if not tail else (toks[-(lo - len(tail)) :] if lo > len(tail) else []) + tail[-lo:]
        if tuple(shortest) not in self._shortest:
            return [], 0
        hi = min(self.hi, size - 1)
        # the last hi tokens of both, no copy of the rest
        suffix = tuple((toks[-hi:] if hi > len(tail) else []) + tail[-hi:])
        for n in range(hi, self.lo - 1, -1):
            end = self._last[n].get(suffix[-n:])
            if end is not None:  # end < len(toks) - 1: the continuation starts in the context
                return (toks[end + 1 : end + 1 + k] + tail)[:k], n
        return [], 0

    def candidates(self, k: int, count: int) -> list[list[int]]:
        """Up to `count` continuations of up to k tokens with distinct first tokens: the most
        recent earlier occurrences of the longest matching suffixes first (count = 1: `match`)."""
        if count <= 1:
            chain, _ = self.match(k)
            return [chain] if chain else []
        if k <= 0:
            return []
        arr = np.asarray(self.tokens, dtype=np.int64)
        out: list[list[int]] = []
        seen: set[int] = set()
        for n in range(min(self.hi, len(arr) - 1), self.lo - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # [L-n, n]: n-grams ending before the last
            ends = np.flatnonzero((windows == arr[-n:]).all(1)) + n - 1
            for end in ends[::-1].tolist():
                first = int(arr[end + 1])
                if first not in seen:
                    seen.add(first)
                    out.append(arr[end + 1 : end + 1 + k].tolist())
                    if len(out) == count:
                        return out
        return out


def chains_to_tree(chains: list[list[int]]) -> tuple[list[int], list[int]]:
    """Chains with distinct first tokens -> (ids, parents) of their tree in breadth-first order
    (parents[n] = -1 for the first tokens: children of the last emitted token)."""
    ids: list[int] = []
    parents: list[int] = []
    last = [-1] * len(chains)  # node index of each chain's deepest node so far
    depth = 0
    while True:
        level = [c for c, chain in enumerate(chains) if depth < len(chain)]
        if not level:
            return ids, parents
        for c in level:
            ids.append(chains[c][depth])
            parents.append(last[c])
            last[c] = len(ids) - 1
        depth += 1
