"""Property tests: any well-formed input gives well-formed output."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sampling import rejection_sample


@st.composite
def inputs(draw):
    batch = draw(st.integers(0, 6))
    k = draw(st.integers(0, 4))
    vocab = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**31))
    dense = draw(st.booleans())
    sparsity = draw(st.sampled_from([0.0, 0.5, 0.9]))  # zero out entries to create ties and empty residuals
    gen = torch.Generator().manual_seed(seed)

    def dist(*shape):
        w = torch.rand(*shape, vocab, generator=gen)
        w = w * (torch.rand(*shape, vocab, generator=gen) >= sparsity)
        w[..., 0] += (w.sum(-1) == 0).float()  # keep every row normalizable
        return w / w.sum(-1, keepdim=True)

    draft_ids = torch.randint(0, vocab, (batch, k), generator=gen)
    target_ids = torch.randint(0, vocab, (batch, k + 1), generator=gen)
    uniforms = torch.rand(batch, k + 1, generator=gen)
    do_sample = torch.rand(batch, generator=gen) < 0.6
    return draft_ids, dist(batch, k) if dense else None, dist(batch, k + 1), target_ids, uniforms, do_sample


@settings(max_examples=300, deadline=None)
@given(inputs())
def test_outputs_are_well_formed(args):
    draft_ids, _, target_probs, _, _, _ = args
    batch, k = draft_ids.shape
    vocab = target_probs.shape[-1]
    out, emitted = rejection_sample(*args)
    assert out.shape == (batch, k + 1) and out.dtype == torch.int32
    assert emitted.shape == (batch,) and emitted.dtype == torch.int32
    for b in range(batch):
        n = int(emitted[b])
        assert 1 <= n <= k + 1
        assert all(0 <= t < vocab for t in out[b, :n].tolist())
        assert out[b, n:].tolist() == [-1] * (k + 1 - n)
        assert out[b, : n - 1].tolist() == draft_ids[b, : n - 1].tolist()  # accepted = draft prefix


@settings(max_examples=100, deadline=None)
@given(inputs())
def test_stochastic_recovery_has_positive_residual(args):
    draft_ids, draft_probs, target_probs, target_ids, _uniforms, do_sample = args
    out, emitted = rejection_sample(*args)
    k = draft_ids.shape[1]
    for b in range(draft_ids.shape[0]):
        i = int(emitted[b]) - 1
        if i == k or not do_sample[b]:
            continue
        q = target_probs[b, i]
        if draft_probs is None:
            residual = q.clone()
            residual[draft_ids[b, i]] = 0
        else:
            residual = torch.relu(q - draft_probs[b, i])
        token = int(out[b, i])
        assert residual[token] > 0 or (residual.sum() == 0 and token == int(target_ids[b, i]))
