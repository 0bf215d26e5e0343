"""The simplest correct rejection samplers: Python loops over rows and positions.

They are the baseline the vectorized reference is measured against on the CPU (bench/sampling_cpu.py),
and a second, independent reading of docs/design.md §2 (chain and tree) that the tests compare with.
Not used when serving; kept in the package so that tests and bench share one copy.
"""

from __future__ import annotations

import torch

from sampling.categorical import inverse_cdf_sample


def rejection_sample_loop(draft_token_ids, draft_probs, target_probs, target_token_ids, uniform_samples, do_sample):
    batch, k = draft_token_ids.shape
    out = torch.full((batch, k + 1), -1, dtype=torch.int32)
    emitted = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        for i in range(k + 1):
            if i == k:
                out[b, i] = target_token_ids[b, k]
                emitted[b] = k + 1
                break
            d = int(draft_token_ids[b, i])
            if bool(do_sample[b]):
                p = 1.0 if draft_probs is None else draft_probs[b, i, d]
                accepted = bool(uniform_samples[b, i] * p < target_probs[b, i, d])
            else:
                accepted = int(target_token_ids[b, i]) == d
            if accepted:
                out[b, i] = d
                continue
            out[b, i] = _recover(b, i, d, draft_probs, target_probs, target_token_ids, uniform_samples, do_sample)
            emitted[b] = i + 1
            break
    return out, emitted


def _recover(b, i, d, draft_probs, target_probs, target_token_ids, uniform_samples, do_sample):
    if not bool(do_sample[b]):
        return int(target_token_ids[b, i])
    q = target_probs[b, i]
    if draft_probs is None:
        residual = q.clone()
        residual[d] = 0
    else:
        residual = torch.relu(q - draft_probs[b, i])
    cdf = residual.double().cumsum(0)
    total = float(cdf[-1])
    if total == 0:
        return int(target_token_ids[b, i])
    threshold = float(uniform_samples[b, i + 1]) * total
    hits = torch.nonzero((residual > 0) & (cdf > threshold))
    if len(hits):
        return int(hits[0])
    return int(torch.nonzero(residual > 0)[-1])


def tree_rejection_sample_loop(
    draft_token_ids,
    parents,
    num_nodes,
    draft_probs,
    target_probs,
    target_token_ids,
    accept_uniforms,
    recover_uniforms,
    do_sample,
):
    """The tree law of sampling/tree.py read literally: one row, one context, one child at a time.

    Returns (output_token_ids, accepted_token_num, accepted_nodes) like TreeResult.
    """
    batch, n_nodes = draft_token_ids.shape
    out = torch.full((batch, n_nodes + 1), -1, dtype=torch.int32)
    emitted = torch.zeros(batch, dtype=torch.int32)
    accepted_nodes = torch.full((batch, n_nodes), -1, dtype=torch.int32)
    for b in range(batch):
        count = n_nodes if num_nodes is None else int(num_nodes[b])
        tokens, path = [], []
        context = -1
        while True:
            children = [n for n in range(count) if int(parents[b, n]) == context]
            target = int(target_token_ids[b, context + 1])
            if bool(do_sample[b]):
                child = _tree_child(b, context, children, draft_token_ids, draft_probs, target_probs, accept_uniforms)
                if isinstance(child, torch.Tensor):  # every child rejected: the residual W
                    index, has_mass = inverse_cdf_sample(child[None], recover_uniforms[b, context + 1][None])
                    tokens.append(int(index) if bool(has_mass) else target)
                    break
            else:
                child = next((n for n in children if int(draft_token_ids[b, n]) == target), None)
            if child is None:  # no children, or a greedy mismatch: the target's token
                tokens.append(target)
                break
            tokens.append(int(draft_token_ids[b, child]))
            path.append(child)
            context = child
        out[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        accepted_nodes[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        emitted[b] = len(tokens)
    return out, emitted, accepted_nodes


def _tree_child(b, context, children, draft_token_ids, draft_probs, target_probs, accept_uniforms):
    """The accepted child of `context`, None if it has none, or the residual W if all were rejected."""
    vocab = target_probs.shape[-1]
    w = target_probs[b, context + 1].clone()  # float32
    z = torch.tensor(1.0)  # f32(Z): a fresh q row is normalised
    for n in children:
        x = int(draft_token_ids[b, n])
        if draft_probs is None:
            p = torch.zeros(vocab)
            p[x] = 1.0
        else:
            p = draft_probs[b, n]
        if (accept_uniforms[b, n] * p[x]) * z < w[x]:  # float32 products, each rounded
            return n
        w = torch.clamp_min(w - z * p, 0.0)
        z = w.double().sum().float()
    return w if children else None
