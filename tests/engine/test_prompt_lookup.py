"""Prompt lookup (engine/prompt_lookup.py) against a brute-force reference: the longest suffix
n-gram (lo..hi) that occurred EARLIER, its most recent earlier occurrence, what followed it;
incremental indexing of a held, growing list equals a fresh index; candidate chains and the
breadth-first tree they make."""

from __future__ import annotations

import random

import pytest

from engine.prompt_lookup import ContextIndex, chains_to_tree, check_lookup_range


def reference_ends(tokens: list[int], n: int) -> list[int]:
    """End positions of the earlier occurrences of the last n tokens, most recent first (an
    occurrence ends before the last token: the suffix itself is never its own match)."""
    suffix = tokens[len(tokens) - n :]
    return [end for end in range(len(tokens) - 2, n - 2, -1) if tokens[end - n + 1 : end + 1] == suffix]


def reference_match(tokens: list[int], lo: int, hi: int, k: int) -> tuple[list[int], int]:
    if k <= 0:
        return [], 0
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        ends = reference_ends(tokens, n)
        if ends:
            return tokens[ends[0] + 1 : ends[0] + 1 + k], n
    return [], 0


def reference_candidates(tokens: list[int], lo: int, hi: int, k: int, count: int) -> list[list[int]]:
    if count <= 1:
        chain, _ = reference_match(tokens, lo, hi, k)
        return [chain] if chain else []
    if k <= 0:
        return []
    out, seen = [], set()
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        for end in reference_ends(tokens, n):
            if tokens[end + 1] not in seen:
                seen.add(tokens[end + 1])
                out.append(tokens[end + 1 : end + 1 + k])
                if len(out) == count:
                    return out
    return out


# -- match ---------------------------------------------------------------------------


def test_the_most_recent_earlier_occurrence_wins():
    tokens = [1, 2, 9, 1, 2, 8, 1, 2]  # (1, 2) ends at 1 and at 4 before the suffix
    assert ContextIndex(tokens, 2, 2).match(8) == ([8, 1, 2], 2)


def test_the_longest_suffix_n_gram_wins_over_a_more_recent_shorter_one():
    tokens = [3, 1, 2, 9, 4, 1, 2, 8, 3, 1, 2]  # (3, 1, 2) at 0..2; (1, 2) more recently at 5..6
    assert ContextIndex(tokens, 2, 5).match(3) == ([9, 4, 1], 3)
    assert ContextIndex(list(tokens), 2, 2).match(3) == ([8, 3, 1], 2)  # hi = 2: only bigrams


def test_no_earlier_occurrence_is_no_match():
    assert ContextIndex([1, 2, 3, 4, 5], 2, 5).match(4) == ([], 0)
    assert ContextIndex([1, 2, 3, 1], 2, 5).match(4) == ([], 0)  # (3, 1) never occurred before
    assert ContextIndex([1, 2, 3, 1], 1, 5).match(4) == ([2, 3, 1], 1)  # lo = 1: the unigram (1,) did


@pytest.mark.parametrize("tokens", [[], [7], [7, 8], [4, 5, 6]])
def test_short_or_novel_contexts_have_no_match(tokens):
    assert ContextIndex(tokens, 1, 5).match(4) == ([], 0)
    assert ContextIndex(tokens, 1, 5).candidates(4, 3) == []


def test_the_suffix_is_never_its_own_match():
    # Every suffix occurs once (itself): nothing earlier, whatever the range.
    assert ContextIndex([1, 2], 2, 2).match(4) == ([], 0)
    assert ContextIndex([5, 6, 7, 8], 1, 4).match(4) == ([], 0)
    # A run: the earlier occurrence overlaps the suffix, and its continuation is the last token.
    assert ContextIndex([7, 7, 7], 2, 2).match(4) == ([7], 2)
    assert ContextIndex([7, 7], 1, 5).match(4) == ([7], 1)
    # A period-2 context: the continuation runs into the suffix, up to the end of the context.
    assert ContextIndex([1, 2, 1, 2], 2, 5).match(9) == ([1, 2], 2)


def test_k_truncates_and_k_zero_proposes_nothing():
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    index = ContextIndex(tokens, 2, 3)
    assert index.match(10) == ([3, 4, 5, 6, 7, 1, 2], 2)
    for k in range(1, 8):
        assert index.match(k) == ([3, 4, 5, 6, 7, 1, 2][:k], 2)
    assert index.match(0) == ([], 0)
    assert index.match(-1) == ([], 0)
    assert index.candidates(0, 3) == []


def test_the_list_is_held_by_reference():
    tokens = [1, 2, 3]
    index = ContextIndex(tokens, 2, 5)
    assert index.match(4) == ([], 0)
    tokens += [9, 1, 2]
    assert index.match(4) == ([3, 9, 1, 2], 2)
    tokens.append(3)
    assert index.match(4) == ([9, 1, 2, 3], 3)
    assert index.tokens is tokens


def random_tokens(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]


def test_match_equals_the_reference_on_random_contexts():
    rng = random.Random(1234)
    for _ in range(400):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 6)
        tokens = random_tokens(rng, rng.randint(0, 40), rng.randint(2, 5))
        k = rng.randint(0, 6)
        assert ContextIndex(tokens, lo, hi).match(k) == reference_match(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_a_tail_continues_the_context_and_only_the_context_holds_occurrences():
    """match(k, tail): the suffix of context + tail, the most recent occurrence that ends before
    the context's last token (the tail is not indexed), and the tokens after it read on into
    the tail: the reference over the joined tokens with those occurrences alone."""
    rng = random.Random(4321)
    seen = 0
    for _ in range(600):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 6)
        vocab = rng.randint(2, 4)
        tokens, tail = random_tokens(rng, rng.randint(0, 30), vocab), random_tokens(rng, rng.randint(0, 5), vocab)
        k = rng.randint(0, 6)
        joined, want = tokens + tail, ([], 0)
        for n in range(min(hi, len(joined) - 1), lo - 1, -1) if k > 0 else ():
            ends = [end for end in reference_ends(joined, n) if end < len(tokens) - 1]
            if ends:
                want = joined[ends[0] + 1 : ends[0] + 1 + k], n
                seen += ends[0] + k >= len(tokens) and bool(tail)  # it runs on into the tail
                break
        assert ContextIndex(list(tokens), lo, hi).match(k, tail) == want, (tokens, tail, lo, hi, k)
    assert seen > 20


def test_incremental_indexing_equals_a_fresh_index():
    """Tokens appended to the held list between lookups (one, several, none at a time) give the
    answers of an index built over the same tokens at once, and of the reference."""
    rng = random.Random(99)
    checked = 0
    for _ in range(300):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 6)
        vocab = rng.randint(2, 4)
        tokens = random_tokens(rng, rng.randint(0, 12), vocab)
        index = ContextIndex(tokens, lo, hi)
        for _ in range(rng.randint(1, 12)):
            tokens += random_tokens(rng, rng.choice([0, 1, 1, 1, 2, 5]), vocab)
            k = rng.randint(1, 6)
            expected = reference_match(tokens, lo, hi, k)
            assert index.match(k) == expected, (tokens, lo, hi, k)
            assert ContextIndex(list(tokens), lo, hi).match(k) == expected
            count = rng.randint(1, 4)
            assert index.candidates(k, count) == reference_candidates(tokens, lo, hi, k, count), (tokens, count)
            checked += 1
    assert checked > 1000


def test_matches_happen_in_the_random_cases():
    """The random cases exercise matches of several lengths, not only ([], 0)."""
    rng = random.Random(1234)
    lengths = set()
    for _ in range(400):
        tokens = random_tokens(rng, rng.randint(0, 40), rng.randint(2, 5))
        lengths.add(ContextIndex(tokens, 1, 6).match(4)[1])
    assert lengths >= {0, 1, 2, 3, 4, 5, 6}


# -- candidates ----------------------------------------------------------------------


def test_candidates_have_distinct_first_tokens_most_recent_first():
    tokens = [5, 1, 2, 7, 1, 2, 8, 8, 1, 2, 7, 0, 1, 2]
    index = ContextIndex(tokens, 2, 2)
    # (1, 2) ended at 9, 5, 2 before the suffix: continuations 7.., 8.., 7.. (a repeat first token)
    assert index.candidates(2, 4) == [[7, 0], [8, 8]]
    assert index.candidates(2, 1) == [[7, 0]] == [index.match(2)[0]]


def test_candidates_fall_back_to_shorter_n_grams():
    tokens = [4, 1, 2, 3, 9, 2, 3, 5, 2, 3, 6, 4, 1, 2, 3]
    index = ContextIndex(tokens, 2, 4)
    # 4-gram (4, 1, 2, 3) -> 9; then 3-gram (1, 2, 3) has no other; then (2, 3) -> 6, 5, (9 seen)
    assert index.candidates(1, 5) == [[9], [6], [5]]
    assert index.candidates(3, 2) == [[9, 2, 3], [6, 4, 1]]


def test_candidates_on_random_contexts():
    rng = random.Random(7)
    for _ in range(400):
        lo = rng.randint(1, 3)
        hi = rng.randint(lo, 5)
        tokens = random_tokens(rng, rng.randint(0, 30), rng.randint(2, 5))
        k, count = rng.randint(1, 5), rng.randint(1, 4)
        index = ContextIndex(tokens, lo, hi)
        got = index.candidates(k, count)
        assert got == reference_candidates(tokens, lo, hi, k, count), (tokens, lo, hi, k, count)
        assert len(got) <= count and all(1 <= len(chain) <= k for chain in got)
        assert len({chain[0] for chain in got}) == len(got)
        chain, _ = index.match(k)
        assert index.candidates(k, 1) == ([chain] if chain else [])
        assert got[:1] == index.candidates(k, 1)  # the first candidate is the match


# -- chains_to_tree ------------------------------------------------------------------


def chains_of(ids: list[int], parents: list[int]) -> list[list[int]]:
    """Every root-to-leaf path of the tree, as token lists, in leaf order."""
    has_child = {p for p in parents if p >= 0}
    out = []
    for leaf in range(len(ids)):
        if leaf in has_child:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(ids[node])
            node = parents[node]
        out.append(path[::-1])
    return out


def test_chains_to_tree_is_breadth_first():
    ids, parents = chains_to_tree([[1, 2, 3], [4], [5, 6]])
    assert ids == [1, 4, 5, 2, 6, 3]
    assert parents == [-1, -1, -1, 0, 2, 3]
    assert chains_to_tree([]) == ([], [])
    assert chains_to_tree([[3, 1, 4]]) == ([3, 1, 4], [-1, 0, 1])  # one chain: a chain


def test_chains_to_tree_on_random_chains():
    rng = random.Random(5)
    for _ in range(300):
        firsts = rng.sample(range(20), rng.randint(1, 5))
        chains = [[first, *random_tokens(rng, rng.randint(0, 5), 20)] for first in firsts]
        ids, parents = chains_to_tree(chains)
        assert len(ids) == len(parents) == sum(map(len, chains))
        assert all(-1 <= p < n for n, p in enumerate(parents))
        assert parents == sorted(parents)  # parents never decrease
        assert ids[: len(chains)] == firsts and parents[: len(chains)] == [-1] * len(chains)
        assert sorted(chains_of(ids, parents)) == sorted(chains)
        depth = [0] * len(ids)
        for n, p in enumerate(parents):
            depth[n] = 0 if p < 0 else depth[p] + 1
        assert depth == sorted(depth)  # level by level
        assert max(depth) + 1 == max(map(len, chains))


def test_candidates_make_a_tree_of_depth_k():
    tokens = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 7, 1, 2]
    chains = ContextIndex(tokens, 2, 2).candidates(3, 3)
    assert chains == [[7, 1, 2], [5, 6, 1], [3, 4, 1]]
    ids, parents = chains_to_tree(chains)
    assert sorted(chains_of(ids, parents)) == sorted(chains)
    assert ids == [7, 5, 3, 1, 6, 4, 2, 1, 1] and parents == [-1, -1, -1, 0, 1, 2, 3, 4, 5]


# -- the range -----------------------------------------------------------------------


def test_check_lookup_range_names_the_flags():
    check_lookup_range(1, 1)
    check_lookup_range(2, 5)
    with pytest.raises(ValueError, match="--prompt-lookup-min: expected >= 1, got 0"):
        check_lookup_range(0, 5)
    with pytest.raises(ValueError, match="--prompt-lookup-min"):
        check_lookup_range(-3, -3)
    with pytest.raises(ValueError, match=r"--prompt-lookup-max: expected >= --prompt-lookup-min \(3\), got 2"):
        check_lookup_range(3, 2)
    with pytest.raises(ValueError, match="--prompt-lookup-min"):
        ContextIndex([1, 2, 3], 0, 3)
    with pytest.raises(ValueError, match="--prompt-lookup-max"):
        ContextIndex([1, 2, 3], 4, 3)
