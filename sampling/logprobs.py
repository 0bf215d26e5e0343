"""Log-probabilities of generated tokens under the target's own distribution.

"Own" means the model's logits at temperature 1 with no top-k/top-p filtering (what the
OpenAI API's `logprobs` reports, and vLLM's default): the sampling parameters change which
token is drawn, not the probabilities reported for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TokenLogprob:
    logprob: float  # of the generated token
    top_token_ids: list[int]  # the `top` most likely tokens, most likely first
    top_logprobs: list[float]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """logits [N, V] (any float dtype, any device), tokens [N] int64 -> N entries.

    One host transfer for the whole batch of rows."""
    if logits.dim() != 2 or tokens.shape != (logits.shape[0],):
        raise ValueError(f"logits/tokens: expected [N, V] and [N], got {list(logits.shape)} and {list(tokens.shape)}")
    if not 0 <= top <= logits.shape[1]:
        raise ValueError(f"top: expected 0..{logits.shape[1]}, got {top}")
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    chosen = logp.gather(1, tokens.to(logp.device).view(-1, 1)).view(-1)  # [N]
    values, ids = logp.topk(top, dim=-1) if top else (logp[:, :0], tokens.new_zeros(len(tokens), 0))
    chosen, values, ids = chosen.cpu().tolist(), values.cpu().tolist(), ids.cpu().tolist()
    return [TokenLogprob(c, i, v) for c, i, v in zip(chosen, ids, values, strict=True)]
