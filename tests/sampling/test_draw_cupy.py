"""The sampled step's draw kernels (sampling/draw_kernel.cu) against their torch definitions
(GPU only): the categorical draw is `inverse_cdf_sample` token for token, the SplitMix64
uniforms are the torch ops' values bit for bit, and the step's callers reach the kernels."""

from __future__ import annotations

import pytest
import torch

import sampling.cupy_draw as cupy_draw
import sampling.rng as rng_module
from sampling import RequestRng, SamplingParams, SamplingTensors, position_uniforms, sample_target, stream_uniforms
from sampling.categorical import draw, inverse_cdf_sample
from sampling.cupy_draw import INLINE_ROWS, categorical_sample_cupy, splitmix64_cupy
from sampling.rng import _signed

pytestmark = pytest.mark.gpu
BELOW_ONE = 1 - 2**-24  # the largest uniform a stream yields


def laws(rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """[rows, vocab] float32 weights of several shapes: flat, peaked (a softmax at a low
    temperature), sparse (most entries 0), a point mass, an all-zero row, unnormalised."""
    logits = torch.randn(rows, vocab, generator=gen)
    out = torch.softmax(logits * torch.linspace(0.5, 8.0, rows)[:, None], dim=-1)
    sparse = torch.rand(rows, vocab, generator=gen) < 0.9
    out[1::4] = out[1::4].masked_fill(sparse[1::4], 0.0)
    out[2::4] *= 37.5  # not normalised: the rule scales u by the row's sum
    if rows > 3:
        out[3] = 0.0
        out[3, vocab // 2] = 1.0
    if rows > 5:
        out[5] = 0.0  # no mass: has_mass False
    return out.cuda()


def uniforms_for(rows: int, gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(rows, generator=gen)
    u[0] = 0.0
    if rows > 1:
        u[-1] = BELOW_ONE
    return u.cuda()


def assert_same_draws(weights: torch.Tensor, uniforms: torch.Tensor) -> None:
    index, has_mass = categorical_sample_cupy(weights, uniforms)
    ref_index, ref_mass = inverse_cdf_sample(weights, uniforms)
    assert torch.equal(has_mass, ref_mass)
    assert index.dtype == torch.int64 and has_mass.dtype == torch.bool
    assert torch.equal(index[ref_mass], ref_index[ref_mass])


@pytest.mark.parametrize("vocab", [1, 3, 5, 1000, 1024, 1025, 4097, 32000, 49152, 128256])
@pytest.mark.parametrize("rows", [1, 7, 80])
def test_the_kernel_draws_the_references_tokens(vocab, rows):
    gen = torch.Generator().manual_seed(vocab * 131 + rows)
    assert_same_draws(laws(rows, vocab, gen), uniforms_for(rows, gen))


def test_many_uniforms_on_one_law_hit_every_boundary_as_the_reference_does():
    """One sparse law, 4,096 uniforms spread over [0, 1): the draws step through its support."""
    gen = torch.Generator().manual_seed(11)
    law = laws(8, 4097, gen)[1]
    uniforms = torch.cat([torch.linspace(0, BELOW_ONE, 4095), torch.tensor([BELOW_ONE])]).cuda()
    assert_same_draws(law.expand(4096, -1).contiguous(), uniforms)


def test_misaligned_weights_and_rows_past_the_grid():
    gen = torch.Generator().manual_seed(12)
    storage = torch.empty(7 * 4096 + 1, device="cuda")
    weights = storage[1:].view(7, 4096)  # contiguous, 4 bytes past a 16-byte boundary: scalar loads
    weights.copy_(laws(7, 4096, gen))
    assert weights.data_ptr() % 16 != 0
    assert_same_draws(weights, uniforms_for(7, gen))
    many = 70_000  # more rows than the grid: the kernel strides over them
    assert_same_draws(laws(many, 3, gen), uniforms_for(many, gen))


def test_an_empty_batch_launches_nothing():
    index, has_mass = categorical_sample_cupy(torch.zeros(0, 5, device="cuda"), torch.zeros(0, device="cuda"))
    assert index.shape == (0,) and has_mass.shape == (0,)


def test_the_step_draws_through_the_kernel(monkeypatch):
    """sample_target's draws on a GPU come from the kernel: with the torch rule made to fail,
    a sampled batch still draws, and its tokens are the reference's."""
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(4, 3, 1000, generator=gen).cuda()
    params = SamplingTensors.from_params([SamplingParams(do_sample=True, temperature=0.9)] * 4, "cuda")
    uniforms = torch.rand(4, 3, generator=gen).cuda()
    reference = sample_target(logits, params, uniforms).probs.view(12, -1)
    expected, _ = inverse_cdf_sample(reference, uniforms.reshape(-1))

    def refuse(*_args):
        raise AssertionError("the torch rule ran on a GPU step")

    monkeypatch.setattr("sampling.categorical.inverse_cdf_sample", refuse)
    assert torch.equal(sample_target(logits, params, uniforms).token_ids.view(-1), expected)
    assert torch.equal(draw(reference, uniforms.reshape(-1))[0], expected)


def test_splitmix64_kernel_is_the_torch_values_bit_for_bit():
    gen = torch.Generator().manual_seed(14)
    keys = torch.randint(-(1 << 63), (1 << 63) - 1, (300,), generator=gen, dtype=torch.int64)
    positions = torch.randint(0, (1 << 63) - 1, (300, 17), generator=gen, dtype=torch.int64)
    positions[:, :4] = torch.tensor([0, 1, (1 << 63) - 2, (1 << 63) - 1])
    expected = rng_module.splitmix64_uniforms(keys, positions)  # the torch ops, on the CPU
    got = splitmix64_cupy(torch.cat([keys[:, None], positions], 1).cuda(), 17, False, torch.device("cuda", 0))
    assert torch.equal(got.cpu(), expected)
    states = torch.tensor([_signed(k) for k in (0, 1, (1 << 64) - 1, 0x9E3779B97F4A7C15)], dtype=torch.int64)
    counts = torch.tensor([0, 5, 9, 3])
    steps = torch.arange(9) * _signed(0x9E3779B97F4A7C15)
    values = rng_module._output(states[:, None] + steps)
    expected = torch.where(torch.arange(9) < counts[:, None], values, 0.0)
    rows = torch.stack([states, counts], 1)
    for rows_in in (rows, rows.cuda()):  # in the launch's parameters; in device memory
        assert torch.equal(splitmix64_cupy(rows_in, 9, True, torch.device("cuda", 0)).cpu(), expected)


@pytest.mark.parametrize("batch", [1, INLINE_ROWS, INLINE_ROWS + 1, 300])
def test_stream_and_position_runs_are_the_cpus_at_every_batch(batch):
    """Up to INLINE_ROWS rows travel in the kernel's parameters, more through a copy: the values
    are the CPU's either way, and each stream moves as it does there; so are runs of positions
    moved on the device (`shift`: a step queued before the step in flight is read)."""
    counts = [(3 * b) % 11 for b in range(batch)]
    at = [None if b % 3 else 40 + b for b in range(batch)]
    shift = -(torch.arange(batch) % 5)
    on_cpu = [RequestRng(seed, stream="decode") for seed in range(batch)]
    on_gpu = [RequestRng(seed, stream="decode") for seed in range(batch)]
    for _ in range(2):
        expected = stream_uniforms(on_cpu, counts, "cpu", 12, at)
        assert torch.equal(stream_uniforms(on_gpu, counts, "cuda", 12, at).cpu(), expected)
        expected = stream_uniforms(on_cpu, counts, "cpu", 12, at, shift)
        assert torch.equal(stream_uniforms(on_gpu, counts, "cuda", 12, at, shift.cuda()).cpu(), expected)
    assert [r.drawn for r in on_gpu] == [r.drawn for r in on_cpu]


def test_a_steps_uniforms_come_from_the_kernel(monkeypatch):
    """With the torch ops made to fail, the GPU's stream and position uniforms are still the
    CPU's (computed before) bit for bit; a small stream batch reaches the kernel without a copy."""
    rngs = [RequestRng(seed, stream="decode") for seed in range(6)]
    where = torch.arange(6)[:, None] * 100 + torch.arange(5)
    expected_positions = position_uniforms(rngs, where)
    expected_stream = stream_uniforms([RequestRng(seed, stream="decode") for seed in range(6)], [4, 0, 4, 2, 4, 1])

    def refuse(*_args):
        raise AssertionError("the torch ops ran on a GPU step")

    monkeypatch.setattr(rng_module, "_output", refuse)
    monkeypatch.setattr(rng_module, "splitmix64_uniforms", refuse)
    assert torch.equal(position_uniforms(rngs, where, "cuda").cpu(), expected_positions)
    monkeypatch.setattr(cupy_draw, "to_device", refuse)  # a small stream batch copies nothing
    assert torch.equal(stream_uniforms(rngs, [4, 0, 4, 2, 4, 1], "cuda").cpu(), expected_stream)
