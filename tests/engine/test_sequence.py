"""The per-request Sequence: its stop rule, budget and statistics."""

from __future__ import annotations

from engine.prompt_lookup import ContextIndex
from engine.sequence import Sequence
from sampling import Proposal, RequestRng, SamplingParams
from sampling.proposal import LOOKUP

EOS, STOP = 9, 7


def sequence(prompt=(1, 2, 3), budget=5, k=2, **kw) -> Sequence:
    return Sequence(
        prompt=list(prompt),
        params=SamplingParams(),
        budget=budget,
        rng=RequestRng(0),
        k=k,
        **{"eos_token_ids": (EOS,), "stop_token_ids": (STOP,), **kw},
    )


def test_append_keeps_tokens_up_to_the_one_that_ends_it():
    seq = sequence(budget=10)
    assert seq.append([4, 5]) == ([4, 5], "")
    assert seq.append([6, STOP, 8]) == ([6, STOP], "stop")
    assert seq.history == [1, 2, 3, 4, 5, 6, STOP] and seq.generated == 4 and seq.remaining == 6


def test_eos_wins_over_stop_and_both_over_the_budget():
    seq = sequence(budget=2, stop_token_ids=(EOS,))
    seq.append([4])
    assert seq.append([EOS]) == ([EOS], "eos")  # the 2nd token: budget reached, EOS and stop id too
    seq = sequence(budget=2)
    assert seq.append([4, 5, 6]) == ([4, 5], "length")
    assert seq.remaining == 0


def test_the_budget_counts_tokens_generated_on_another_node():
    seq = sequence(budget=3, history=[1, 2, 3, 4])  # the prefill node's first token came with it
    assert seq.generated == 1 and seq.remaining == 2
    assert seq.append([5, 6, 7]) == ([5, 6], "length")


def test_the_lookup_index_sees_appended_tokens():
    seq = sequence(prompt=(1, 2, 3, 1, 2), budget=10, k=3)
    seq.lookup = ContextIndex(seq.history, 2, 3)
    assert seq.lookup.match(3)[0] == [3, 1, 2]
    seq.append([3, 5])  # ...1 2 3 5: "3 5" never occurred before
    assert seq.lookup.match(3) == ([], 0)
    seq.append([1, 2])  # ...3 5 1 2: the most recent earlier "1 2" was followed by "3 5"
    assert seq.lookup.match(2)[0] == [3, 5]


def test_stats_arrays_follow_k_and_candidates():
    seq = sequence(k=3, candidates=2, method=LOOKUP)
    stats = seq.stats
    assert stats.accepted_per_position == [0, 0, 0] and stats.accepted_per_rank == [0, 0]
    assert stats.chosen_k == [0] * 4 and stats.method == LOOKUP
    ranks = stats.record(Proposal([5, 6, 7, 8], [-1, -1, 0, 1], None, LOOKUP), [1, 3])
    assert ranks == [1, 0] and stats.accepted_tokens == 2 and stats.prompt_lookup_tokens == 4
    assert stats.accepted_per_position == [1, 1, 0] and stats.accepted_per_rank == [1, 1]


def test_kv_need_is_prompt_budget_nodes_and_the_token_they_follow():
    assert sequence(prompt=range(10), budget=7).kv_need(4) == 10 + 7 + 4 + 1
