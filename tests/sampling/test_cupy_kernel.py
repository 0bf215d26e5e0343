"""The CuPy kernel equals the torch reference token for token (GPU only: make test-gpu). Its
statistics: tests/sampling/test_rejection_stats.py, parametrised over the backends."""

import pytest
import torch

from sampling import RejectionSampler, rejection_sample
from sampling.cupy_sampler import chunk_size
from tests.sampling.helpers import gpu_inputs

pytestmark = pytest.mark.gpu
POISON = 0x5EAD  # a value no output slot may keep


def cupy_call(*args):
    """Run the cupy backend into memory the caching allocator just held poison in.

    Value checks are off here (the reference call validated the same inputs) so that no
    temporary can take the poisoned block before the output does.
    """
    batch, k = args[0].shape
    rejection_sample(*args, backend="cupy", check_values=False)  # compile, size the workspace
    poison = torch.full((batch * (k + 2),), POISON, dtype=torch.int32, device="cuda")
    address = poison.data_ptr()
    del poison  # the next int32 allocation of this size reuses the block
    out, emitted = rejection_sample(*args, backend="cupy", check_values=False)
    assert batch == 0 or out.data_ptr() == address, "poisoning did not reach the output buffer"
    return out, emitted


def assert_same(args):
    ref = rejection_sample(*args, backend="torch")
    got = cupy_call(*args)
    torch.testing.assert_close(got[1], ref[1], rtol=0, atol=0)
    torch.testing.assert_close(got[0], ref[0], rtol=0, atol=0)
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32


@pytest.mark.parametrize("vocab", [3, 5, 111, 4097, 32000, 128256, 151936])
@pytest.mark.parametrize("k", [0, 1, 3, 8])
@pytest.mark.parametrize("batch", [0, 1, 7, 99, 256])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_equals_reference(batch, k, vocab, dense):
    assert_same(gpu_inputs(batch, k, vocab, seed=batch * 1000 + k * 10 + vocab, dense=dense))


@pytest.mark.parametrize("vocab", [111, 4097, 32000])
def test_equals_reference_with_int32_ids_and_all_stochastic_rows(vocab):
    args = list(gpu_inputs(64, 4, vocab, seed=1, dense=True, greedy_fraction=0.0))
    args[0], args[3] = args[0].int(), args[3].int()
    assert_same(tuple(args))


def test_non_contiguous_inputs():
    draft_ids, draft_probs, target_probs, target_ids, uniforms, do_sample = gpu_inputs(8, 3, 4097, seed=2, dense=True)
    wide = torch.zeros(8, 4, 4100, device="cuda")
    wide[..., :4097] = target_probs
    assert_same((draft_ids, draft_probs, wide[..., :4097], target_ids, uniforms, do_sample))


def boundary_case(vocab: int, batch: int, uniform: float, dense: bool):
    """Residual mass 1/4 at the last entry of the first four kernel chunks (dyadic: exact)."""
    chunk = chunk_size(batch, vocab, torch.cuda.get_device_properties(0).multi_processor_count, dense=dense)
    q = torch.zeros(vocab, device="cuda")
    spikes = [min((c + 1) * chunk, vocab) - 1 for c in range(4)]
    q[spikes] = 0.25
    target_probs = q.expand(batch, 2, vocab).contiguous()
    draft_ids = torch.zeros(batch, 1, dtype=torch.int64, device="cuda")  # q[0] = 0: always rejected
    target_ids = torch.full((batch, 2), 7, dtype=torch.int64, device="cuda")
    uniforms = torch.tensor([[0.5, uniform]], device="cuda").expand(batch, 2).contiguous()
    do_sample = torch.ones(batch, dtype=torch.bool, device="cuda")
    draft_probs = None
    if dense:  # one-hot at id 0: relu(q - p) is q again, through the dense kernel
        draft_probs = torch.zeros(batch, 1, vocab, device="cuda")
        draft_probs[..., 0] = 1.0
    return (draft_ids, draft_probs, target_probs, target_ids, uniforms, do_sample), spikes


@pytest.mark.parametrize(("vocab", "batch"), [(4096, 1), (4096 * 3, 2), (128256, 1), (151936, 5), (151936, 64)])
@pytest.mark.parametrize(("uniform", "spike"), [(0.0, 0), (0.25, 1), (0.5, 2), (0.75, 3), (0.9999, 3)])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_threshold_on_chunk_boundaries_and_last_nonzero(vocab, batch, uniform, spike, dense):
    args, spikes = boundary_case(vocab, batch, uniform, dense)
    out, emitted = cupy_call(*args)
    # t = u * 1 equals the cumulative mass at the end of a chunk: c > t is strict -> next spike.
    assert out[:, 0].tolist() == [spikes[spike]] * batch
    assert emitted.tolist() == [1] * batch
    assert_same(args)


def test_zero_residual_mass_and_ties():
    vocab, batch = 5000, 16
    q = torch.full((vocab,), 1.0 / vocab, device="cuda")
    q[0] = 0.0
    q[1] += 1.0 / vocab
    target_probs = q.expand(batch, 3, vocab).contiguous()
    draft_probs = q.expand(batch, 2, vocab).contiguous()  # p == q: the residual is all 0
    draft_ids = torch.zeros(batch, 2, dtype=torch.int64, device="cuda")  # p = q = 0 at the draft: rejected
    target_ids = torch.arange(batch * 3, device="cuda").view(batch, 3) % vocab
    uniforms = torch.rand(batch, 3, device="cuda")
    do_sample = torch.ones(batch, dtype=torch.bool, device="cuda")
    args = (draft_ids, draft_probs, target_probs, target_ids, uniforms, do_sample)
    out, _ = cupy_call(*args)
    assert out[:, 0].tolist() == target_ids[:, 0].tolist()  # S == 0 falls back to the target token
    assert_same(args)
    # Ties everywhere: p is a flat copy of q on most entries, so many residual entries are equal.
    draft_probs = torch.full_like(draft_probs, 1.0 / vocab)
    draft_ids = torch.ones(batch, 2, dtype=torch.int64, device="cuda")
    assert_same((draft_ids, draft_probs, target_probs, target_ids, uniforms, do_sample))


def test_unchecked_bad_ids_stay_in_bounds():
    args = list(gpu_inputs(32, 4, 1000, seed=3, dense=True, greedy_fraction=0.0))
    args[0] = args[0].clone()
    args[0][:, 0] = torch.tensor([-5, 10**9], device="cuda").repeat(16)
    _, emitted = rejection_sample(*args, backend="cupy", check_values=False)
    torch.cuda.synchronize()  # a bad access would surface here as an error
    assert ((emitted >= 1) & (emitted <= 5)).all()
    with pytest.raises(ValueError, match=r"draft_token_ids: expected ids in \[0, 1000\)"):
        rejection_sample(*args, backend="cupy")


def test_auto_picks_cupy_on_gpu():
    assert RejectionSampler("auto", "cuda").backend == "cupy"
    assert RejectionSampler("auto", "cpu").backend == "torch"


@pytest.mark.parametrize("dense", [True, False], ids=["dense", "point-mass"])
def test_cuda_graph_capture_and_replay(dense):
    sampler = RejectionSampler("cupy", "cuda")
    static = [t.clone() if t is not None else None for t in gpu_inputs(64, 4, 32000, seed=4, dense=dense)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on the capture stream: compile, workspace
        sampler(*static, check_values=False)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out, emitted = sampler(*static, check_values=False)
    for seed in (5, 6, 7):
        fresh = gpu_inputs(64, 4, 32000, seed=seed, dense=dense)
        for dst, src in zip(static, fresh, strict=True):
            if dst is not None:
                dst.copy_(src)
        out.fill_(POISON)
        graph.replay()
        ref = rejection_sample(*fresh, backend="torch")
        assert torch.equal(out, ref[0]) and torch.equal(emitted, ref[1])
