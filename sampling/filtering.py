"""Logits -> the exact normalized distribution a sampler draws from.

Temperature, then top-k (ties with the k-th logit are kept, as in HF and vLLM), then
top-p over what top-k left (the smallest descending prefix whose mass reaches top_p;
ties broken by token id so the result is deterministic), then renormalization.
Greedy rows get a point mass at the argmax (lowest id among equal maxima); `point_mass` writes
such a law as one-hot rows wherever a dense distribution is expected. Structured outputs
restrict the logits to a grammar's allowed tokens first (`restrict`).
"""

from __future__ import annotations

import torch

from sampling.params import SamplingTensors


def filtered_probs(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """[N, V] logits (any float dtype) -> [N, V] float32 probabilities, rows sum to 1."""
    if params.all_greedy:  # point masses only: no softmax or filter over V to throw away
        return point_mass(logits.argmax(-1), logits.shape[-1])
    logits = logits.float() / params.temperature[:, None]  # [N, V]
    if params.needs_filter:
        logits = logits.masked_fill(~_kept_mask(logits, params), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if not params.any_greedy:
        return probs
    return torch.where(params.greedy[:, None], point_mass(logits.argmax(-1), logits.shape[-1]), probs)


def restrict(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Structured outputs' law: logits [..., V] with -inf wherever bitmask [..., ceil(V/32)] int32
    (bit j of word w allows token 32w + j) disallows, before temperature / top-k / top-p; so the
    law is the filtered law of the allowed tokens, renormalised, and a greedy row's token the
    argmax over them. Every row must allow at least one token."""
    return logits.masked_fill(~allowed_tokens(bitmask, logits.shape[-1]), float("-inf"))


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., ceil(V/32)] int32 bitmask (bit j of word w: token 32w + j) -> [..., V] bool."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask[..., None] >> bits) & 1).flatten(-2)[..., :vocab_size].bool()


def point_mass(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[...] int ids -> [..., V] float32 one-hot rows: a point mass's law written densely, where
    a dense distribution is expected (the one place such rows are built)."""
    rows = torch.zeros(*token_ids.shape, vocab_size, dtype=torch.float32, device=token_ids.device)
    return rows.scatter_(-1, token_ids.long()[..., None], 1.0)


def _kept_mask(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """[N, V] bool: tokens that survive top-k and top-p."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)  # [N, V]
    k = params.top_k.clamp(max=vocab)
    kth = sorted_logits.gather(1, (k - 1).clamp(min=0)[:, None])  # [N, 1]
    keep_sorted = (k[:, None] == 0) | (sorted_logits >= kth)
    sorted_probs = torch.softmax(sorted_logits.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    mass_before = sorted_probs.double().cumsum(-1) - sorted_probs.double()  # exclusive prefix
    top_p = params.top_p.double()[:, None]
    keep_sorted &= (top_p >= 1) | (mass_before < top_p)
    keep_sorted[:, 0] = True  # the most likely token always survives
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
