"""The CuPy tree kernel equals the torch reference token for token (GPU only: make test-gpu).
Its statistics: tests/sampling/test_tree_stats.py, parametrised over the backends."""

import pytest
import torch

from sampling import rejection_sample, tree_rejection_sample
from tests.sampling.helpers import gpu_inputs
from tests.sampling.tree_inputs import chain_tree, random_tree_inputs

pytestmark = pytest.mark.gpu
POISON = 0x5EAD  # a value no output slot may keep


def cupy_call(args):
    """Run the cupy backend into memory the caching allocator just held poison in.

    Value checks are off here (the reference call validated the same inputs) so that no
    temporary can take the poisoned block before the outputs do.
    """
    batch, n_nodes = args[0].shape
    tree_rejection_sample(*args, backend="cupy", check_values=False)  # compile, size the workspace
    poison = torch.full((batch * (2 * n_nodes + 2),), POISON, dtype=torch.int32, device="cuda")
    address = poison.data_ptr()
    del poison  # the next int32 allocation of this size reuses the block
    got = tree_rejection_sample(*args, backend="cupy", check_values=False)
    assert got.output_token_ids.data_ptr() == address, "poisoning did not reach the output buffer"
    return got


def assert_same(args):
    ref = tree_rejection_sample(*args, backend="torch")
    got = cupy_call(args)
    for name in ("accepted_token_num", "output_token_ids", "accepted_nodes"):
        want, have = getattr(ref, name), getattr(got, name)
        assert have.dtype == torch.int32 and torch.equal(have, want), name


@pytest.mark.parametrize("vocab", [5, 1000, 4097, 32000, 128256])
@pytest.mark.parametrize("n_nodes", [0, 1, 9, 64])
@pytest.mark.parametrize("batch", [1, 7, 64])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_equals_reference(batch, n_nodes, vocab, dense):
    """Ragged num_nodes with poisoned padding, 30% greedy rows, deep and wide trees."""
    assert_same(random_tree_inputs(batch, n_nodes, vocab, seed=batch * 1000 + n_nodes, dense=dense, device="cuda"))


@pytest.mark.parametrize("vocab", [111, 32000])
def test_int32_inputs_full_trees_and_all_stochastic_rows(vocab):
    args = list(random_tree_inputs(64, 16, vocab, seed=1, device="cuda", greedy_fraction=0.0, ragged=False))
    args[0], args[1], args[5] = args[0].int(), args[1].int(), args[5].int()
    assert_same(tuple(args))
    args[2] = torch.full((64,), 16, dtype=torch.int32, device="cuda")
    assert_same(tuple(args))


def test_non_contiguous_inputs():
    """Only the large inputs: a small contiguous copy could take the poisoned output block."""
    args = list(random_tree_inputs(8, 6, 4097, seed=2, device="cuda"))
    for index in (3, 4):  # draft_probs, target_probs
        wide = torch.zeros(*args[index].shape[:2], 4100, device="cuda")
        wide[..., :4097] = args[index]
        args[index] = wide[..., :4097]
    assert_same(tuple(args))


@pytest.mark.parametrize("vocab", [5, 4097, 32000, 128256])
@pytest.mark.parametrize("k", [0, 1, 4, 8])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_chain_tree_equals_the_chain_kernel(k, vocab, dense):
    args = gpu_inputs(64, k, vocab, seed=k * 7 + vocab, dense=dense)
    reference = rejection_sample(*args, backend="torch")
    chain = rejection_sample(*args, backend="cupy")
    got = tree_rejection_sample(*chain_tree(*args), backend="cupy")
    for want in (reference, chain):
        assert torch.equal(got.output_token_ids, want[0]) and torch.equal(got.accepted_token_num, want[1])


def test_unchecked_bad_inputs_stay_in_bounds_and_match_the_reference():
    args = list(random_tree_inputs(32, 8, 1000, seed=3, device="cuda", greedy_fraction=0.0, ragged=False))
    args[0] = args[0].clone()
    args[0][:, 0] = torch.tensor([-5, 10**9], device="cuda").repeat(16)
    args[1] = args[1].clone()
    args[1][:, 3] = torch.tensor([1000, -50], device="cuda").repeat(16)
    args[2] = torch.tensor([-3, 99], device="cuda").repeat(16)
    got = tree_rejection_sample(*args, backend="cupy", check_values=False)
    torch.cuda.synchronize()  # a bad access would surface here as an error
    ref = tree_rejection_sample(*args, backend="torch", check_values=False)
    assert torch.equal(got.output_token_ids, ref.output_token_ids)
    with pytest.raises(ValueError, match=r"^num_nodes: expected values in \[0, 8\]"):
        tree_rejection_sample(*args, backend="cupy")


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_cuda_graph_capture_and_replay(dense):
    def inputs(seed):
        return random_tree_inputs(64, 16, 32000, seed=seed, dense=dense, device="cuda")

    static = [t.clone() if t is not None else None for t in inputs(4)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on the capture stream: compile, workspace
        tree_rejection_sample(*static, backend="cupy", check_values=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        got = tree_rejection_sample(*static, backend="cupy", check_values=False)
    for seed in (5, 6, 7):
        fresh = inputs(seed)
        for dst, src in zip(static, fresh, strict=True):
            if dst is not None:
                dst.copy_(src)
        got.output_token_ids.fill_(POISON)
        got.accepted_nodes.fill_(POISON)
        graph.replay()
        ref = tree_rejection_sample(*fresh, backend="torch")
        assert torch.equal(got.output_token_ids, ref.output_token_ids)
        assert torch.equal(got.accepted_token_num, ref.accepted_token_num)
        assert torch.equal(got.accepted_nodes, ref.accepted_nodes)
