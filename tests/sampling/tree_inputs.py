"""Tree-verification inputs for the tests: random trees with poisoned padding, and chains."""

from __future__ import annotations

import torch

# The argument order of tree_rejection_sample.
NAMES = [
    "draft_token_ids",
    "parents",
    "num_nodes",
    "draft_probs",
    "target_probs",
    "target_token_ids",
    "accept_uniforms",
    "recover_uniforms",
    "do_sample",
]


def random_tree_inputs(
    batch: int,
    n_nodes: int,
    vocab: int,
    *,
    seed: int,
    dense: bool = True,
    device: str = "cpu",
    greedy_fraction: float = 0.3,
    ragged: bool = True,
    sharpness: float = 3.0,
):
    """Well-formed random trees, generated on `device` (large V stays fast on a GPU).

    Half the nodes hang under the previous node (deep paths), the rest under a uniform
    earlier node or the root (wide sibling lists). q = softmax(sharpness * randn); a node's
    draft law is a noisy copy of q at its parent, and its id is drawn from it (dense) or is
    its argmax (point mass); a third of the ids are the target's token at the parent instead,
    so greedy rows accept too. With `ragged`, row b has a random num_nodes[b] and every
    entry past it is poison that a sampler must ignore: NaN laws, NaN q rows, out-of-range
    ids, uniforms and target ids, and parents of -1 (they would look like root children).
    """
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=device)

    node = torch.arange(n_nodes, device=device)
    anywhere = (rand(batch, n_nodes) * (node + 1)).long() - 1  # uniform in [-1, n-1]
    parents = torch.where(rand(batch, n_nodes) < 0.5, node - 1, anywhere)  # [B, N]
    logits = sharpness * torch.randn(batch, n_nodes + 1, vocab, generator=gen, device=device)
    target_probs = torch.softmax(logits, -1)  # [B, N+1, V]
    at_parent = logits.gather(1, (parents + 1)[..., None].expand(-1, -1, vocab))  # [B, N, V]
    noise = torch.randn(batch, n_nodes, vocab, generator=gen, device=device)
    draft_probs = torch.softmax(at_parent + noise, -1)
    target_ids = _multinomial(target_probs, gen)  # [B, N+1]
    if dense:
        draft_ids = _multinomial(draft_probs, gen)
    else:
        draft_ids = draft_probs.argmax(-1) if n_nodes else torch.zeros(batch, 0, dtype=torch.int64, device=device)
    draft_ids = torch.where(rand(batch, n_nodes) < 1 / 3, target_ids.gather(1, parents + 1), draft_ids)
    accept_uniforms = rand(batch, n_nodes)
    recover_uniforms = rand(batch, n_nodes + 1)
    do_sample = rand(batch) >= greedy_fraction
    num_nodes = None
    if ragged:
        num_nodes = (rand(batch) * (n_nodes + 1)).long()  # [B] in [0, N]
        pad = node >= num_nodes[:, None]  # [B, N]
        beyond = torch.arange(n_nodes + 1, device=device) > num_nodes[:, None]  # [B, N+1] positions never read
        draft_ids = draft_ids.masked_fill(pad, -7)
        parents = parents.masked_fill(pad, -1)
        draft_probs = draft_probs.masked_fill(pad[..., None], float("nan"))
        accept_uniforms = accept_uniforms.masked_fill(pad, 2.0)
        target_probs = target_probs.masked_fill(beyond[..., None], float("nan"))
        target_ids = target_ids.masked_fill(beyond, vocab + 3)
        recover_uniforms = recover_uniforms.masked_fill(beyond, float("nan"))
    return (
        draft_ids,
        parents,
        num_nodes,
        draft_probs if dense else None,
        target_probs,
        target_ids,
        accept_uniforms,
        recover_uniforms,
        do_sample,
    )


def _multinomial(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """[B, L, V] -> [B, L] int64, one draw per row of probabilities."""
    batch, length, vocab = probs.shape
    if batch * length == 0:
        return torch.zeros(batch, length, dtype=torch.int64, device=probs.device)
    return torch.multinomial(probs.reshape(-1, vocab), 1, generator=gen).view(batch, length)


def chain_tree(draft_token_ids, draft_probs, target_probs, target_token_ids, uniform_samples, do_sample):
    """`rejection_sample` arguments -> the same chain as tree arguments (num_nodes None).

    Node i hangs under node i - 1; its test uses u[:, i], the recovery after node i - 1
    (position i) uses u[:, i + 1]; the last position never recovers, so its uniform is free.
    """
    batch, k = draft_token_ids.shape
    device = target_probs.device
    parents = (torch.arange(k, device=device) - 1).expand(batch, k)
    recover = torch.cat([uniform_samples[:, 1:], torch.zeros(batch, 1, device=device)], 1)
    return (
        draft_token_ids,
        parents,
        None,
        draft_probs,
        target_probs,
        target_token_ids,
        uniform_samples[:, :k],
        recover,
        do_sample,
    )
