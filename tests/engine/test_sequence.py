"""The per-request Sequence (its stop rule and budget) and the speculative step's metadata bundle."""

from __future__ import annotations

import torch

from engine.prompt_lookup import ContextIndex
from engine.sequence import Sequence
from engine.spec_step import SpecMetadata
from sampling import NO_PROPOSAL, Proposal, RequestRng, SamplingParams, point_mass
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


def test_metadata_of_chains_of_one_depth_and_law_is_a_chain():
    seqs = [sequence(), sequence(prompt=(1, 2))]
    probs = torch.softmax(torch.randn(2, 2, 11, generator=torch.Generator().manual_seed(0)), -1)
    chain = [Proposal([3, 4], [-1, 0], probs[0]), Proposal([5, 6], [-1, 0], probs[1])]
    meta = SpecMetadata.build(seqs, chain, 11, torch.device("cpu"))
    assert meta.chain and meta.num_nodes == [2, 2] and meta.positions == [None, None]
    assert torch.equal(meta.draft_token_ids, torch.tensor([[3, 4], [5, 6]])) and torch.equal(meta.draft_probs, probs)
    point = SpecMetadata.build(seqs, [Proposal([3], [-1], None), Proposal([5], [-1], None)], 11, torch.device("cpu"))
    assert point.chain and point.draft_probs is None and point.positions == [3, 2]  # coupled at len(history)


def test_metadata_of_mixed_rows_pads_and_writes_point_masses_densely():
    seqs = [sequence(), sequence(), sequence()]
    dense = torch.softmax(torch.randn(3, 11, generator=torch.Generator().manual_seed(1)), -1)
    proposals = [Proposal([3, 4], [-1, 0], None), Proposal([5, 6, 8], [-1, -1, 0], dense), NO_PROPOSAL]
    meta = SpecMetadata.build(seqs, proposals, 11, torch.device("cpu"))
    assert not meta.chain and meta.num_nodes == [2, 3, 0] and meta.positions == [3, None, 3]
    assert meta.draft_token_ids.tolist() == [[3, 4, 0], [5, 6, 8], [0, 0, 0]]
    assert meta.parents.tolist() == [[-1, 0, -1], [-1, -1, 0], [-1, -1, -1]]
    assert torch.equal(meta.draft_probs[0, :2], point_mass(torch.tensor([3, 4]), 11))
    assert torch.equal(meta.draft_probs[1], dense)
