"""One interface for target and draft models (docs/design.md §6).

A model maps token-id histories to next-token logits. Its per-request `State` is what
the verify pass extends, rejection truncates, and the wire ships: `export_state` gives
tensors (the KV cache; none for models whose state is the token ids alone) that the other
node imports without recomputing the prompt. Import goes a chunk at a time straight into the
model's own storage (`begin_import`, `import_chunk`, `finish_import`), so a streamed KV is
never held twice; `import_state` (whole tensors) is the one-chunk-per-tensor case of it.
Draft models take TARGET-vocabulary ids as input (EAGLE-style: they read the same
history as the target) and emit logits over their own vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from models.kv_import import Buffer, KvWriter
from protos.kv_layout import KvTensorSpec


@dataclass
class State:
    """A request's history. `tokens` are the ids the model has consumed, in order."""

    tokens: list[int] = field(default_factory=list)
    kv: object = None  # backend-specific cache; None for the n-gram models
    tree: TreeSpan | None = None  # an open tree of candidate tokens after the history (extend_tree)
    importing: KvWriter | None = None  # between begin_import and finish_import (or release)
    # A target serving a hidden-state draft (models/eagle.py): its fused-layer hidden states
    # [n, F] of the LAST n consumed tokens, appended by every forward until the draft takes them.
    features: torch.Tensor | None = None
    keeps_features: bool = True  # False: a request that never drafts (the decode node's K = 0)
    rides: State | None = None  # the draft's state shipped with this one (models/pair.py)


@dataclass
class TreeSpan:
    """Tokens consumed as a TREE after the history (a verify pass over candidate trees, or a
    draft expanding one): span token t sits in slot `base + t` but at position
    `base + depths[t]`, and attends to the history (slots < base) and to its own ancestors
    (and itself) only. `ancestry[t]` is that set as a bit mask over span indices."""

    base: int
    parents: list[int] = field(default_factory=list)  # -1 = the last history token
    depths: list[int] = field(default_factory=list)
    ancestry: list[int] = field(default_factory=list)
    chain: bool = True  # every token's parent is the one before it: the mask is the causal one

    def add(self, parents: Sequence[int]) -> None:
        """Append tokens whose parents are earlier span indices (or -1); ValueError otherwise."""
        for parent in parents:
            t = len(self.parents)
            if not -1 <= parent < t:
                raise ValueError(f"parents[{t}]: expected -1..{t - 1} (an earlier tree token), got {parent}")
            self.chain &= parent == t - 1
            self.parents.append(parent)
            self.depths.append(0 if parent < 0 else self.depths[parent] + 1)
            self.ancestry.append((1 << t) | (0 if parent < 0 else self.ancestry[parent]))

    def check_path(self, keep: Sequence[int]) -> None:
        """`keep` must be a path down the tree: keep[0] a child of -1, each next a child of the previous."""
        parent = -1
        for j, t in enumerate(keep):
            if not 0 <= t < len(self.parents) or self.parents[t] != parent:
                raise ValueError(f"keep[{j}]: expected a child of tree token {parent}, got {t}")
            parent = t

    def mask(self, start: int, window: int | None, device) -> torch.Tensor:
        """[n, base + len] bool for span tokens start..: True where the token may attend."""
        n, span = len(self.parents) - start, len(self.parents)
        bits = torch.tensor([self.ancestry[t] for t in range(start, span)], dtype=torch.int64)
        inside = (bits[:, None] >> torch.arange(span)[None, :]) & 1 == 1  # [n, span] ancestor-or-self
        mask = torch.cat([torch.ones(n, self.base, dtype=torch.bool), inside], dim=1)
        if window is not None:
            query = self.base + torch.tensor(self.depths[start:])[:, None]  # positions, not slots
            key = torch.cat([torch.arange(self.base), self.base + torch.tensor(self.depths)])[None, :]
            mask &= query - key < window
        return mask.to(device)


def extend_span(state: State, ids: Sequence[int], parents: Sequence[int] | None) -> tuple[int, list[int]]:
    """Bookkeeping of one forward's new tokens: opens or grows the state's tree when
    `parents` is given. Returns (the first new token's index in the span, or -1 for plain
    history tokens; the new tokens' positions)."""
    length = len(state.tokens)
    if parents is None:
        if state.tree is not None:
            raise ValueError("ids: a tree is open (accept_tree first), got history tokens")
        return -1, list(range(length, length + len(ids)))
    if len(parents) != len(ids):
        raise ValueError(f"parents: expected {len(ids)} entries (one per id), got {len(parents)}")
    if state.tree is None:
        state.tree = TreeSpan(base=length)
    start = len(state.tree.parents)
    state.tree.add(parents)
    return start, [state.tree.base + d for d in state.tree.depths[start:]]


@dataclass(frozen=True)
class BatchPositions:
    """Host tensors of one ragged forward's new tokens (plain rows or tree tokens)."""

    positions: torch.Tensor  # [N] int64: RoPE positions (a tree token's: base + its depth)
    seq_lens: torch.Tensor  # [N] int64: each token's row length (the longest path through its row)
    masks: list[torch.Tensor | None] | None  # per row [n_r, live_r] bool tree masks; None: causal


def batch_positions(
    states: Sequence[State], ids: Sequence[Sequence[int]], parents: Sequence[Sequence[int]] | None, window: int | None
) -> BatchPositions:
    """The bookkeeping every Llama store shares: opens or grows each row's tree (extend_span)
    and returns positions, dynamic-NTK row lengths and, for trees, the attention masks."""
    spans = [
        extend_span(state, row, None if parents is None else parents[r])
        for r, (state, row) in enumerate(zip(states, ids, strict=True))
    ]
    positions = torch.tensor([p for _, row in spans for p in row], dtype=torch.int64)
    seq_lens = torch.tensor([max(row) + 1 for _, row in spans for _ in row], dtype=torch.int64)
    masks = None
    if parents is not None:  # a chain's tree mask is the causal one: the stores build that themselves
        masks = [
            None if state.tree.chain else state.tree.mask(start, window, "cpu")
            for state, (start, _) in zip(states, spans, strict=True)
        ]
    return BatchPositions(positions, seq_lens, masks)


def live_rows(run, states: Sequence[State], ids: Sequence[Sequence[int]], parents, empty) -> list[torch.Tensor]:
    """`run(states, rows, parents)` over the rows that bring new ids (one forward), its logits
    split back per row; `empty` (a [0, V] tensor) for the others."""
    if len(ids) != len(states) or (parents is not None and len(parents) != len(states)):
        raise ValueError(f"ids/parents: expected {len(states)} rows each (one per state)")
    out = [empty for _ in states]
    live = [i for i, row in enumerate(ids) if len(row)]
    if live:
        rows = [list(ids[i]) for i in live]
        logits = run([states[i] for i in live], rows, None if parents is None else [parents[i] for i in live])
        for i, part in zip(live, logits.split([len(row) for row in rows]), strict=True):
            out[i] = part
    return out


def close_span(state: State, keep: Sequence[int]) -> tuple[list[int], list[int]]:
    """Keep the path `keep` of the open tree as history, drop the rest. Returns the
    (source, destination) slots whose KV moves (only those that change place)."""
    tree = state.tree
    if tree is None:
        raise ValueError("state: expected an open tree (extend_tree), got none")
    tree.check_path(keep)
    src = [tree.base + t for t in keep]
    dst = list(range(tree.base, tree.base + len(keep)))
    keep_features(state, [*range(tree.base), *src])
    state.tokens[tree.base :] = [state.tokens[s] for s in src]
    state.tree = None
    moves = [(s, d) for s, d in zip(src, dst, strict=True) if s != d]
    return [s for s, _ in moves], [d for _, d in moves]


def append_features(state: State, features: torch.Tensor) -> None:
    """A forward's hidden states of the state's new tokens [n, F], after those it holds."""
    if not state.keeps_features:
        return
    state.features = features if state.features is None else torch.cat([state.features, features])


def keep_features(state: State, kept: Sequence[int]) -> None:
    """The features of the consumed tokens that stay, where the state's tokens become
    tokens[kept] (ascending; its tail is what the features cover)."""
    if state.features is None:
        return
    start = len(state.tokens) - len(state.features)  # the first token a feature row covers
    rows = [i - start for i in kept if i >= start]
    state.features = state.features[torch.tensor(rows, dtype=torch.int64, device=state.features.device)]


def drop_features(state: State, length: int) -> None:
    """Truncating the state to `length` tokens drops the features of the tokens past it."""
    keep_features(state, range(length))


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def incremental(self):
        """A fresh incremental detokenizer: push(ids) -> new text, flush() -> the rest."""


class CausalLM(Protocol):
    name: str  # identity that enters the contract fingerprint
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    kv_layout: tuple[KvTensorSpec, ...]

    def prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, State]:
        """Consume a non-empty prompt; logits [V] float32 at its last position."""

    def extend(self, state: State, ids: Sequence[int]) -> torch.Tensor:
        """Consume `ids` after the state; logits [len(ids), V] float32, one row per new
        position (row i predicts the token after ids[i]). Mutates `state`."""

    def extend_batch(self, states: Sequence[State], ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """extend() for several requests (ragged lengths) in one call."""

    def empty_state(self) -> State:
        """A state that has consumed nothing: reserve, then extend (batched prefill)."""

    def extend_last(self, states: Sequence[State], ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """extend_batch for non-empty rows, keeping only each row's last logits: [R, V] float32
        (a prefill chunk needs no logits but its last: the head is the largest matmul)."""

    def truncate(self, state: State, length: int) -> None:
        """Keep the first `length` consumed tokens (drop rejected positions)."""

    # Candidate trees (multi-draft). A model that cannot mask attention by ancestry sets
    # supports_trees = False and the nodes then draft chains only. A model whose extend_tree
    # takes the tokens' values as a device tensor (`device_tokens=`) sets device_tokens = True
    # (engine/paged_lm.py): drafting then feeds it without reading each depth back.
    supports_trees: bool

    def extend_tree(
        self, states: Sequence[State], ids: Sequence[Sequence[int]], parents: Sequence[Sequence[int]]
    ) -> list[torch.Tensor]:
        """extend_batch where row r's new ids are tree tokens: parents[r][i] is the parent's
        index in the row's open tree (tokens of earlier extend_tree calls count; -1 = the
        last history token). Logits row i predicts the token after ids[i] given its path."""

    def accept_tree(self, state: State, keep: Sequence[int]) -> None:
        """Close the open tree: the path `keep` (tree indices, root child first) becomes
        history, every other tree token is dropped."""

    def export_state(self, state: State, out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The state as tensors matching `kv_layout` (SEQ = len(state.tokens)); with `out` (host
        tensors of those shapes: a shared-memory segment's), written into them and returned."""

    def import_state(self, tensors: Sequence[torch.Tensor], tokens: Sequence[int]) -> State:
        """Rebuild a State from export_state's tensors and the consumed tokens (`ChunkedImport`)."""

    def begin_import(self, tokens: Sequence[int], reserve: int) -> State:
        """A State that has consumed `tokens`, its KV storage reserved for `reserve` positions
        (at least the tokens) but not yet written; raises when the pool lacks it (nothing taken).
        Then import_chunk for every byte, then finish_import; release() undoes it at any point."""

    def import_chunk(self, state: State, index: int, offset: int, data: Buffer | torch.Tensor) -> None:
        """Bytes [offset, offset + len(data)) of KV tensor `index` (the export_state layout, C
        order), written into the state's storage; a tensor stands for its bytes."""

    def finish_import(self, state: State) -> None:
        """Every byte written: wait for the copies, then the state is usable (forwards read it)."""

    # KV memory. A model on a bounded pool (engine/paged_lm.py) reserves a request's KV at
    # admission and frees it when the request leaves; others grow on demand (`GrowingKv`).
    def capacity_tokens(self) -> int | None:
        """Most tokens the model's KV can ever hold for one request (None = unbounded)."""

    def can_reserve(self, tokens: int) -> bool:
        """Whether a reservation of `tokens` would succeed now."""

    def reserve(self, state: State, tokens: int) -> None:
        """Make room for `tokens` positions in `state` (raises when the pool lacks it)."""

    def release(self, state: State) -> None:
        """Give the state's KV memory back (the state is not used afterwards)."""


def check_kv_tensors(tensors: Sequence[torch.Tensor], layout: Sequence[KvTensorSpec], seq: int) -> None:
    """import_state's argument check: one tensor per spec, each of its dtype and shape at `seq`."""
    if len(tensors) != len(layout):
        raise ValueError(f"tensors: expected {len(layout)} KV tensors, got {len(tensors)}")
    for index, (tensor, spec) in enumerate(zip(tensors, layout, strict=True)):
        if tuple(tensor.shape) != spec.shape_for(seq) or tensor.dtype != spec.dtype:
            expected, got = f"{spec.dtype} {spec.shape_for(seq)}", f"{tensor.dtype} {tuple(tensor.shape)}"
            raise ValueError(f"tensors[{index}]: expected {expected}, got {got}")


def end_import(state: State) -> None:
    """Wait for the copies of an import still in progress (a GPU's are asynchronous): before its
    KV is read (finish_import) or its storage freed (release)."""
    if state.importing is not None:
        state.importing.wait()
        state.importing = None


def import_tensors(model: CausalLM, state: State, tensors: Sequence[torch.Tensor]) -> None:
    """Write export_state's tensors into a begun import, one chunk each, and finish it."""
    check_kv_tensors(tensors, model.kv_layout, len(state.tokens))
    for index, tensor in enumerate(tensors):
        model.import_chunk(state, index, 0, tensor)
    model.finish_import(state)


class ChunkedImport:
    """`import_chunk` through the state's KvWriter and `import_state` as the whole-tensor case
    of the chunked import, for a model that implements begin_import / finish_import / release."""

    def import_chunk(self, state: State, index: int, offset: int, data: Buffer | torch.Tensor) -> None:
        if state.importing is None:  # finished already, or a model whose state is its token ids
            raise ValueError(f"state: expected an import in progress (begin_import), got none (KV tensor {index})")
        state.importing.write(index, offset, data)

    def import_state(self, tensors: Sequence[torch.Tensor], tokens: Sequence[int]) -> State:
        state = self.begin_import(tokens, len(tokens))
        try:
            import_tensors(self, state, tensors)
        except BaseException:
            self.release(state)
            raise
        return state


class GrowingKv:
    """The reservation methods of a model whose state grows on demand (no pool to run out of),
    and `extend_last` by way of its `extend_batch`."""

    def extend_last(self, states: Sequence[State], ids: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.stack([rows[-1] for rows in self.extend_batch(states, ids)])

    def capacity_tokens(self) -> int | None:
        return None

    def can_reserve(self, tokens: int) -> bool:
        return True

    def reserve(self, state: State, tokens: int) -> None:
        pass

    def release(self, state: State) -> None:
        end_import(state)  # the memory goes with the state; no copy may still be writing it
