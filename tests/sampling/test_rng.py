"""Per-request random streams (sampling/rng.py): the vectorised SplitMix64 is the scalar
definition bit for bit, on the CPU and on a GPU; a request's stream does not depend on the
batch it is drawn in; the verifier reads each row's uniforms where the scalar per-row rule
puts them; and the stream's uniforms are uniform, by a test that rejects a biased stream."""

from __future__ import annotations

import math

import pytest
import torch

import sampling.verifier as verifier_module
from sampling import (
    RequestRng,
    SamplingParams,
    Verifier,
    VerifyBatch,
    batch_uniforms,
    position_uniforms,
    splitmix64_uniforms,
    stream_uniforms,
)
from sampling.rng import _signed

MASK = (1 << 64) - 1
SAMPLED = SamplingParams(do_sample=True, temperature=0.8)
GREEDY = SamplingParams()


def splitmix64(key: int, position: int) -> float:
    """The definition, in python integers: SplitMix64's output number position + 1 from
    state `key` (unsigned), its top 24 bits over 2**24."""
    z = (key + (position + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return ((z ^ (z >> 31)) >> 40) / (1 << 24)


def stream(rng: RequestRng, start: int, n: int) -> list[float]:
    """Values start..start+n-1 of rng's stream, by the definition."""
    return [splitmix64(rng.key, c) for c in range(start, start + n)]


EDGES = [0, 1, (1 << 62) - 1, (1 << 63) - 1, 1 << 63, (1 << 63) + 1, MASK - 1, MASK]


def test_vectorised_splitmix64_is_the_definition_at_the_edges():
    """Keys across the sign bit of their int64 form, counters up to 2**63 - 1."""
    positions = [p for p in EDGES if p < 1 << 63]
    got = splitmix64_uniforms(torch.tensor([_signed(k) for k in EDGES]), torch.tensor([positions] * len(EDGES)))
    assert got.dtype == torch.float32  # float32 -> python float is exact
    assert got.tolist() == [[splitmix64(k, p) for p in positions] for k in EDGES]


def test_random_keys_and_large_counters_match_the_definition():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randint(-(1 << 63), (1 << 63) - 1, (64,), generator=gen, dtype=torch.int64)
    positions = torch.randint(0, (1 << 63) - 1, (64, 33), generator=gen, dtype=torch.int64)
    positions[:, 0] = (1 << 63) - 1
    assert int((keys < 0).sum()) > 0  # keys >= 2**63 among them
    got = splitmix64_uniforms(keys, positions).tolist()
    assert got == [
        [splitmix64(k & MASK, p) for p in row] for k, row in zip(keys.tolist(), positions.tolist(), strict=True)
    ]


def test_the_stream_and_the_positions_are_the_definition_at_their_keys():
    rng = RequestRng(11, stream="decode")
    assert rng.uniforms(5).tolist() == stream(rng, 0, 5)
    assert rng.uniforms(3).tolist() == stream(rng, 5, 3) and rng.drawn == 8
    assert rng.at(40, 4) == [splitmix64(rng.position_key, p) for p in range(40, 44)]
    # Distinct keys: the stream "" against its positions, and the nodes' streams.
    plain = RequestRng(11)
    assert len({plain.key, plain.position_key, rng.key, rng.position_key, RequestRng(11, "prefill").key}) == 5


def test_a_row_draws_its_own_stream_whatever_shares_its_batch():
    requests = [RequestRng(seed, stream="decode") for seed in range(6)]
    alone = [RequestRng(seed, stream="decode") for seed in range(6)]
    for step, members in enumerate([[0, 1, 2, 3, 4, 5], [3], [5, 0, 2], [1, 4], [2, 3, 0, 1]]):
        n = 1 + step % 3
        draws = [(b + step) % 3 != 0 for b in members]  # greedy rows in between draw nothing
        got = batch_uniforms([requests[b] for b in members], n, "cpu", draws)
        for row, (b, drawing) in enumerate(zip(members, draws, strict=True)):
            want = alone[b].uniforms(n) if drawing else torch.zeros(n)
            assert torch.equal(got[row], want), (step, b)
    assert [r.drawn for r in requests] == [r.drawn for r in alone]


def test_only_drawing_rows_move_their_counters():
    rngs = [RequestRng(seed) for seed in range(4)]
    batch_uniforms(rngs, 3, "cpu", [True, False, True, False])
    assert [r.drawn for r in rngs] == [3, 0, 3, 0]
    zeros = batch_uniforms(rngs, 3, "cpu", [False] * 4)
    assert torch.equal(zeros, torch.zeros(4, 3)) and [r.drawn for r in rngs] == [3, 0, 3, 0]
    ragged = stream_uniforms(rngs, [2, 0, 1, 4])
    assert ragged.shape == (4, 4) and [r.drawn for r in rngs] == [5, 0, 4, 4]
    assert ragged[0].tolist() == [*stream(rngs[0], 3, 2), 0.0, 0.0] and ragged[1].tolist() == [0.0] * 4
    shared = RequestRng(9)  # one request in two rows draws twice, in row order
    assert stream_uniforms([shared, shared], [2, 2]).flatten().tolist() == stream(shared, 0, 4)
    with pytest.raises(ValueError, match="counts: expected 2 values in"):
        stream_uniforms(rngs[:2], [3, 1], width=2)
    assert batch_uniforms([], 3).shape == (0, 3)


def test_a_row_given_a_position_reads_that_run_of_positions_and_leaves_its_stream():
    rngs = [RequestRng(seed, stream="decode") for seed in range(4)]
    got = stream_uniforms(rngs, [3, 5, 0, 2], "cpu", 6, [None, 17, 4, 0])
    assert [r.drawn for r in rngs] == [3, 0, 0, 0]
    assert got[0].tolist() == [*stream(RequestRng(0, stream="decode"), 0, 3), 0.0, 0.0, 0.0]
    assert got[1].tolist() == [*rngs[1].at(17, 5), 0.0] and got[2].tolist() == [0.0] * 6
    assert got[3].tolist() == [*rngs[3].at(0, 2), 0.0, 0.0, 0.0, 0.0]
    assert got[1, 0].item() != stream(RequestRng(1, stream="decode"), 0, 1)[0]
    with pytest.raises(ValueError, match="at: expected 4 positions"):
        stream_uniforms(rngs, [1, 1, 1, 1], "cpu", 2, [None])


def test_a_shift_moves_a_rows_run_of_positions_on_the_device_and_nothing_else():
    """A step queued before the step in flight is read knows its rows' positions on the device
    alone: row b reads the run at at[b] + shift[b]; stream rows ignore the shift and move."""
    rngs = [RequestRng(seed, stream="decode") for seed in range(3)]
    shift = torch.tensor([-2, -3, 0])
    got = stream_uniforms(rngs, [4, 3, 2], "cpu", 5, [10, None, 7], shift)
    assert got[0].tolist() == [*rngs[0].at(8, 4), 0.0]
    assert got[1].tolist() == [*stream(RequestRng(1, stream="decode"), 0, 3), 0.0, 0.0] and rngs[1].drawn == 3
    assert got[2].tolist() == [*rngs[2].at(7, 2), 0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match=r"shift: expected int64 of shape \[3\] with `at`"):
        stream_uniforms(rngs, [1, 1, 1], "cpu", 2, None, shift)
    with pytest.raises(ValueError, match="shift: expected int64"):
        stream_uniforms(rngs, [1, 1, 1], "cpu", 2, [1, 2, 3], shift[:2])


def test_tree_rows_read_their_uniforms_where_the_per_row_rule_puts_them(monkeypatch):
    """A sampled row b takes its stream's next 2(N_b+1): the first N_b+1 for the target sampler
    (columns 0..N_b), the next N_b+1 for the rejection test (columns N+1..N+1+N_b); a greedy
    row none; a coupled row none from its stream, its contexts the uniforms of their depths'
    positions. Everything else is 0."""
    seen = {}
    real_sample_target = verifier_module.sample_target

    def sample_target(logits, rows, uniforms):
        seen["target"] = uniforms.clone()
        return real_sample_target(logits, rows, uniforms)

    def tree_sampler(ids, parents, num_nodes, probs, q, tokens, accept, recover, do_sample):
        seen["accept"], seen["recover"] = accept.clone(), recover.clone()
        return verifier_module.tree_rejection_sample(
            ids, parents, num_nodes, probs, q, tokens, accept, recover, do_sample
        )

    monkeypatch.setattr(verifier_module, "sample_target", sample_target)
    n, vocab = 5, 7
    counts = [5, 2, 3, 0, 4]
    parents = torch.tensor([[-1, -1, 0, 0, 1], [-1, 0, -1, -1, -1], [-1, -1, 0, -1, -1], [-1] * 5, [-1, 0, 0, 1, -1]])
    params = [SAMPLED, GREEDY, SAMPLED, SAMPLED, SAMPLED]
    positions = [None, None, 17, None, None]  # row 2 coupled
    ids = torch.randint(0, vocab, (5, n), generator=torch.Generator().manual_seed(0))
    logits = torch.randn(5, n + 1, vocab, generator=torch.Generator().manual_seed(1))
    rngs = [RequestRng(b, stream="tree") for b in range(5)]
    for rng in rngs:
        rng.uniforms(rng.seed)  # streams part-way through
    batch = VerifyBatch(ids, parents=parents, num_nodes=counts, positions=positions)
    Verifier("torch", tree_sampler=tree_sampler).verify(batch, logits, params, rngs)

    want = torch.zeros(5, 2 * (n + 1))
    for b, (p, m, rng) in enumerate(zip(params, counts, rngs, strict=True)):
        start = rng.seed
        if positions[b] is not None:
            depths = [0]
            for parent in parents[b, :m].tolist():
                depths.append(depths[parent + 1] + 1)
            drawn = rng.at(positions[b], max(depths) + 1)
            want[b, : m + 1] = torch.tensor([drawn[d] for d in depths])
            assert rng.drawn == start
        elif not p.is_greedy:
            drawn = torch.tensor(stream(rng, start, 2 * (m + 1)))
            want[b, : m + 1], want[b, n + 1 : n + 2 + m] = drawn[: m + 1], drawn[m + 1 :]
            assert rng.drawn == start + 2 * (m + 1)
        else:
            assert rng.drawn == start
    assert torch.equal(seen["target"], want[:, : n + 1])
    assert torch.equal(seen["accept"], want[:, n + 1 : 2 * n + 1])
    last_child = [
        [max([c + 1 for c in range(m) if parents[b, c] + 1 == x], default=0) for x in range(n + 1)]
        for b, m in enumerate(counts)
    ]
    assert torch.equal(seen["recover"], want[:, n + 1 :].gather(1, torch.tensor(last_child)))


def test_coupled_chain_rows_read_their_positions_and_sampled_rows_their_streams(monkeypatch):
    seen = {}
    real_sample_target = verifier_module.sample_target

    def sample_target(logits, rows, uniforms):
        seen["target"] = uniforms.clone()
        return real_sample_target(logits, rows, uniforms)

    monkeypatch.setattr(verifier_module, "sample_target", sample_target)
    k, vocab = 3, 6
    params = [SAMPLED, GREEDY, SAMPLED]
    rngs = [RequestRng(b, stream="chain") for b in range(3)]
    batch = VerifyBatch(torch.zeros(3, k, dtype=torch.int64), positions=[None, None, 40])
    Verifier("torch").verify(batch, torch.randn(3, k + 1, vocab), params, rngs)
    fresh = RequestRng(0, stream="chain")
    assert torch.equal(seen["target"][0], fresh.uniforms(k + 1))
    assert torch.equal(seen["target"][1], torch.zeros(k + 1))
    assert seen["target"][2].tolist() == rngs[2].at(40, k + 1)
    assert [r.drawn for r in rngs] == [2 * (k + 1), 0, 0]
    got = position_uniforms(rngs[2:], torch.tensor([[40, 43, 41]]))
    assert got[0].tolist() == [rngs[2].at(p, 1)[0] for p in (40, 43, 41)]


def uniformity_failures(values: torch.Tensor, alpha: float = 1e-6) -> list[str]:
    """Kolmogorov-Smirnov against U[0, 1): the largest distance D between the empirical CDF of n
    values and the identity. By the Dvoretzky-Kiefer-Wolfowitz inequality (Massart's constant),
    P(D > eps) <= 2 exp(-2 n eps^2), so D above sqrt(ln(2 / alpha) / (2n)) rejects at level alpha.
    Consecutive values (independence): the fraction f of the n - 1 pairs both below 1/2 is the
    mean of two means over m = (n - 1) // 2 disjoint, independent pairs each (Hoeffding,
    P(|mean - 1/4| > eps) <= 2 exp(-2 m eps^2) each), so |f - 1/4| above
    sqrt(ln(4 / alpha) / (2m)) rejects at level alpha."""
    n = values.numel()
    bound = math.sqrt(math.log(2 / alpha) / (2 * n))
    ordered = values.double().sort().values
    rank = torch.arange(1, n + 1, dtype=torch.float64)
    distance = float(torch.maximum(rank / n - ordered, ordered - (rank - 1) / n).max())
    found = [] if distance <= bound else [f"KS distance {distance:.5f} > {bound:.5f} (n = {n})"]
    both = float(((values[:-1] < 0.5) & (values[1:] < 0.5)).double().mean())
    pair_bound = math.sqrt(math.log(4 / alpha) / (2 * ((n - 1) // 2)))
    if abs(both - 0.25) > pair_bound:
        found.append(f"consecutive pairs below 1/2: {both:.5f}, expected 0.25 +- {pair_bound:.5f}")
    return found


def drawn_in_batches() -> torch.Tensor:
    """2**18 uniforms: 64 requests' streams, drawn 8 steps of 512 a row, as a batch."""
    rngs = [RequestRng(seed, stream="decode") for seed in range(64)]
    return torch.cat([batch_uniforms(rngs, 512) for _ in range(8)], dim=1).flatten()


def test_the_stream_is_uniform_and_the_check_rejects_a_biased_one():
    values = drawn_in_batches()
    assert float(values.min()) >= 0.0 and float(values.max()) < 1.0
    assert uniformity_failures(values) == []
    biased = uniformity_failures(values**1.1)  # D ~ 0.035 against a bound ~ 0.0053
    assert biased and biased[0].startswith("KS distance"), biased
    repeated = uniformity_failures(values[::2].repeat_interleave(2))  # uniform, but each value twice
    assert len(repeated) == 1 and repeated[0].startswith("consecutive pairs"), repeated


@pytest.mark.gpu
def test_cuda_computes_the_cpus_values_bit_for_bit():
    gen = torch.Generator().manual_seed(5)
    keys = torch.randint(-(1 << 63), (1 << 63) - 1, (256,), generator=gen, dtype=torch.int64)
    positions = torch.randint(0, (1 << 63) - 1, (256, 64), generator=gen, dtype=torch.int64)
    positions[:, :8] = torch.arange(8)  # small counters too
    cpu = splitmix64_uniforms(keys, positions)
    assert torch.equal(splitmix64_uniforms(keys.cuda(), positions.cuda()).cpu(), cpu)
    on_cpu = [RequestRng(seed, stream="decode") for seed in range(32)]
    on_gpu = [RequestRng(seed, stream="decode") for seed in range(32)]
    draws = [seed % 4 != 0 for seed in range(32)]
    for n in (1, 7, 33):
        got = batch_uniforms(on_gpu, n, "cuda", draws)
        assert got.device.type == "cuda" and torch.equal(got.cpu(), batch_uniforms(on_cpu, n, "cpu", draws))
    where = torch.arange(32)[:, None] * 1000 + torch.arange(9)
    assert torch.equal(position_uniforms(on_gpu, where, "cuda").cpu(), position_uniforms(on_cpu, where))
