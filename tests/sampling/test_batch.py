"""The verifier's bundle: a step's proposals in its layout (`VerifyBatch.build`), and the checks
that name a field before anything is launched."""

from __future__ import annotations

import pytest
import torch

from sampling import NO_PROPOSAL, Proposal, RequestRng, SamplingParams, Verifier, VerifyBatch, point_mass
from sampling.verifier import padded


def test_chains_of_one_depth_and_law_are_a_chain():
    probs = torch.softmax(torch.randn(2, 2, 11, generator=torch.Generator().manual_seed(0)), -1)
    chain = [Proposal([3, 4], [-1, 0], probs[0]), Proposal([5, 6], [-1, 0], probs[1])]
    batch = VerifyBatch.build(chain, [4, 3], 11, torch.device("cpu"))
    assert batch.chain and batch.num_nodes == [2, 2] and batch.positions == [None, None]
    assert torch.equal(batch.draft_token_ids, torch.tensor([[3, 4], [5, 6]])) and torch.equal(batch.draft_probs, probs)
    point = VerifyBatch.build([Proposal([3], [-1], None), Proposal([5], [-1], None)], [3, 2], 11, torch.device("cpu"))
    assert point.chain and point.draft_probs is None and point.positions == [3, 2]  # coupled at their positions


def test_mixed_rows_are_padded_and_point_masses_written_densely():
    dense = torch.softmax(torch.randn(3, 11, generator=torch.Generator().manual_seed(1)), -1)
    proposals = [Proposal([3, 4], [-1, 0], None), Proposal([5, 6, 8], [-1, -1, 0], dense), NO_PROPOSAL]
    batch = VerifyBatch.build(proposals, [3, 3, 3], 11, torch.device("cpu"))
    assert not batch.chain and batch.num_nodes == [2, 3, 0] and batch.positions == [3, None, 3]
    assert batch.draft_token_ids.tolist() == [[3, 4, 0], [5, 6, 8], [0, 0, 0]]
    assert batch.parents.tolist() == [[-1, 0, -1], [-1, -1, 0], [-1, -1, -1]]
    assert torch.equal(batch.draft_probs[0, :2], point_mass(torch.tensor([3, 4]), 11))
    assert torch.equal(batch.draft_probs[1], dense)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        (VerifyBatch(torch.zeros(2, 3)), r"draft_token_ids: expected an int32\|int64 tensor of shape \[B, N\]"),
        (VerifyBatch(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 2, 5)), r"draft_probs: expected float32"),
        (
            VerifyBatch(torch.zeros(2, 3, dtype=torch.int64), parents=torch.zeros(2, 2, dtype=torch.int64)),
            r"parents: expected int32\|int64 of shape \[2, 3\]",
        ),
        (VerifyBatch(torch.zeros(2, 3, dtype=torch.int64), num_nodes=[3]), "num_nodes: expected 2 entries, got 1"),
        (
            VerifyBatch(
                torch.zeros(2, 3, dtype=torch.int64), parents=torch.zeros(2, 3, dtype=torch.int64), num_nodes=[3, 4]
            ),
            r"num_nodes: expected values in \[0, 3\], got 4",
        ),
        (VerifyBatch(torch.zeros(2, 3, dtype=torch.int64), num_nodes=[3, 2]), "num_nodes: expected 3 for every row"),
        (VerifyBatch(torch.zeros(2, 3, dtype=torch.int64), positions=[1]), "positions: expected 2 entries, got 1"),
    ],
)
def test_a_bad_batch_names_its_field(batch, message):
    with pytest.raises(ValueError, match=message):
        batch.check()


def test_the_verifier_checks_rows_and_logits_before_it_samples():
    verifier, rows = Verifier("torch"), [SamplingParams()] * 2
    batch = VerifyBatch(torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="params/rngs: expected 2 entries each, got 2 and 1"):
        verifier.verify(batch, torch.zeros(2, 4, 7), rows, [RequestRng(0)])
    with pytest.raises(ValueError, match=r"target_logits: expected shape \[2, 4, Vt\], got \[2, 3, 7\]"):
        verifier.verify(batch, torch.zeros(2, 3, 7), rows, [RequestRng(0), RequestRng(1)])


def test_per_row_logits_are_stacked_for_chains_and_padded_for_trees():
    verifier, rows, logits = Verifier("torch"), [SamplingParams()] * 2, torch.randn(2, 3, 7)
    chain = VerifyBatch(torch.tensor([[1, 2], [3, 4]]))
    want = verifier.verify(chain, logits, rows, [RequestRng(0)] * 2).output_token_ids
    assert torch.equal(verifier.verify(chain, list(logits), rows, [RequestRng(0)] * 2).output_token_ids, want)
    tree = VerifyBatch(torch.tensor([[1, 2], [3, 0]]), parents=torch.tensor([[-1, 0], [-1, -1]]), num_nodes=[2, 1])
    padded = logits.clone()
    padded[1, 2] = 0
    want = verifier.verify(tree, padded, rows, [RequestRng(0)] * 2)
    got = verifier.verify(tree, [logits[0], logits[1, :2]], rows, [RequestRng(0)] * 2)
    assert torch.equal(got.output_token_ids, want.output_token_ids)
    assert torch.equal(got.accepted_nodes, want.accepted_nodes)


def test_point_mass_chains_of_different_lengths_stay_a_chain_and_verify_as_the_tree_layout_does():
    """Prompt lookup's chains of 0..4 tokens in one batch take the chain kernel, padded to the
    widest row: every row's emitted tokens and counts are those of the same proposals verified
    as trees (greedy and coupled sampled rows alike), and no row emits past its own drafts."""
    vocab, rows = 13, 8
    gen = torch.Generator().manual_seed(3)
    sizes = [4, 0, 2, 1, 4, 3, 0, 2]
    logits = [torch.randn(n + 1, vocab, generator=gen) * 3 for n in sizes]
    # Drafts that agree with the greedy choices for a while, so rows accept some and reject some.
    proposals = [
        Proposal([int(x.argmax()) if j < 2 else 0 for j, x in enumerate(row[:n])], list(range(-1, n - 1)), None)
        for row, n in zip(logits, sizes, strict=True)
    ]
    positions = [50 + 7 * b for b in range(rows)]
    batch = VerifyBatch.build(proposals, positions, vocab, torch.device("cpu"))
    assert batch.chain and batch.ragged and batch.num_nodes == sizes and batch.positions == positions
    n = max(sizes)
    parents = torch.tensor([[*range(-1, s - 1), *[-1] * (n - s)] for s in sizes])
    tree = VerifyBatch(batch.draft_token_ids, None, parents, sizes, positions)
    verifier = Verifier("torch")
    for params in (
        [SamplingParams()] * rows,
        [SamplingParams(do_sample=True, temperature=0.8, seed=b) for b in range(rows)],
        [SamplingParams(do_sample=b % 2 == 0, temperature=1.3, seed=b) for b in range(rows)],
    ):
        chain_out = verifier.verify(batch, logits, params, [RequestRng(b) for b in range(rows)])
        tree_out = verifier.verify(tree, logits, params, [RequestRng(b) for b in range(rows)])
        emitted, paths = chain_out.host()
        assert paths is None and emitted == tree_out.host()[0]
        assert all(len(e) <= s + 1 for e, s in zip(emitted, sizes, strict=True))
        assert chain_out.stats.draft_tokens.tolist() == sizes
        assert torch.equal(chain_out.stats.accepted_tokens, tree_out.stats.accepted_tokens)
        assert torch.equal(chain_out.stats.accepted_per_position, tree_out.stats.accepted_per_position)
        # The rows given as a list are padded by copies of their last logits; padding them with
        # anything else (here noise) changes nothing a row emits: past a row nothing is read.
        noise = torch.randn(rows, n + 1, vocab, generator=gen) * 5
        for b, row in enumerate(logits):
            noise[b, : len(row)] = row
        for layout in (batch, tree):
            listed = verifier.verify(layout, logits, params, [RequestRng(b) for b in range(rows)])
            noisy = verifier.verify(layout, noise, params, [RequestRng(b) for b in range(rows)])
            assert listed.host() == noisy.host()
            assert torch.equal(listed.accepted_token_num, noisy.accepted_token_num)
    assert padded([torch.ones(1, 2), torch.arange(6.0).view(3, 2)]).tolist() == [
        [[1, 1], [1, 1], [1, 1]],
        [[0, 1], [2, 3], [4, 5]],
    ]
    with pytest.raises(ValueError, match="target_logits"):
        padded([torch.ones(1, 2), torch.ones(0, 2)])
    with_law = [Proposal([1], [-1], torch.full((1, vocab), 1 / vocab)), Proposal([1, 2], [-1, 0], None)]
    assert not VerifyBatch.build(with_law, [3, 4], vocab, torch.device("cpu")).chain  # a law: the tree layout
