"""The verifier's bundle: a step's proposals in its layout (`VerifyBatch.build`), and the checks
that name a field before anything is launched."""

from __future__ import annotations

import pytest
import torch

from sampling import NO_PROPOSAL, Proposal, RequestRng, SamplingParams, Verifier, VerifyBatch, point_mass


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
