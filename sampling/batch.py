"""What a verification step passes along, one bundle per stage (shapes and dtypes documented
here, validated before any launch).

* `VerifyBatch`: a step's proposals in the verifier's layout (vLLM's SpecDecodeMetadata), built
  once from the rows' `Proposal`s; `Verifier.verify` takes it with the target's logits.
* `ChainInputs`: the six tensors of one chain launch, `rejection_sample`'s arguments (§2).
* `TreeInputs`: the nine tensors of one tree launch, `tree_rejection_sample`'s arguments.
The samplers' checks (sampling/checks.py), the torch references and the CuPy wrappers take the
launch bundles; the public functions build them from their positional arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sampling.filtering import point_mass
from sampling.proposal import Proposal

_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class ChainInputs:
    """One chain launch: K drafts per row (docs/design.md §2). Ids are TARGET-vocabulary ids."""

    draft_token_ids: torch.Tensor  # [B, K] int32|int64
    draft_probs: torch.Tensor | None  # [B, K, V] float32 in target space; None = point mass at the draft ids
    target_probs: torch.Tensor  # [B, K+1, V] float32: q after temperature/top-k/top-p
    target_token_ids: torch.Tensor  # [B, K+1] int32|int64 drawn from q (the argmax on greedy rows)
    uniform_samples: torch.Tensor  # [B, K+1] float32 in [0, 1)
    do_sample: torch.Tensor  # [B] bool: the rows the rejection test decides (else the greedy rule)


@dataclass(frozen=True)
class TreeInputs:
    """One tree launch: a breadth-first tree of at most N nodes per row (sampling/tree.py)."""

    draft_token_ids: torch.Tensor  # [B, N] int32|int64 target ids of the nodes
    parents: torch.Tensor  # [B, N] int32|int64, parents[b, n] in [-1, n-1]; -1 = the root
    num_nodes: torch.Tensor | None  # [B] int32|int64 in [0, N], or None (= N)
    draft_probs: torch.Tensor | None  # [B, N, V] float32 law each node was drawn from; None = point mass
    target_probs: torch.Tensor  # [B, N+1, V] float32: q at the root (0) and after node n (n+1)
    target_token_ids: torch.Tensor  # [B, N+1] int32|int64 drawn from q
    accept_uniforms: torch.Tensor  # [B, N] float32 in [0, 1)
    recover_uniforms: torch.Tensor  # [B, N+1] float32 in [0, 1)
    do_sample: torch.Tensor  # [B] bool


@dataclass(frozen=True)
class VerifyBatch:
    """A step's proposals in the verifier's layout, row b one request.

    draft_token_ids [B, N] int32|int64: row b's nodes as TARGET ids, breadth-first, siblings in
        draw order; entries past num_nodes[b] are ignored (0 as built);
    draft_probs [B, N, Vt] float32 in target space, the law each node was drawn from (a point
        mass as a one-hot row), or None: every row a point mass;
    parents [B, N] int32|int64, parents[b, n] in [-1, n-1] (-1 = the row's last emitted token,
        and past the row), or None: every row a chain (parents -1, 0, ..., N-2) of num_nodes[b];
    num_nodes [B] nodes per row in [0, N], or None (= N). Chains of different lengths (a
        `ragged` chain batch) only as point masses verified by coupling (draft_probs None, a
        position for every row): padded to N, each row's result cut at its own length (exact:
        coupled and greedy rows read no uniform of their stream, and the token at a row's
        last context is the target's whether the padding draft there is accepted or not);
    positions [B] the sequence position of row b's first target token for a row verified by
        coupling (a point-mass proposal, `Verifier`), None for one that is not; or None: no row;
    position_shift [B] int64 on the verifier's device, chains only: each coupled row's position
        is positions[b] + position_shift[b], known on the device alone (a step queued before the
        step in flight is read, built as if that step accepted all its drafts and moved back by
        what it rejected: engine/kv_cache.Shift); or None: the positions as given;
    bitmask [B, N+1, ceil(Vt/32)] int32, structured outputs: the tokens allowed at each context
        (row b's root, then after each node; all bits set past a row and on free rows), the
        target's logits restricted to them (`sampling.filtering.restrict`); or None: no row.
    Chains (`chain`, parents None) take the chain kernel (`rejection_sample`), anything else the
    tree kernel (a tree step costs the host more: bench/verify_layouts.py). The id and parent
    tensors may live on the host; the verifier moves them.
    """

    draft_token_ids: torch.Tensor
    draft_probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None
    num_nodes: Sequence[int] | None = None
    positions: Sequence[int | None] | None = None
    bitmask: torch.Tensor | None = None
    position_shift: torch.Tensor | None = None

    @property
    def chain(self) -> bool:
        """Chains of one depth and one law: the chain kernel verifies them."""
        return self.parents is None

    @property
    def ragged(self) -> bool:
        """Rows of different node counts."""
        return self.num_nodes is not None and len(set(self.num_nodes)) > 1

    @property
    def rows(self) -> int:
        return int(self.draft_token_ids.shape[0])

    @property
    def nodes(self) -> int:
        """N, the nodes of the widest row (K for chains)."""
        return int(self.draft_token_ids.shape[1])

    def node_counts(self) -> list[int]:
        """[B] nodes of each row."""
        return [self.nodes] * self.rows if self.num_nodes is None else list(self.num_nodes)

    def check(self) -> None:
        """ValueError naming the field, the expected and the actual value, when the fields
        disagree; reads shapes and host lists only (no device values)."""
        ids = self.draft_token_ids
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype not in _INT_DTYPES:
            got = f"{ids.dtype} of shape {list(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise ValueError(f"draft_token_ids: expected an int32|int64 tensor of shape [B, N], got {got}")
        batch, n = ids.shape
        if self.draft_probs is not None:
            probs = self.draft_probs
            if probs.dtype != torch.float32 or probs.dim() != 3 or tuple(probs.shape[:2]) != (batch, n):
                raise ValueError(
                    f"draft_probs: expected float32 of shape [{batch}, {n}, V], got {probs.dtype} {list(probs.shape)}"
                )
        if self.parents is not None and (
            tuple(self.parents.shape) != (batch, n) or self.parents.dtype not in _INT_DTYPES
        ):
            raise ValueError(
                f"parents: expected int32|int64 of shape [{batch}, {n}], got "
                f"{self.parents.dtype} {list(self.parents.shape)}"
            )
        if self.num_nodes is not None:
            counts = list(self.num_nodes)
            if len(counts) != batch:
                raise ValueError(f"num_nodes: expected {batch} entries, got {len(counts)}")
            bad = next((c for c in counts if not 0 <= c <= n), None)
            if bad is not None:
                raise ValueError(f"num_nodes: expected values in [0, {n}], got {bad}")
            coupled = self.draft_probs is None and self.positions is not None and None not in self.positions
            if self.parents is None and any(c != n for c in counts) and not coupled:
                raise ValueError(
                    f"num_nodes: expected {n} for every row of chains (parents None) unless every row is a "
                    f"point mass with a position, got {counts}"
                )
        if self.positions is not None and len(self.positions) != batch:
            raise ValueError(f"positions: expected {batch} entries, got {len(self.positions)}")
        move = self.position_shift
        if move is not None and (
            self.positions is None
            or self.parents is not None
            or move.dtype != torch.int64
            or tuple(move.shape) != (batch,)
        ):
            got = f"{move.dtype} {list(move.shape)}" + (" on a tree" if self.parents is not None else "")
            raise ValueError(f"position_shift: expected int64 of shape [{batch}] on chains with positions, got {got}")
        mask = self.bitmask
        if mask is not None and (
            mask.dtype != torch.int32 or mask.dim() != 3 or tuple(mask.shape[:2]) != (batch, n + 1)
        ):
            raise ValueError(
                f"bitmask: expected int32 of shape [{batch}, {n + 1}, W], got {mask.dtype} {list(mask.shape)}"
            )

    @classmethod
    def build(
        cls,
        proposals: Sequence[Proposal],
        positions: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
        masks: Sequence[torch.Tensor | None] | None = None,
    ) -> VerifyBatch:
        """The batch of row b's `proposals[b]` (NO_PROPOSAL: no nodes). positions[b]: the
        sequence position of the row's first target token (its history's length); only
        point-mass rows keep it, as they verify by coupling (each token the one a K = 0 step
        would draw at its position, so a seeded row's tokens do not depend on K). The laws go
        to `device`; a point mass is written densely (`point_mass`) only where another row of
        the batch is dense: chains of one depth and one law stay chains, and so do point-mass
        chains of any lengths (`ragged`). masks[b]: row b's
        [N_b+1, W] int32 grammar bitmasks (structured outputs), or None for a free row."""
        sizes = [len(p.token_ids) for p in proposals]
        n = max(sizes)
        bitmask = None
        if masks is not None and any(m is not None for m in masks):
            bitmask = torch.full((len(proposals), n + 1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
            for b, mask in enumerate(masks):
                if mask is not None:
                    bitmask[b, : len(mask)] = mask
        dense = [p.probs is not None for p in proposals]
        coupled = [None if d else at for at, d in zip(positions, dense, strict=True)]
        ids = torch.tensor([[*p.token_ids, *[0] * (n - len(p.token_ids))] for p in proposals], dtype=torch.int64)
        ids = ids.view(len(proposals), n)  # [B, N] also when every row is empty
        if all(p.is_chain for p in proposals) and len(set(dense)) == 1 and (len(set(sizes)) == 1 or not dense[0]):
            probs = torch.stack([p.probs for p in proposals]).to(device) if dense[0] else None
            return cls(ids, probs, None, sizes, coupled, bitmask)  # point masses: every row coupled
        parents = torch.tensor([[*p.parents, *[-1] * (n - len(p.parents))] for p in proposals], dtype=torch.int64)
        probs = None
        if any(dense):  # one launch for both laws: a point mass as one-hot rows
            probs = point_mass(ids.to(device), vocab_size)  # [B, N, Vt]
            for b, p in enumerate(proposals):
                if p.probs is not None and p.token_ids:
                    probs[b, : len(p.token_ids)] = p.probs
        return cls(ids, probs, parents.view(len(proposals), n), sizes, coupled, bitmask)
