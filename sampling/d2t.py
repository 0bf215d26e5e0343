"""Draft-vocabulary -> target-vocabulary mapping.

`d2t[j]` is the absolute target id of draft id j. Distributions map by scatter-add, so a
many-to-one map keeps total mass. The scatter is split into "levels": level l holds the
l-th draft id of every target id, so within a level the target ids are distinct and the
adds never collide. The sum order is therefore fixed (deterministic on every device,
no atomics) and an injective map is a single gather-free copy.

`DraftToTargetMap.proposal` is the one place a draft model's draw becomes a target-space
`Proposal` (sampling/proposal.py): the ones a decode node receives from the wire pass through
it, and the proposers' own drafts through `proposals`, the same for a step's rows at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sampling.proposal import DRAFT, Drafted, Proposal


@dataclass(frozen=True)
class _Level:
    draft_ids: torch.Tensor  # [n] int64
    target_ids: torch.Tensor  # [n] int64, distinct


class DraftToTargetMap:
    """A validated d2t map; build once per model pair, then map on the hot path."""

    def __init__(self, d2t: torch.Tensor, target_vocab_size: int) -> None:
        _validate_map(d2t, target_vocab_size)
        self.d2t = d2t.to(torch.int64).contiguous()  # [Vd]
        self.draft_vocab_size = int(d2t.shape[0])
        self.target_vocab_size = int(target_vocab_size)
        self.is_identity = self.draft_vocab_size == self.target_vocab_size and bool(
            torch.equal(self.d2t.cpu(), torch.arange(self.draft_vocab_size))
        )
        self._levels = _split_into_levels(self.d2t)
        self.is_injective = len(self._levels) <= 1

    @classmethod
    def identity(cls, vocab_size: int) -> DraftToTargetMap:
        return cls(torch.arange(vocab_size), vocab_size)

    def to(self, device: torch.device | str) -> DraftToTargetMap:
        moved = object.__new__(DraftToTargetMap)
        moved.__dict__.update(self.__dict__)
        moved.d2t = self.d2t.to(device)
        moved._levels = [_Level(lv.draft_ids.to(device), lv.target_ids.to(device)) for lv in self._levels]
        return moved

    def map_tokens(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape, integer) -> target ids (same shape, int64)."""
        if self.is_identity:  # a layer-skip draft: no gather on the drafting path
            return draft_ids.long()
        return self.d2t[draft_ids.long()]

    def map_probs(self, draft_probs: torch.Tensor) -> torch.Tensor:
        """[..., Vd] float32 -> [..., Vt] float32; the identity map returns its input."""
        if draft_probs.shape[-1] != self.draft_vocab_size:
            raise ValueError(
                f"draft_probs: expected last dim {self.draft_vocab_size} (draft vocab size), "
                f"got shape {tuple(draft_probs.shape)}"
            )
        if self.is_identity:
            return draft_probs
        out = draft_probs.new_zeros(*draft_probs.shape[:-1], self.target_vocab_size)
        for level in self._levels:
            out[..., level.target_ids] += draft_probs[..., level.draft_ids]
        return out

    def map_sparse(self, draft_ids: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """A sparse proposal, [K, M] draft ids with their [K, M] float32 probabilities, as dense
        [K, Vt] target-space rows. Scatter-added on the host, whose order is deterministic."""
        out = torch.zeros(draft_ids.shape[0], self.target_vocab_size, dtype=torch.float32)
        return out.scatter_add_(1, self.map_tokens(draft_ids), probs)

    def proposal(
        self,
        token_ids: Sequence[int],
        parents: Sequence[int],
        probs: torch.Tensor | None = None,
        sparse_ids: torch.Tensor | None = None,
        *,
        source: str = DRAFT,
        drafted: Drafted | None = None,
    ) -> Proposal:
        """A draw in draft space as the target-space `Proposal` the verifier reads.

        token_ids [N]: the drawn tokens as TARGET ids (their draft ids through this map: the
        wire carries them so, and the drafting loop maps them on the device to feed them back);
        parents [N] (breadth-first, -1 = the last emitted token). The law each node was drawn
        from, in DRAFT space, is one of
        * dense: probs [N, Vd] float32 (any device), scatter-added along d2t (`map_probs`);
        * sparse: probs [N, M] float32 with sparse_ids [N, M] int draft ids, scatter-added on
          the host into [N, Vt] (`map_sparse`);
        * point mass: probs None; it stays None (the samplers skip all dense work).
        `source` and `drafted` (the draw itself, for the wire) are carried as given."""
        if sparse_ids is not None:
            if probs is None:
                raise ValueError("probs: expected the [N, M] probabilities of sparse_ids, got None")
            target_probs = self.map_sparse(sparse_ids, probs)
        else:
            target_probs = None if probs is None else self.map_probs(probs)
        return Proposal(list(token_ids), list(parents), target_probs, source, drafted)

    def proposals(self, drafted: Sequence[Drafted], source: str = DRAFT) -> list[Proposal]:
        """`proposal` of each row's draw (`Drafted`: target ids, parents, its dense draft-space
        law or None), the dense laws of all rows mapped by one `map_probs` over their
        concatenation: a drafting step's rows cost the mapping's few launches once, not per row."""
        laws = [d.probs for d in drafted if d.probs is not None]
        mapped = iter(self.map_probs(torch.cat(laws)).split([len(law) for law in laws]) if laws else [])
        return [
            Proposal(list(d.target_ids), list(d.parents), None if d.probs is None else next(mapped), source, d)
            for d in drafted
        ]


def map_draft_probs_to_target(
    draft_probs: torch.Tensor, d2t: torch.Tensor | DraftToTargetMap, target_vocab_size: int
) -> torch.Tensor:
    """[..., Vd] -> [..., Vt] by scatter-add along d2t; validates a raw map first."""
    if isinstance(d2t, DraftToTargetMap):
        if d2t.target_vocab_size != target_vocab_size:
            raise ValueError(
                f"target_vocab_size: expected {d2t.target_vocab_size} (the map's), got {target_vocab_size}"
            )
        mapping = d2t
    else:
        mapping = DraftToTargetMap(d2t, target_vocab_size).to(draft_probs.device)
    return mapping.map_probs(draft_probs)


def _validate_map(d2t: torch.Tensor, target_vocab_size: int) -> None:
    if not isinstance(d2t, torch.Tensor):
        raise ValueError(f"d2t: expected a torch.Tensor, got {type(d2t).__name__}")
    if d2t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"d2t: expected dtype int64 (or int32), got {d2t.dtype}")
    if d2t.dim() != 1:
        raise ValueError(f"d2t: expected a 1-D tensor, got shape {tuple(d2t.shape)}")
    if isinstance(target_vocab_size, bool) or not isinstance(target_vocab_size, int) or target_vocab_size < 1:
        raise ValueError(f"target_vocab_size: expected an int >= 1, got {target_vocab_size!r}")
    if d2t.numel() == 0:
        raise ValueError("d2t: expected at least one draft id, got length 0")
    lo, hi = int(d2t.min()), int(d2t.max())
    if lo < 0 or hi >= target_vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"d2t: expected values in [0, {target_vocab_size}), got {bad}")


def _split_into_levels(d2t: torch.Tensor) -> list[_Level]:
    """Group draft ids so each level maps to distinct target ids (see module doc)."""
    d2t_cpu = d2t.cpu()
    order = torch.argsort(d2t_cpu, stable=True)  # draft ids grouped by target id
    sorted_targets = d2t_cpu[order]
    group_start = torch.ones_like(sorted_targets, dtype=torch.bool)
    group_start[1:] = sorted_targets[1:] != sorted_targets[:-1]
    start_index = torch.cummax(torch.where(group_start, torch.arange(len(order)), 0), 0).values
    rank_in_group = torch.arange(len(order)) - start_index  # 0 for the first draft id of a target
    levels = []
    for rank in range(int(rank_in_group.max()) + 1):
        pick = rank_in_group == rank
        levels.append(_Level(order[pick].to(d2t.device), sorted_targets[pick].to(d2t.device)))
    return levels
