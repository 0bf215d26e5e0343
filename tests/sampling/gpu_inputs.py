"""Random rejection-sampling inputs generated directly on a GPU (large V stays fast)."""

from __future__ import annotations

import torch


def gpu_inputs(
    batch: int, k: int, vocab: int, *, seed: int, dense: bool, device: str = "cuda", greedy_fraction: float = 0.3
):
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = 3 * torch.randn(batch, k + 1, vocab, generator=gen, device=device)
    target_probs = torch.softmax(logits, -1)
    draft_probs = torch.softmax(logits[:, :k] + torch.randn(batch, k, vocab, generator=gen, device=device), -1)
    if batch * k == 0:
        draft_ids = torch.zeros(batch, k, dtype=torch.int64, device=device)
    elif dense:
        draft_ids = torch.multinomial(draft_probs.view(-1, vocab), 1, generator=gen).view(batch, k)
    else:
        draft_ids = draft_probs.argmax(-1)
    target_ids = (
        torch.multinomial(target_probs.view(-1, vocab), 1, generator=gen).view(batch, k + 1)
        if batch
        else torch.zeros(0, k + 1, dtype=torch.int64, device=device)
    )
    uniforms = torch.rand(batch, k + 1, generator=gen, device=device)
    do_sample = torch.rand(batch, generator=gen, device=device) >= greedy_fraction
    return draft_ids, draft_probs if dense else None, target_probs, target_ids, uniforms, do_sample
