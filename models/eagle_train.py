"""Training a hidden-state head (models/eagle.py) on a target's own generations.

* Data: the sequences and top-k laws of models/distill.py (`generate_samples`,
  `target_distributions`), plus, per sequence, the target's hidden states from ONE dense forward
  (`target_features`): the head's input layers and the last layer's output (the feature loss's
  regression target), stored in bfloat16.
* Forward (`ttt_forward`): the training-time test of EAGLE-3. Pass 0 reads the target's fused
  features at every position; pass j reads the head's own outputs of pass j - 1 one position
  back, and attends to pass 0's keys up to j positions back and to passes 1..j along its own
  chain: what the head sees when it drafts j tokens past the last position the target computed.
* Loss (`ttt_loss`): per pass, cross-entropy of the head's law over its reduced vocabulary
  against the target's top-k law (the mass on ids outside the vocabulary dropped, the rest
  renormalised), plus `feature_weight` x smooth-L1 of its output against the target's last
  hidden state at the next position; later passes weighted by `decay` ** j.
* Evaluation (`acceptance`): the chains of `ttt_forward` on held-out generations, against the
  target's own logits there: acceptance by position, greedy and at a temperature (expected
  sum(min(p, q)) per position, chained), and the mean accepted drafts per step at K = 1..6.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from models.distill import (
    CheckpointMismatch,
    DenseCausal,
    Targets,
    batch_indices,
    collate,
    lr_at,
    mixed_precision,
    pad_batch,
    save_checkpoint,
)
from models.eagle import EagleConfig, EagleHead
from models.llama import LlamaForCausalLM

EVAL_K = 6  # mean accepted drafts reported for K = 1..EVAL_K


@dataclass(frozen=True)
class HeadSettings:
    """What fixes a head's training trajectory; a resumed run must have the same."""

    steps: int
    batch: int
    lr: float
    seed: int
    passes: int = 3  # training-time test: pass 0 on the target's features, then the head's own
    feature_weight: float = 0.1
    decay: float = 0.8  # weight of pass j: decay ** j


def target_features(
    module: LlamaForCausalLM, sequences: Sequence[list[int]], feature_layers: Sequence[int], *, batch: int
) -> list[torch.Tensor]:
    """Per sequence [T, (len(feature_layers) + 1) * H] bfloat16: the outputs of the head's input
    layers, then the last layer's, from one teacher-forced forward (no second pass)."""
    device = module.lm_head.weight.device
    layers = (*feature_layers, module.config.num_layers - 1)
    out = []
    for start in range(0, len(sequences), batch):
        chunk = sequences[start : start + batch]
        tokens, _ = pad_batch(chunk, device)
        _, features = dense_forward(module, tokens, layers)
        for row, seq in enumerate(chunk):
            out.append(features[row, : len(seq)].to(torch.bfloat16).cpu())
    return out


def dense_forward(
    module: LlamaForCausalLM, tokens: torch.Tensor, layers: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, T] -> float32 logits [B, T, V] and features [B, T, len(layers) * H]."""
    b, t = tokens.shape
    positions = torch.arange(t, device=tokens.device).repeat(b)
    kv = DenseCausal(b, t, module.config.sliding_window)
    with torch.inference_mode():
        logits, features = module(tokens.reshape(-1), positions, kv, features_at=tuple(layers))
    return logits.float().view(b, t, -1), features.float().view(b, t, -1)


class ChainAttention:
    """The KvStore of `ttt_forward`: B rows of n positions, one pass at a time (`next_pass`).
    A query of pass j at position i attends pass 0 at positions <= i - j and pass s (1..j) at
    position i - j + s: the KV a head holds when it drafts its (j + 1)-th token from position i - j."""

    def __init__(self, batch: int, length: int) -> None:
        self.batch, self.length = batch, length
        self.keys: list[torch.Tensor] = []  # per pass [B, Hkv, n, D]
        self.values: list[torch.Tensor] = []

    def mask(self, j: int, device) -> torch.Tensor:
        """[n, (j + 1) n] bool for pass j."""
        i = torch.arange(self.length, device=device)[:, None]
        p = torch.arange(self.length, device=device)[None, :]
        blocks = [p <= i - j] + [p == i - j + s for s in range(1, j + 1)]
        return torch.cat(blocks, dim=1)

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        b, n = self.batch, self.length
        k, v = kv  # [B*n, Hkv, D]
        self.keys.append(k.view(b, n, *k.shape[1:]).transpose(1, 2))
        self.values.append(v.view(b, n, *v.shape[1:]).transpose(1, 2))
        q4 = q.view(b, n, *q.shape[1:]).transpose(1, 2)  # [B, Hq, n, D]
        mask = self.mask(len(self.keys) - 1, q.device)
        out = F.scaled_dot_product_attention(
            q4, torch.cat(self.keys, 2), torch.cat(self.values, 2), attn_mask=mask, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(q.shape)  # [B*n, Hq, D]


def ttt_forward(
    head: EagleHead, tokens: torch.Tensor, features: torch.Tensor, passes: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """tokens [B, T], features [B, T, F] (the head's input layers) -> per pass j the logits
    [B, T - 1, Vd] and outputs [B, T - 1, H] of positions 0..T-2 (position i reads token i + 1
    and predicts token i + 2; in pass j it is the (j + 1)-th draft from position i - j)."""
    b, t = tokens.shape
    n, h = t - 1, head.config.hidden_size
    hidden = head.fuse(features[:, :-1])  # [B, n, H]
    ids = tokens[:, 1:].reshape(-1)
    positions = torch.arange(n, device=tokens.device).repeat(b)
    store = ChainAttention(b, n)
    out = []
    for _ in range(passes):
        logits, output = head(ids, hidden.reshape(-1, h), positions, store)
        logits, output = logits.view(b, n, -1), output.view(b, n, h)
        out.append((logits, output))
        hidden = torch.cat([torch.zeros_like(output[:, :1]), output[:, :-1]], dim=1)  # position i reads i - 1's
    return out


def draft_index(config: EagleConfig, device) -> torch.Tensor:
    """[Vt] int64: each target id's draft id, -1 for ids outside the reduced vocabulary."""
    t2d = torch.full((config.target_vocab_size,), -1, dtype=torch.int64)
    t2d[torch.tensor(config.d2t)] = torch.arange(config.draft_vocab_size)
    return t2d.to(device)


def ttt_loss(
    head: EagleHead,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    ids: torch.Tensor,
    probs: torch.Tensor,
    features: torch.Tensor,
    settings: HeadSettings,
) -> tuple[torch.Tensor, list[float]]:
    """The loss of a batch (tokens, mask [B, T]; the target's top-k law ids/probs [B, T, k];
    features [B, T, F + H]) and each pass's top-1 agreement with the target."""
    h = head.config.hidden_size
    inputs, last = features[..., :-h], features[..., -h:]
    t2d = draft_index(head.config, tokens.device)
    mapped = t2d[ids[:, 1:]]  # [B, n, k]: the law at position i + 1 predicts token i + 2
    kept = torch.where(mapped >= 0, probs[:, 1:], torch.zeros_like(probs[:, 1:]))
    kept = kept / kept.sum(-1, keepdim=True).clamp_min(1e-12)
    valid = mask[:, 1:] & (mapped[..., 0] >= 0)  # a real next position whose argmax the head can propose
    total, agreement = torch.zeros((), device=tokens.device), []
    for j, (logits, output) in enumerate(ttt_forward(head, tokens, inputs, settings.passes)):
        rows = valid.clone()
        rows[:, :j] = False  # no chain starts before position 0
        log_q = torch.log_softmax(logits.float(), -1).gather(-1, mapped.clamp_min(0))  # [B, n, k]
        ce = -(kept * log_q).sum(-1)
        feature = F.smooth_l1_loss(output.float(), last[:, 1:].float(), reduction="none").mean(-1)
        per_position = ce + settings.feature_weight * feature
        total = total + settings.decay**j * per_position[rows].mean()
        agreement.append(float((logits.argmax(-1) == mapped[..., 0])[rows].float().mean()))
    return total, agreement


def init_head(config: EagleConfig, target: LlamaForCausalLM) -> EagleHead:
    """A float32 head reading the target's embedding: `fc` starts as the highest input layer's
    identity, the vocabulary head as the target's rows of its draft ids and the final norm as
    the target's; the decoder layer's MLP and norms start as the target's last layer's."""
    head = EagleHead(config, target.model.embed_tokens).to(target.lm_head.weight.device)
    h = config.hidden_size
    last = target.model.layers[-1]
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, -h:] = torch.eye(h)
        head.lm_head.weight.copy_(target.lm_head.weight[torch.tensor(config.d2t)].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
        head.mlp.load_state_dict({k: v.float() for k, v in last.mlp.state_dict().items()})
        head.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight.float())
    return head


def collate_features(items: Sequence[Targets], features: Sequence[torch.Tensor], device):
    """tokens, mask, ids, probs as models/distill.collate, and features [B, T, F + H] float32."""
    tokens, mask, ids, probs = collate(items, device)
    out = torch.zeros(*tokens.shape, features[0].shape[-1], dtype=torch.float32)
    for row, f in enumerate(features):
        out[row, : len(f)] = f.float()
    return tokens, mask, ids, probs, out.to(device)


def progress_bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // max(total, 1)
    return "[" + "#" * filled + "." * (width - filled) + "]"


def train_head(
    head: EagleHead,
    items: Sequence[Targets],
    features: Sequence[torch.Tensor],
    settings: HeadSettings,
    directory: Path,
    *,
    resume: Path | None = None,
    save_every: int = 100,
    log_every: int = 10,
    log: Callable[[str], None] = print,
) -> list[float]:
    """AdamW on `ttt_loss` for `settings.steps` steps; checkpoints (weights, optimizer state,
    losses) every `save_every` steps and at the end; from `resume` on when given. `log` gets a
    progress line every `log_every` steps. Returns the loss of every step from 0."""
    device = head.lm_head.weight.device
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.01)
    step, losses = 0, []
    if resume is not None:
        state = torch.load(resume, map_location=device, weights_only=True)
        if state["settings"] != settings.__dict__:
            raise CheckpointMismatch(
                f"resume: expected a checkpoint of {settings.__dict__}, got {state['settings']} ({resume})"
            )
        head.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, losses = state["step"], list(state["losses"])
    head.train()
    started, first_step, seen = time.perf_counter(), step, 0
    agreement: list[float] = []
    while step < settings.steps:
        chosen = batch_indices(step, settings.batch, len(items), settings.seed)
        batch = collate_features([items[i] for i in chosen], [features[i] for i in chosen], device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        with mixed_precision(device):
            loss, agreement = ttt_loss(head, *batch, settings)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        seen += int(batch[1].sum())
        step += 1
        if step % log_every == 0 or step == settings.steps:
            recent = losses[-log_every:]
            elapsed = time.perf_counter() - started
            eta = elapsed / (step - first_step) * (settings.steps - step)
            log(
                f"{progress_bar(step, settings.steps)} step {step}/{settings.steps}  "
                f"loss {sum(recent) / len(recent):.4f}  lr {lr_at(step - 1, settings):.2e}  "
                f"top-1 by pass {' '.join(f'{a:.2f}' for a in agreement)}  "
                f"{seen / elapsed:,.0f} tokens/s  eta {eta:.0f} s"
            )
        if step % save_every == 0 or step == settings.steps:
            save_checkpoint(directory, step, head, optimizer, settings, losses)
    head.eval()
    return losses


def acceptance(
    head: EagleHead,
    target: LlamaForCausalLM,
    sequences: Sequence[list[int]],
    *,
    k: int = EVAL_K,
    temperature: float = 0.7,
    batch: int = 8,
) -> dict:
    """Acceptance by draft position along held-out generations, for a chain of k drafts from
    every position: greedy (the head's argmax is the target's, every earlier one too) and at
    `temperature` (the chained expected sum(min(p, q)) of the two tempered laws, the head's
    mapped through d2t); `mean_accepted[K - 1]`: expected accepted drafts per step at K."""
    device = target.lm_head.weight.device
    config = head.config
    layers = (*config.feature_layers,)
    d2t = torch.tensor(config.d2t, device=device)
    greedy_sum = torch.zeros(k, dtype=torch.float64)
    stochastic_sum = torch.zeros(k, dtype=torch.float64)
    starts = 0
    for begin in range(0, len(sequences), batch):
        chunk = sequences[begin : begin + batch]
        tokens, _ = pad_batch(chunk, device)
        q_logits, features = dense_forward(target, tokens, layers)  # [B, T, V], [B, T, F]
        with torch.inference_mode():
            chains = ttt_forward(head, tokens, features, k)
        q_next = q_logits[:, 1:]  # [B, n, V]: position i + 1's law, what position i's draft must match
        q_top, q_t = q_next.argmax(-1), torch.softmax(q_next / temperature, -1)
        greedy, overlap = [], []
        for j, (logits, _) in enumerate(chains):
            # pass j at position i is draft j + 1 of the chain from base i - j: [:, j:] is by base
            p = logits.float()
            greedy.append((d2t[p.argmax(-1)] == q_top).double()[:, j:])
            p_t = torch.zeros_like(q_t).index_add_(-1, d2t, torch.softmax(p / temperature, -1))
            overlap.append(torch.minimum(p_t, q_t).sum(-1).double()[:, j:])
        for row, seq in enumerate(chunk):
            n = len(seq) - k  # chain bases whose k drafts all have a real law to match
            if n <= 0:
                continue
            g = torch.stack([greedy[j][row, :n] for j in range(k)]).cumprod(0)  # [k, n]
            s = torch.stack([overlap[j][row, :n] for j in range(k)]).cumprod(0)
            greedy_sum += g.sum(1).cpu()
            stochastic_sum += s.sum(1).cpu()
            starts += n
    if starts == 0:
        raise ValueError(f"sequences: expected a held-out sequence longer than {k + 1} tokens, got none")
    out = {"k": k, "temperature": temperature, "starts": starts}
    for name, total in (("greedy", greedy_sum), ("stochastic", stochastic_sum)):
        per_position = (total / starts).tolist()
        out[name] = {
            "per_position": per_position,
            "mean_accepted": [math.fsum(per_position[:K]) for K in range(1, k + 1)],
        }
    return out
