"""Exact multi-draft (tree) verification: public API, backend selection and the torch reference.

A row's draft is a tree of N nodes: `parents[b, n] < n` (-1 = the root, the row's last
emitted token), so node indices are a topological order and the children of a node are
the nodes naming it, in increasing index. The siblings x_1..x_k under one node were drawn
WITHOUT replacement from the draft's distribution there; `draft_probs[b, n]` is the exact
law node n was drawn from (p with the earlier siblings removed and renormalised; a
one-hot row, or `draft_probs=None`, for a point-mass draft).

The walk (docs/design.md §2, "Tree verification") keeps an unnormalised float32 residual
W and its mass Z at the current context: a child x with law p is accepted iff
f32(f32(u * p[x]) * f32(Z)) < W[x]; a rejection sets W = max(0, W - f32(Z) * p) and
Z = float64 sum of W, so each sibling is tested against the normalised residual W / Z
(recursive rejection sampling). At the root W = q and Z = 1, which makes a chain tree
exactly `rejection_sample`. Position indices: q, target tokens and recovery uniforms of
the root are at 0, those after node n at n + 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sampling.batch import TreeInputs
from sampling.categorical import inverse_cdf_sample
from sampling.checks import check_tree_inputs
from sampling.rejection import Backend, resolve_backend

__all__ = ["MAX_TREE_NODES", "TreeResult", "tree_rejection_sample", "tree_rejection_sample_torch"]

# The most nodes a tree may have, for every layer that sizes one (proposers, the wire validator,
# CUDA graphs). The kernel walks a row's nodes one after another, so N bounds a row's serial
# latency; 64 covers the multi-draft trees.
MAX_TREE_NODES = 64


@dataclass(frozen=True)
class TreeResult:
    output_token_ids: torch.Tensor  # [B, N+1] int32: emitted tokens in order, -1 after the last
    accepted_token_num: torch.Tensor  # [B] int32: emitted tokens per row (1..depth+1)
    accepted_nodes: torch.Tensor  # [B, N] int32: node index of each ACCEPTED draft token in order, -1 after


def tree_rejection_sample(
    draft_token_ids: torch.Tensor,
    parents: torch.Tensor,
    num_nodes: torch.Tensor | None,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    target_token_ids: torch.Tensor,
    accept_uniforms: torch.Tensor,
    recover_uniforms: torch.Tensor,
    do_sample: torch.Tensor,
    backend: Backend = "auto",
    *,
    check_values: bool = True,
) -> TreeResult:
    """Exact speculative verification of a draft tree per row.

    draft_token_ids [B, N] int32|int64 target-vocab ids of the nodes; parents [B, N]
    int32|int64, parents[b, n] in [-1, n-1] (-1 = the root); num_nodes [B] int32|int64 in
    [0, N] or None (= N): row b's nodes are 0..num_nodes[b]-1, later entries of every
    argument are ignored; draft_probs [B, N, V] float32, the law each node was drawn from,
    or None (point mass at every node); target_probs [B, N+1, V] float32, q at the root (0)
    and after node n (n+1); target_token_ids [B, N+1] int32|int64 drawn from q (the argmax
    on greedy rows); accept_uniforms [B, N] and recover_uniforms [B, N+1] float32 in
    [0, 1); do_sample [B] bool. N <= MAX_TREE_NODES.

    Greedy rows follow the first child equal to the target's token and stop at the first
    context without one. Raises ValueError for bad inputs before any launch;
    `check_values=False` skips the checks that need a device sync (id, parent, count and
    uniform ranges): bad values then give wrong tokens, never an out-of-bounds access.
    """
    device = target_probs.device if isinstance(target_probs, torch.Tensor) else torch.device("cpu")
    resolved = resolve_backend(backend, device)
    inputs = TreeInputs(
        draft_token_ids,
        parents,
        num_nodes,
        draft_probs,
        target_probs,
        target_token_ids,
        accept_uniforms,
        recover_uniforms,
        do_sample,
    )
    dims = check_tree_inputs(inputs, max_nodes=MAX_TREE_NODES, check_values=check_values)
    if dims.batch == 0:
        return TreeResult(
            torch.empty(0, dims.num_nodes + 1, dtype=torch.int32, device=device),
            torch.empty(0, dtype=torch.int32, device=device),
            torch.empty(0, dims.num_nodes, dtype=torch.int32, device=device),
        )
    if resolved == "torch":
        return tree_rejection_sample_torch(inputs)
    from sampling.cupy_tree import tree_rejection_sample_cupy

    return TreeResult(*tree_rejection_sample_cupy(inputs))


def tree_rejection_sample_torch(inputs: TreeInputs) -> TreeResult:
    """The vectorised reference, the oracle of the kernel (inputs validated by the caller).

    One pass over the node index, vectorised over rows: children of a context all come
    after it, so by the time a row reaches node n it has settled every earlier node, and
    node n is tested iff its parent is the row's current context. Ids are clamped before
    they address memory, as the kernel does, so both agree even on unchecked bad ids.
    """
    draft_token_ids, parents, num_nodes, draft_probs = (
        inputs.draft_token_ids,
        inputs.parents,
        inputs.num_nodes,
        inputs.draft_probs,
    )
    target_probs, do_sample, accept_uniforms = inputs.target_probs, inputs.do_sample, inputs.accept_uniforms
    batch, n_nodes = draft_token_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    rows = torch.arange(batch, device=device)
    ids = draft_token_ids.long()
    safe_ids = ids.clamp(0, vocab - 1)
    targets = inputs.target_token_ids.long()
    count = torch.full((batch,), n_nodes, device=device) if num_nodes is None else num_nodes.long().clamp(0, n_nodes)

    context = torch.full((batch,), -1, dtype=torch.int64, device=device)  # the current node, -1 = root
    residual = target_probs[:, 0].clone()  # [B, V] W, float32
    mass = torch.ones(batch, dtype=torch.float32, device=device)  # f32(Z); a fresh q row has Z = 1 exactly
    rejected = torch.zeros(batch, dtype=torch.bool, device=device)  # some child of the context was rejected
    accepted = torch.zeros(batch, dtype=torch.int64, device=device)  # accepted drafts so far
    accepted_nodes = torch.full((batch, n_nodes), -1, dtype=torch.int32, device=device)

    for n in range(n_nodes):
        tested = (parents[:, n].long() == context) & (n < count)  # [B]
        x = safe_ids[:, n]
        w_x = residual[rows, x]
        p_x = torch.ones_like(w_x) if draft_probs is None else draft_probs[rows, n, x]
        passes = torch.where(
            do_sample, (accept_uniforms[:, n] * p_x) * mass < w_x, ids[:, n] == targets[rows, context + 1]
        )
        accept = tested & passes
        hit = torch.nonzero(accept).squeeze(1)  # [A]
        accepted_nodes[hit, accepted[hit]] = n  # at most n drafts precede node n: the slot exists
        accepted += accept
        context = torch.where(accept, n, context)
        mass = torch.where(accept, 1.0, mass)
        rejected &= ~accept
        fresh = torch.nonzero(accept & do_sample).squeeze(1)  # [A] rows moving into node n
        residual[fresh] = target_probs[fresh, n + 1]
        drop = torch.nonzero(tested & do_sample & ~passes).squeeze(1)  # [R] rows rejecting node n
        if drop.numel() > 0:
            mass[drop] = _reject(residual, mass, drop, safe_ids[drop, n], draft_probs, n)
            rejected[drop] = True

    final = targets[rows, context + 1]  # the bonus, or the greedy / no-mass recovery
    recover = torch.nonzero(do_sample & rejected).squeeze(1)  # [R] rows whose context's children all failed
    if recover.numel() > 0:
        index, has_mass = inverse_cdf_sample(residual[recover], inputs.recover_uniforms[recover, context[recover] + 1])
        final[recover] = torch.where(has_mass, index, final[recover])

    drafts = torch.where(accepted_nodes >= 0, ids.gather(1, accepted_nodes.long().clamp(min=0)), -1)  # [B, N]
    output = torch.cat([drafts, torch.full((batch, 1), -1, device=device)], 1).int()
    output[rows, accepted] = final.int()
    return TreeResult(output, (accepted + 1).int(), accepted_nodes)


def _reject(
    residual: torch.Tensor,  # [B, V] float32 W, updated in place
    mass: torch.Tensor,  # [B] float32 f32(Z)
    rows: torch.Tensor,  # [R] the rows rejecting `node`
    token: torch.Tensor,  # [R] int64 their (clamped) draft ids
    draft_probs: torch.Tensor | None,
    node: int,
) -> torch.Tensor:
    """W <- max(0, f32(W - f32(f32(Z) * p))) on `rows`, each product and difference rounded
    apart; returns their next f32(Z) [R]."""
    if draft_probs is None:  # p one-hot at the token: only W[token] changes (Z * 0 = 0 elsewhere)
        residual[rows, token] = torch.clamp_min(residual[rows, token] - mass[rows], 0.0)
        return _residual_mass(residual[rows])
    reduced = torch.clamp_min(residual[rows] - mass[rows, None] * draft_probs[rows, node], 0.0)  # [R, V]
    residual[rows] = reduced
    return _residual_mass(reduced)


def _residual_mass(residual: torch.Tensor) -> torch.Tensor:
    """[R, V] float32 -> [R] float32: f32 of the float64 sum, the Z of the next sibling test."""
    return residual.sum(-1, dtype=torch.float64).float()
