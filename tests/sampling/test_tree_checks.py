"""Bad tree-verification inputs raise ValueError naming the argument, expected and actual value."""

import pytest
import torch

from sampling import MAX_TREE_NODES, tree_rejection_sample
from tests.sampling.helpers import good_tree_args as good
from tests.sampling.helpers import with_arg
from tests.sampling.tree_inputs import NAMES, random_tree_inputs

B, N, V = 4, 3, 11  # good()'s shape


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("draft_token_ids", torch.zeros(B, N), "dtype"),
        ("draft_token_ids", torch.zeros(B, N, 1, dtype=torch.int64), "rank 2"),
        ("draft_token_ids", torch.zeros(B, N - 1, dtype=torch.int64), f"shape [{B}, {N}]"),
        ("draft_token_ids", [[0, 1, 2]] * B, "torch.Tensor"),
        ("parents", torch.zeros(B, N), "dtype"),
        ("parents", torch.zeros(B, N + 1, dtype=torch.int32), f"shape [{B}, {N}]"),
        ("num_nodes", torch.zeros(B, 1, dtype=torch.int64), "rank 1"),
        ("num_nodes", torch.zeros(B + 1, dtype=torch.int64), f"shape [{B}]"),
        ("num_nodes", torch.zeros(B), "dtype"),
        ("draft_probs", torch.zeros(B, N, V, dtype=torch.float64), "dtype torch.float32"),
        ("draft_probs", torch.zeros(B, N, V + 1), f"shape [{B}, {N}, {V}]"),
        ("target_probs", torch.zeros(B, N + 1, V, dtype=torch.float16), "dtype torch.float32"),
        ("target_probs", torch.zeros(B, V), "rank 3"),
        ("target_probs", torch.zeros(B, 0, V), "N+1 >= 1"),
        ("target_probs", torch.zeros(B, N + 1, 0), "vocab size V >= 1"),
        ("target_token_ids", torch.zeros(B, N, dtype=torch.int64), f"shape [{B}, {N + 1}]"),
        ("target_token_ids", torch.zeros(B, N + 1, dtype=torch.int16), "dtype"),
        ("accept_uniforms", torch.zeros(B, N, dtype=torch.float64), "dtype torch.float32"),
        ("accept_uniforms", torch.zeros(B, N + 1), f"shape [{B}, {N}]"),
        ("recover_uniforms", torch.zeros(B, N), f"shape [{B}, {N + 1}]"),
        ("do_sample", torch.ones(B, dtype=torch.int32), "dtype torch.bool"),
        ("do_sample", torch.ones(B + 1, dtype=torch.bool), f"shape [{B}]"),
    ],
)
def test_structural_errors_name_the_argument(name, value, expected):
    with pytest.raises(ValueError, match=f"^{name}: ") as err:
        tree_rejection_sample(*with_arg(good(), NAMES, name, value))
    assert expected in str(err.value)


def test_at_most_max_tree_nodes():
    n = MAX_TREE_NODES + 1
    args = random_tree_inputs(2, n, 5, seed=0)
    with pytest.raises(ValueError, match=rf"^target_probs: expected N <= MAX_TREE_NODES = 64 tree nodes, got N = {n}"):
        tree_rejection_sample(*args)
    tree_rejection_sample(*random_tree_inputs(2, MAX_TREE_NODES, 5, seed=0))


@pytest.mark.parametrize(
    ("name", "index", "bad_value", "message"),
    [
        ("num_nodes", (1,), 4, "num_nodes: expected values in [0, 3], got num_nodes[1] = 4"),
        ("num_nodes", (1,), -1, "num_nodes: expected values in [0, 3], got num_nodes[1] = -1"),
        (
            "draft_token_ids",
            (1, 2),
            V,
            "draft_token_ids: expected ids in [0, 11) at nodes n < num_nodes[b], got draft_token_ids[1, 2] = 11",
        ),
        (
            "draft_token_ids",
            (0, 0),
            -1,
            "draft_token_ids: expected ids in [0, 11) at nodes n < num_nodes[b], got draft_token_ids[0, 0] = -1",
        ),
        (
            "parents",
            (1, 1),
            1,
            "parents: expected values in [-1, n-1] at nodes n < num_nodes[b], got parents[1, 1] = 1",
        ),
        (
            "parents",
            (2, 2),
            -2,
            "parents: expected values in [-1, n-1] at nodes n < num_nodes[b], got parents[2, 2] = -2",
        ),
        (
            "target_token_ids",
            (3, 3),
            99,
            "target_token_ids: expected ids in [0, 11) at positions <= num_nodes[b], got target_token_ids[3, 3] = 99",
        ),
        (
            "accept_uniforms",
            (1, 1),
            1.0,
            "accept_uniforms: expected values in [0, 1) at nodes n < num_nodes[b], got accept_uniforms[1, 1] = 1.0",
        ),
        (
            "recover_uniforms",
            (0, 3),
            float("nan"),
            "recover_uniforms: expected values in [0, 1) at positions <= num_nodes[b], "
            "got recover_uniforms[0, 3] = nan",
        ),
    ],
)
def test_value_errors(name, index, bad_value, message):
    with pytest.raises(ValueError) as err:
        tree_rejection_sample(*with_arg(good(), NAMES, name, bad_value, index=index))
    assert str(err.value) == message


def test_entries_past_num_nodes_are_not_checked():
    args = good()
    args[2] = torch.tensor([0, 1, 2, 3])
    for name, index, value in [
        ("draft_token_ids", (0, 0), -1),
        ("parents", (1, 1), 5),
        ("target_token_ids", (2, 3), V),
        ("accept_uniforms", (2, 2), 7.0),
        ("recover_uniforms", (1, 2), float("nan")),
    ]:
        args = with_arg(args, NAMES, name, value, index=index)
    tree_rejection_sample(*args)


def test_value_checks_can_be_skipped_but_structure_cannot():
    args = good()
    args[1] = args[1].clone()
    args[1][0, 0] = 7  # a parent that is no node: the node is simply never a child
    tree_rejection_sample(*args, check_values=False)
    args[0] = args[0].clone()
    args[0][0, 0] = 10**6  # clamped where it addresses memory
    tree_rejection_sample(*args, check_values=False)
    with pytest.raises(ValueError, match=r"^do_sample"):
        tree_rejection_sample(*with_arg(good(), NAMES, "do_sample", torch.ones(B)), check_values=False)


def test_device_mismatch():
    args = good()
    args[4] = args[4].to("meta")  # target_probs fixes the device
    with pytest.raises(ValueError, match=r"^draft_token_ids: expected device meta \(that of target_probs\), got cpu"):
        tree_rejection_sample(*args, backend="torch")


def test_unknown_backend_and_cupy_without_a_gpu():
    with pytest.raises(ValueError, match=r"^backend: expected 'torch', 'cupy' or 'auto', got 'triton'"):
        tree_rejection_sample(*good(), backend="triton")
    with pytest.raises(ValueError, match=r"^backend: 'cupy' expects inputs on a GPU"):
        tree_rejection_sample(*good(), backend="cupy")
