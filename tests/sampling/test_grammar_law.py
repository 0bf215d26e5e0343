"""Structured outputs' law in the verifier: at every context the target law is the filtered law of
the grammar's allowed tokens, renormalised, both where the target draws and where the drafts are
tested, so the emitted tokens follow the masked law whatever the drafts propose.

The drafts here are drawn from stochastic laws that put mass on forbidden tokens; the grammar's
second mask depends on the first draft, as a matcher's does. A naive combination — the target's
draws masked, the drafts' acceptance test against the unmasked law — is caught."""

from __future__ import annotations

import torch

from sampling import RequestRng, SamplingParams, Verifier, VerifyBatch, rejection_sample
from tests.sampling.helpers import ALPHA, chi_square_pvalue

V, K, ROWS = 16, 2, 50_000
ALLOWED_FIRST = [1, 2, 5, 9, 12]  # context 0


def allowed_after(first: int) -> list[int]:
    """Context 1's allowed tokens depend on the first draft (a grammar's state does)."""
    return [(first + j) % V for j in (0, 3, 4, 7)]


def bits(tokens: list[int]) -> int:
    word = 0
    for t in tokens:
        word |= 1 << t
    return word - (1 << 32) if word >= 1 << 31 else word  # as an int32


def case(seed: int, rows: int = ROWS):
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(K + 1, V, generator=gen)  # the target's, per context
    draft_laws = torch.softmax(torch.randn(K, V, generator=gen), -1)  # mass on forbidden tokens too
    drafts = torch.multinomial(draft_laws, rows, replacement=True, generator=gen).T  # [rows, K]
    bitmask = torch.full((rows, K + 1, 1), -1, dtype=torch.int32)
    bitmask[:, 0, 0] = bits(ALLOWED_FIRST)
    bitmask[:, 1, 0] = torch.tensor([bits(allowed_after(int(d))) for d in drafts[:, 0]], dtype=torch.int32)
    batch = VerifyBatch(drafts, draft_laws.expand(rows, K, V).contiguous(), bitmask=bitmask)
    return logits, batch


def masked_law(logits: torch.Tensor, allowed: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The oracle, written directly: softmax over the allowed tokens only."""
    law = torch.zeros(V, dtype=torch.float64)
    law[allowed] = torch.softmax(logits[allowed].double() / temperature, -1)
    return law


def run(verifier: Verifier, logits: torch.Tensor, batch: VerifyBatch, params: SamplingParams) -> torch.Tensor:
    rows = batch.rows
    rngs = [RequestRng(seed=i, stream="law") for i in range(rows)]
    result = verifier.verify(batch, logits.expand(rows, K + 1, V), [params] * rows, rngs)
    return result.output_token_ids


def law_holds(samples: torch.Tensor, law: torch.Tensor) -> bool:
    if (law[samples] == 0).any():
        return False  # a token the grammar forbids was emitted
    return chi_square_pvalue(samples, law) > ALPHA


def naive_verifier(unmasked: torch.Tensor) -> Verifier:
    """The target's draws masked, the acceptance test against the unmasked law q."""

    def sampler(draft_ids, draft_probs, target_probs, target_ids, uniforms, do_sample):
        return rejection_sample(draft_ids, draft_probs, unmasked, target_ids, uniforms, do_sample)

    return Verifier(sampler=sampler)


def test_emitted_tokens_follow_the_masked_law_at_both_positions():
    logits, batch = case(seed=0)
    out = run(Verifier(), logits, batch, SamplingParams(do_sample=True))
    assert law_holds(out[:, 0], masked_law(logits[0], ALLOWED_FIRST))
    # The second token, given the first draft was accepted: the law after it, under its mask.
    accepted = (out[:, 0] == batch.draft_token_ids[:, 0]) & (out[:, 1] >= 0)
    first = max(ALLOWED_FIRST, key=lambda t: int((accepted & (out[:, 0] == t)).sum()))
    rows = accepted & (out[:, 0] == first)
    assert rows.sum() > 2000
    assert law_holds(out[rows, 1], masked_law(logits[1], allowed_after(first)))


def test_top_k_and_temperature_apply_to_the_allowed_tokens():
    logits, batch = case(seed=1, rows=20_000)
    out = run(Verifier(), logits, batch, SamplingParams(do_sample=True, temperature=0.7, top_k=3))
    allowed = sorted(ALLOWED_FIRST, key=lambda t: -float(logits[0, t]))[:3]  # top-k among the allowed
    assert law_holds(out[:, 0], masked_law(logits[0], allowed, temperature=0.7))


def test_greedy_takes_the_argmax_over_allowed_tokens():
    logits, batch = case(seed=3, rows=100)
    assert int(logits[0].argmax()) not in ALLOWED_FIRST  # the case is one where masking matters
    out = run(Verifier(), logits, batch, SamplingParams())
    best = max(ALLOWED_FIRST, key=lambda t: float(logits[0, t]))
    assert (out[:, 0] == best).all()


def test_the_naive_combination_is_caught():
    logits, batch = case(seed=0, rows=5_000)
    unmasked = torch.softmax(logits, -1).expand(batch.rows, K + 1, V).contiguous()
    out = run(naive_verifier(unmasked), logits, batch, SamplingParams(do_sample=True))
    assert not law_holds(out[:, 0], masked_law(logits[0], ALLOWED_FIRST))
