"""The torch tree verifier: a chain tree is `rejection_sample` token for token, it equals a
literal row-by-row reading of the law, hand-computed cases, greedy rows, output layout."""

import pytest
import torch

from sampling import TreeResult, rejection_sample, tree_rejection_sample
from sampling.naive import tree_rejection_sample_loop
from tests.sampling.helpers import random_inputs
from tests.sampling.tree_inputs import chain_tree, random_tree_inputs


def assert_result_equal(got: TreeResult, want: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    assert got.output_token_ids.dtype == got.accepted_token_num.dtype == got.accepted_nodes.dtype == torch.int32
    assert torch.equal(got.output_token_ids, want[0])
    assert torch.equal(got.accepted_token_num, want[1])
    assert torch.equal(got.accepted_nodes, want[2])


@pytest.mark.parametrize("vocab", [3, 5, 111, 4097])
@pytest.mark.parametrize("k", [0, 1, 3, 8])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_chain_tree_is_rejection_sample(k, vocab, dense):
    args = random_inputs(160, k, vocab, seed=vocab * 10 + k, dense=dense, sharpness=1.0)  # 30% greedy rows
    out, emitted = rejection_sample(*args, backend="torch")
    got = tree_rejection_sample(*chain_tree(*args), backend="torch")
    assert torch.equal(got.output_token_ids, out) and torch.equal(got.accepted_token_num, emitted)
    accepted = torch.arange(k) < (emitted[:, None] - 1)  # a chain accepts nodes 0..n-1
    assert torch.equal(got.accepted_nodes, torch.where(accepted, torch.arange(k, dtype=torch.int32), -1))


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_ragged_chains_ignore_their_padding(dense):
    """Row b is a chain of num_nodes[b] drafts; everything past it is poison."""
    k, vocab, batch = 6, 50, 400
    args = random_inputs(batch, k, vocab, seed=3, dense=dense, sharpness=1.0)
    num_nodes = torch.arange(batch) % (k + 1)
    tree = list(chain_tree(*args))
    tree[2] = num_nodes
    pad = torch.arange(k) >= num_nodes[:, None]  # [B, K]
    beyond = torch.arange(k + 1) > num_nodes[:, None]  # [B, K+1]
    tree[0] = tree[0].masked_fill(pad, -1)
    tree[1] = tree[1].masked_fill(pad, -1)  # would read as root children if not ignored
    if dense:
        tree[3] = tree[3].masked_fill(pad[..., None], float("nan"))
    tree[4] = tree[4].masked_fill(beyond[..., None], float("nan"))
    tree[5] = tree[5].masked_fill(beyond, vocab)
    tree[6] = tree[6].masked_fill(pad, 0.0)  # would accept every padded node
    tree[7] = tree[7].masked_fill(beyond, float("nan"))
    got = tree_rejection_sample(*tree, backend="torch")
    for m in range(k + 1):
        rows = torch.nonzero(num_nodes == m).squeeze(1)
        d, p, q, t, u, s = (a[rows] if a is not None else None for a in args)
        out, emitted = rejection_sample(
            d[:, :m], None if p is None else p[:, :m], q[:, : m + 1], t[:, : m + 1], u[:, : m + 1], s, backend="torch"
        )
        assert torch.equal(got.output_token_ids[rows, : m + 1], out)
        assert (got.output_token_ids[rows, m + 1 :] == -1).all()
        assert torch.equal(got.accepted_token_num[rows], emitted)


@pytest.mark.parametrize("vocab", [5, 50, 1500])
@pytest.mark.parametrize("n_nodes", [0, 1, 5, 16])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_reference_equals_literal_loop(vocab, n_nodes, dense):
    args = random_tree_inputs(48, n_nodes, vocab, seed=vocab + n_nodes, dense=dense, sharpness=1.0)
    assert_result_equal(tree_rejection_sample(*args, backend="torch"), tree_rejection_sample_loop(*args))


def two_siblings(u_first: float, u_second: float, dense: bool = True):
    """q = [0.3, 0.5, 0.2] at the root; the draft p = [0.6, 0.3, 0.1] proposed 0, then 1
    without replacement (law [0, 0.75, 0.25]); node 1 has no children."""
    q = torch.tensor([[0.3, 0.5, 0.2], [0.1, 0.1, 0.8], [0.2, 0.2, 0.6]])
    p = torch.tensor([[0.6, 0.3, 0.1], [0.0, 0.75, 0.25]])
    return (
        torch.tensor([[0, 1]]),
        torch.tensor([[-1, -1]]),
        None,
        p[None] if dense else None,
        q[None],
        torch.tensor([[2, 0, 1]]),
        torch.tensor([[u_first, u_second]]),
        torch.tensor([[0.5, 0.5, 0.5]]),
        torch.tensor([True]),
    )


def test_first_sibling_accepted():
    got = tree_rejection_sample(*two_siblings(0.4, 0.0))  # 0.4 * 0.6 < 0.3
    assert got.output_token_ids.tolist() == [[0, 0, -1]]  # node 0, then the bonus q after it drew 0
    assert got.accepted_token_num.tolist() == [2] and got.accepted_nodes.tolist() == [[0, -1]]


def test_second_sibling_tested_against_the_normalised_residual():
    # After rejecting 0: W = relu(q - p) = [0, 0.2, 0.1], Z = 0.3; 0.5 * 0.75 * 0.3 < 0.2.
    got = tree_rejection_sample(*two_siblings(0.9, 0.5))
    assert got.output_token_ids.tolist() == [[1, 1, -1]]  # node 1, then the bonus after it
    assert got.accepted_nodes.tolist() == [[1, -1]]
    # With Z kept at 1 the test would be 0.85 * 0.75 < 0.2: rejected. With Z = 0.3, 0.19125 < 0.2.
    got = tree_rejection_sample(*two_siblings(0.9, 0.85))
    assert got.output_token_ids.tolist() == [[1, 1, -1]]


def test_all_siblings_rejected_samples_the_residual():
    # 0.95 * 0.75 * 0.3 >= 0.2: W = max(0, [0, 0.2, 0.1] - 0.3 * [0, 0.75, 0.25]) = [0, 0, 0.025].
    got = tree_rejection_sample(*two_siblings(0.9, 0.95))
    assert got.output_token_ids.tolist() == [[2, -1, -1]]
    assert got.accepted_token_num.tolist() == [1] and got.accepted_nodes.tolist() == [[-1, -1]]


def test_point_mass_siblings():
    # One-hot laws: 0.9 * 1 >= 0.3 rejects 0 (W = [0, 0.5, 0.2], Z = 0.7); 0.5 * 0.7 < 0.5 accepts 1.
    got = tree_rejection_sample(*two_siblings(0.9, 0.5, dense=False))
    assert got.output_token_ids.tolist() == [[1, 1, -1]]
    # 0.75 * 0.7 >= 0.5: both rejected, W = [0, 0, 0.2]: the residual can only give 2.
    got = tree_rejection_sample(*two_siblings(0.9, 0.75, dense=False))
    assert got.output_token_ids.tolist() == [[2, -1, -1]]


def test_no_residual_mass_falls_back_to_the_target_token():
    args = list(two_siblings(0.9, 0.95))
    q_root = torch.tensor([0.0, 0.6, 0.4])  # q = p at the root and q[0] = 0: node 0 is rejected, W = 0
    args[4] = args[4].clone()
    args[4][0, 0] = q_root
    args[3] = q_root.expand(1, 2, 3)
    args[5] = torch.tensor([[1, 0, 0]])
    got = tree_rejection_sample(*args)
    assert got.output_token_ids.tolist() == [[1, -1, -1]]  # target_token_ids[0, 0]


def test_greedy_rows_follow_the_first_matching_child():
    # Root children 0 (id 4), 1 (id 2), 2 (id 2); node 1 has children 3 (id 1), 4 (id 3).
    ids = torch.tensor([[4, 2, 2, 1, 3]])
    parents = torch.tensor([[-1, -1, -1, 1, 1]])
    q = torch.full((1, 6, 5), 0.2)
    uniforms = torch.zeros(1, 5)
    recover = torch.zeros(1, 6)
    greedy = torch.tensor([False])
    # target after the root: 2 -> node 1 (the first match); after node 1 (position 2): 3 -> node 4;
    # node 4 has no children -> its position 5 gives the bonus 0.
    got = tree_rejection_sample(
        ids, parents, None, None, q, torch.tensor([[2, 0, 3, 0, 0, 0]]), uniforms, recover, greedy
    )
    assert got.output_token_ids.tolist() == [[2, 3, 0, -1, -1, -1]]
    assert got.accepted_nodes.tolist() == [[1, 4, -1, -1, -1]]
    # No child of node 1 matches 1: stop there, emitting the target's token.
    got = tree_rejection_sample(
        ids, parents, None, None, q, torch.tensor([[2, 0, 0, 0, 0, 0]]), uniforms, recover, greedy
    )
    assert got.output_token_ids.tolist() == [[2, 0, -1, -1, -1, -1]]
    assert got.accepted_token_num.tolist() == [2]


def test_empty_batch_and_empty_trees():
    got = tree_rejection_sample(*random_tree_inputs(0, 4, 7, seed=0))
    assert got.output_token_ids.shape == (0, 5) and got.accepted_nodes.shape == (0, 4)
    assert got.accepted_token_num.shape == (0,)
    args = random_tree_inputs(5, 0, 7, seed=0)
    got = tree_rejection_sample(*args)
    assert torch.equal(got.output_token_ids, args[5].int()) and got.accepted_token_num.tolist() == [1] * 5


def test_inputs_are_not_modified():
    args = random_tree_inputs(16, 8, 30, seed=1)
    copies = [a.clone() if a is not None else None for a in args]
    tree_rejection_sample(*args)
    for a, c in zip(args, copies, strict=True):
        assert a is None or torch.equal(a, c) or torch.allclose(a, c, rtol=0, atol=0, equal_nan=True)
