"""Validation of `rejection_sample` inputs, done before any kernel launch.

Structural checks (type, rank, dtype, shape, device) never touch tensor values and
always run. Value checks (ids in [0, V), uniforms in [0, 1)) need one device sync and
can be skipped by callers that validated at their boundary; the kernel still clamps
ids, so skipping them can give wrong tokens for bad ids but never an out-of-bounds access.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sampling.batch import ChainInputs, TreeInputs

_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Dims:
    batch: int
    num_draft: int  # K
    vocab: int


def check_rejection_inputs(inputs: ChainInputs, *, check_values: bool = True) -> Dims:
    """Raise ValueError naming the argument, expected and actual value; return B, K, V."""
    dims = _well_formed_dims(inputs)
    if dims is None:  # something is off: the detailed checks below name it
        dims = _structural_checks(inputs)
    if check_values and dims.batch > 0:
        _check_values(inputs, dims.vocab)
    return dims


def _well_formed_dims(inputs: ChainInputs) -> Dims | None:
    """Fast path (a few µs, it runs on every decode step): Dims if all is well, else None."""
    draft_token_ids, draft_probs, target_probs = inputs.draft_token_ids, inputs.draft_probs, inputs.target_probs
    target_token_ids, uniform_samples, do_sample = inputs.target_token_ids, inputs.uniform_samples, inputs.do_sample
    try:
        batch, k_plus_1, vocab = target_probs.shape
        device = target_probs.device
        k = k_plus_1 - 1
        ok = (
            target_probs.dtype == torch.float32
            and k >= 0
            and vocab >= 1
            and draft_token_ids.dtype in _INT_DTYPES
            and draft_token_ids.shape == (batch, k)
            and target_token_ids.dtype in _INT_DTYPES
            and target_token_ids.shape == (batch, k_plus_1)
            and uniform_samples.dtype == torch.float32
            and uniform_samples.shape == (batch, k_plus_1)
            and do_sample.dtype == torch.bool
            and do_sample.shape == (batch,)
            and draft_token_ids.device == device
            and target_token_ids.device == device
            and uniform_samples.device == device
            and do_sample.device == device
            and (
                draft_probs is None
                or (
                    draft_probs.dtype == torch.float32
                    and draft_probs.shape == (batch, k, vocab)
                    and draft_probs.device == device
                )
            )
        )
    except (AttributeError, TypeError, ValueError):
        return None
    return Dims(batch, k, vocab) if ok else None


def _target_dims(target_probs: torch.Tensor, drafts: str) -> tuple[int, int, int]:
    """B, K (or N: `drafts` names it in the messages) and V of `target_probs` [B, K+1, V] float32."""
    _check_tensor("target_probs", target_probs, rank=3, dtypes=(torch.float32,))
    batch, rows, vocab = target_probs.shape
    if rows < 1:
        raise ValueError(
            f"target_probs: expected shape [B, {drafts}+1, V] with {drafts}+1 >= 1, got {tuple(target_probs.shape)}"
        )
    if vocab < 1:
        raise ValueError(f"target_probs: expected vocab size V >= 1, got shape {tuple(target_probs.shape)}")
    return batch, rows - 1, vocab


def _structural_checks(inputs: ChainInputs) -> Dims:
    batch, k, vocab = _target_dims(inputs.target_probs, "K")
    device = inputs.target_probs.device
    _check_tensor(
        "draft_token_ids", inputs.draft_token_ids, rank=2, dtypes=_INT_DTYPES, shape=(batch, k), device=device
    )
    if inputs.draft_probs is not None:
        _check_tensor(
            "draft_probs", inputs.draft_probs, rank=3, dtypes=(torch.float32,), shape=(batch, k, vocab), device=device
        )
    _check_tensor(
        "target_token_ids", inputs.target_token_ids, rank=2, dtypes=_INT_DTYPES, shape=(batch, k + 1), device=device
    )
    _check_tensor(
        "uniform_samples", inputs.uniform_samples, rank=2, dtypes=(torch.float32,), shape=(batch, k + 1), device=device
    )
    _check_tensor("do_sample", inputs.do_sample, rank=1, dtypes=(torch.bool,), shape=(batch,), device=device)
    return Dims(batch, k, vocab)


def _check_tensor(
    name: str,
    tensor: object,
    *,
    rank: int,
    dtypes: tuple[torch.dtype, ...],
    shape: tuple[int, ...] | None = None,
    device: torch.device | None = None,
) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != rank:
        raise ValueError(f"{name}: expected rank {rank}, got rank {tensor.dim()} (shape {tuple(tensor.shape)})")
    if tensor.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: expected dtype {expected}, got {tensor.dtype}")
    if shape is not None and tuple(tensor.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(tensor.shape)}")
    if device is not None and tensor.device != device:
        raise ValueError(f"{name}: expected device {device} (that of target_probs), got {tensor.device}")


def _check_values(inputs: ChainInputs, vocab: int) -> None:
    draft_token_ids, target_token_ids, uniform_samples = (
        inputs.draft_token_ids,
        inputs.target_token_ids,
        inputs.uniform_samples,
    )
    bad = torch.stack(
        [
            ((draft_token_ids < 0) | (draft_token_ids >= vocab)).any(),
            ((target_token_ids < 0) | (target_token_ids >= vocab)).any(),
            ~((uniform_samples >= 0) & (uniform_samples < 1)).all(),
        ]
    ).tolist()  # one device sync for all three
    for is_bad, name, tensor, bounds in (
        (bad[0], "draft_token_ids", draft_token_ids, f"[0, {vocab})"),
        (bad[1], "target_token_ids", target_token_ids, f"[0, {vocab})"),
    ):
        if is_bad:
            outside = tensor[(tensor < 0) | (tensor >= vocab)]
            raise ValueError(f"{name}: expected ids in {bounds}, got {int(outside[0])}")
    if bad[2]:
        outside = uniform_samples[~((uniform_samples >= 0) & (uniform_samples < 1))]
        raise ValueError(f"uniform_samples: expected values in [0, 1), got {float(outside[0])}")


@dataclass(frozen=True)
class TreeDims:
    batch: int
    num_nodes: int  # N, nodes per row at most
    vocab: int


def check_tree_inputs(inputs: TreeInputs, *, max_nodes: int, check_values: bool = True) -> TreeDims:
    """Raise ValueError naming the argument, expected and actual value; return B, N, V.

    Entries of node n >= num_nodes[b] (and positions n + 1 > num_nodes[b]) are ignored
    by the samplers, so the value checks skip them too. `max_nodes` is
    sampling.tree.MAX_TREE_NODES, passed in because tree.py imports this module.
    """
    draft_token_ids, parents, num_nodes, draft_probs = (
        inputs.draft_token_ids,
        inputs.parents,
        inputs.num_nodes,
        inputs.draft_probs,
    )
    target_probs, target_token_ids, do_sample = inputs.target_probs, inputs.target_token_ids, inputs.do_sample
    accept_uniforms, recover_uniforms = inputs.accept_uniforms, inputs.recover_uniforms
    batch, n, vocab = _target_dims(target_probs, "N")
    if n > max_nodes:
        raise ValueError(f"target_probs: expected N <= MAX_TREE_NODES = {max_nodes} tree nodes, got N = {n}")
    device = target_probs.device
    _check_tensor("draft_token_ids", draft_token_ids, rank=2, dtypes=_INT_DTYPES, shape=(batch, n), device=device)
    _check_tensor("parents", parents, rank=2, dtypes=_INT_DTYPES, shape=(batch, n), device=device)
    if num_nodes is not None:
        _check_tensor("num_nodes", num_nodes, rank=1, dtypes=_INT_DTYPES, shape=(batch,), device=device)
    if draft_probs is not None:
        _check_tensor(
            "draft_probs", draft_probs, rank=3, dtypes=(torch.float32,), shape=(batch, n, vocab), device=device
        )
    _check_tensor("target_token_ids", target_token_ids, rank=2, dtypes=_INT_DTYPES, shape=(batch, n + 1), device=device)
    _check_tensor("accept_uniforms", accept_uniforms, rank=2, dtypes=(torch.float32,), shape=(batch, n), device=device)
    _check_tensor(
        "recover_uniforms", recover_uniforms, rank=2, dtypes=(torch.float32,), shape=(batch, n + 1), device=device
    )
    _check_tensor("do_sample", do_sample, rank=1, dtypes=(torch.bool,), shape=(batch,), device=device)
    if check_values and batch > 0:
        _check_tree_values(inputs, vocab)
    return TreeDims(batch, n, vocab)


def _check_tree_values(inputs: TreeInputs, vocab: int) -> None:
    draft_token_ids, parents, num_nodes, target_token_ids = (
        inputs.draft_token_ids,
        inputs.parents,
        inputs.num_nodes,
        inputs.target_token_ids,
    )
    accept_uniforms, recover_uniforms = inputs.accept_uniforms, inputs.recover_uniforms
    batch, n = draft_token_ids.shape
    device = draft_token_ids.device
    node = torch.arange(n, device=device)
    count = torch.full((batch,), n, device=device) if num_nodes is None else num_nodes.long().clamp(0, n)
    live = node < count[:, None]  # [B, N] the row's real nodes
    read = torch.arange(n + 1, device=device) <= count[:, None]  # [B, N+1] positions a walk can reach
    checks = [  # (name, tensor, bad entries, what was expected)
        (
            "draft_token_ids",
            draft_token_ids,
            live & ((draft_token_ids < 0) | (draft_token_ids >= vocab)),
            f"ids in [0, {vocab}) at nodes n < num_nodes[b]",
        ),
        (
            "parents",
            parents,
            live & ((parents < -1) | (parents >= node)),
            "values in [-1, n-1] at nodes n < num_nodes[b]",
        ),
        (
            "target_token_ids",
            target_token_ids,
            read & ((target_token_ids < 0) | (target_token_ids >= vocab)),
            f"ids in [0, {vocab}) at positions <= num_nodes[b]",
        ),
        (
            "accept_uniforms",
            accept_uniforms,
            live & ~((accept_uniforms >= 0) & (accept_uniforms < 1)),
            "values in [0, 1) at nodes n < num_nodes[b]",
        ),
        (
            "recover_uniforms",
            recover_uniforms,
            read & ~((recover_uniforms >= 0) & (recover_uniforms < 1)),
            "values in [0, 1) at positions <= num_nodes[b]",
        ),
    ]
    if num_nodes is not None:
        checks.insert(0, ("num_nodes", num_nodes, (num_nodes < 0) | (num_nodes > n), f"values in [0, {n}]"))
    bad = torch.stack([mask.any() for _, _, mask, _ in checks]).tolist()  # one device sync for all
    for is_bad, (name, tensor, mask, expected) in zip(bad, checks, strict=True):
        if is_bad:
            index = [int(i) for i in mask.nonzero()[0]]
            raise ValueError(f"{name}: expected {expected}, got {name}{index} = {tensor[tuple(index)].item()}")
