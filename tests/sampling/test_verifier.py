"""The verifier step and per-request reproducibility."""

import torch

from sampling import DraftToTargetMap, RequestRng, SamplingParams, Verifier, VerifyBatch

VT, VD, K = 12, 8, 3
D2T = torch.tensor([11, 0, 3, 3, 5, 7, 1, 2])  # non-identity, many-to-one (3 <- 2 and 3)


def step_inputs(batch, seed):
    """Draft ids (target space), draft probs mapped to target space, target logits."""
    gen = torch.Generator().manual_seed(seed)
    draft_probs = torch.softmax(torch.randn(batch, K, VD, generator=gen), -1)
    draft_ids = D2T[torch.multinomial(draft_probs.view(-1, VD), 1, generator=gen).view(batch, K)]
    logits = torch.randn(batch, K + 1, VT, generator=gen)
    return draft_ids, DraftToTargetMap(D2T, VT).map_probs(draft_probs), logits


def test_seeded_row_is_identical_alone_and_in_any_batch():
    verifier = Verifier(backend="torch")
    params = SamplingParams(do_sample=True, temperature=0.9, seed=1234)
    draft_ids, draft_probs, logits = step_inputs(1, seed=0)
    alone = [
        verifier.verify(VerifyBatch(draft_ids, draft_probs), logits, [params], [RequestRng(1234)]).emitted(0)
        for _ in range(2)
    ]
    assert alone[0] == alone[1]
    for batch, position in ((5, 0), (17, 9), (64, 63)):
        other_ids, other_probs, other_logits = step_inputs(batch, seed=batch)
        other_ids[position], other_probs[position], other_logits[position] = draft_ids[0], draft_probs[0], logits[0]
        all_params = [SamplingParams(do_sample=b % 2 == 0, seed=b) for b in range(batch)]
        all_params[position] = params
        rngs = [RequestRng(p.seed) for p in all_params]
        result = verifier.verify(VerifyBatch(other_ids, other_probs), other_logits, all_params, rngs)
        assert result.emitted(position) == alone[0]


def test_consecutive_steps_draw_fresh_uniforms():
    verifier = Verifier(backend="torch")
    params = [SamplingParams(do_sample=True, seed=7)] * 64
    rngs = [RequestRng(7 + i) for i in range(64)]
    draft_ids, draft_probs, logits = step_inputs(64, seed=3)
    first = verifier.verify(VerifyBatch(draft_ids, draft_probs), logits, params, rngs).output_token_ids
    second = verifier.verify(VerifyBatch(draft_ids, draft_probs), logits, params, rngs).output_token_ids
    assert not torch.equal(first, second)


def test_stats_are_consistent_with_outputs():
    verifier = Verifier(backend="torch")
    batch = 40
    params = [SamplingParams(do_sample=b % 3 != 0, top_k=b % 5) for b in range(batch)]
    draft_ids, draft_probs, logits = step_inputs(batch, seed=4)
    result = verifier.verify(VerifyBatch(draft_ids, draft_probs), logits, params, [RequestRng(b) for b in range(batch)])
    stats = result.stats
    assert stats.draft_tokens.tolist() == [K] * batch
    assert (stats.accepted_tokens == result.accepted_token_num.long() - 1).all()
    assert (stats.accepted_per_position.sum(-1) == stats.accepted_tokens).all()
    assert stats.do_sample.tolist() == [not p.is_greedy for p in params]


def test_greedy_rows_match_target_argmax():
    verifier = Verifier(backend="torch")
    draft_ids, _, logits = step_inputs(16, seed=5)
    draft_ids[:, 0] = logits[:, 0].argmax(-1)  # first draft always right
    result = verifier.verify(VerifyBatch(draft_ids), logits, [SamplingParams()] * 16, [RequestRng(0)] * 16)
    greedy = logits.argmax(-1)
    for b in range(16):
        emitted = result.emitted(b)
        assert emitted == greedy[b, : len(emitted)].tolist()
        assert len(emitted) >= 2


def test_greedy_rows_draw_no_uniforms_and_emit_what_drawn_ones_would():
    """A greedy row's tokens are argmaxes (target, recovered, bonus) and its acceptance a
    comparison, so verify draws nothing from its generator; a sampled row draws 2(K+1)."""
    verifier = Verifier(backend="torch")
    batch = 12
    params = [SamplingParams(do_sample=b % 3 == 0, temperature=0.8, top_k=1 if b == 6 else 0) for b in range(batch)]
    draft_ids, draft_probs, logits = step_inputs(batch, seed=6)
    rngs = [RequestRng(b) for b in range(batch)]
    result = verifier.verify(VerifyBatch(draft_ids, draft_probs), logits, params, rngs)
    for b, (p, rng) in enumerate(zip(params, rngs, strict=True)):
        fresh = RequestRng(b)
        if not p.is_greedy:
            fresh.uniforms(2 * (K + 1))  # what a sampled row consumed
        assert torch.equal(rng.uniforms(4), fresh.uniforms(4)), b
    # The greedy rows' tokens are those the same rows give with uniforms drawn (the torch
    # reference, which reads them only for sampled rows).
    from sampling import SamplingTensors, rejection_sample, sample_target

    rows = SamplingTensors.from_params(params)
    uniforms = torch.rand(batch, 2 * (K + 1), generator=torch.Generator().manual_seed(9))
    target = sample_target(logits, rows, uniforms[:, : K + 1])
    drawn, emitted = rejection_sample(
        draft_ids, draft_probs, target.probs, target.token_ids, uniforms[:, K + 1 :].contiguous(), rows.do_sample
    )
    for b, p in enumerate(params):
        if p.is_greedy:
            assert result.emitted(b) == drawn[b, : int(emitted[b])].tolist(), b


def test_greedy_tree_rows_draw_no_uniforms():
    verifier = Verifier(backend="torch")
    batch = 4
    params = [SamplingParams(do_sample=b % 2 == 0) for b in range(batch)]
    draft_ids, draft_probs, logits = step_inputs(batch, seed=8)
    parents = torch.tensor([[-1, 0, 1]] * batch)  # chains, as trees
    rngs = [RequestRng(b) for b in range(batch)]
    result = verifier.verify(VerifyBatch(draft_ids, draft_probs, parents, [K] * batch), logits, params, rngs)
    assert result.accepted_token_num.shape == (batch,)
    for b, (p, rng) in enumerate(zip(params, rngs, strict=True)):
        fresh = RequestRng(b)
        if not p.is_greedy:
            fresh.uniforms(2 * (K + 1))
        assert torch.equal(rng.uniforms(4), fresh.uniforms(4)), b
