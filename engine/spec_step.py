"""The speculative step for a batch of sequences: propose, verify, accept, fix up the KV.

1. `propose`: each sequence's proposal in TARGET space: the one that came with it on its first
   step (the prefill node's), else the proposer's of the depth the scheduler chose.
2. `SpecMetadata.build`: the batch's proposals in the verifier's layout, once (vLLM's
   SpecDecodeMetadata): padded ids, tree parents, node counts, the laws (a point mass written
   densely only where another row of the batch is dense) and the coupling positions.
3. `verify`: ONE target forward over [last token, nodes...] of every row (tree attention), ONE
   rejection-sampling launch (the chain kernel for chains of one depth and one law, else the
   tree kernel), and the step's one device -> host read.
4. Accept: each row's accepted path becomes history in both models (`accept_tree`), every
   other node's KV is dropped.
The scheduler then appends the emitted tokens to the sequences (`Sequence.append`).

Terms: a row EMITS its accepted drafts plus one token (the correction at the first rejection,
or the bonus after the last draft); `path` lists the accepted nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.nn.utils.rnn import pad_sequence

from common.transfer import to_device
from engine.proposer import Plan, Proposer
from engine.sequence import Sequence
from models.base import CausalLM
from sampling import NO_PROPOSAL, Proposal, Verifier, point_mass
from sampling.logprobs import TokenLogprob, token_logprobs


def propose(
    proposer: Proposer,
    seqs: list[Sequence],
    plans: list[Plan | None],
    depths: list[int],
    device: torch.device | str,
    hold: bool = False,
) -> list[Proposal]:
    """Row r's proposal: what it received, on its first step (its law moved to `device`; dropped
    when `hold`: the step runs at K = 0); else the proposer's of depth depths[r] from plans[r]
    (depth 0: none)."""
    out = [NO_PROPOSAL] * len(seqs)
    own = []
    for r, seq in enumerate(seqs):
        if seq.received is not None:
            if not hold:
                probs = seq.received.probs
                out[r] = replace(seq.received, probs=None if probs is None else to_device(probs, device))
            seq.received = None
        elif depths[r]:
            own.append(r)
    drafted = proposer.propose([seqs[r] for r in own], [plans[r] for r in own], [depths[r] for r in own])
    for r, proposal in zip(own, drafted, strict=True):
        out[r] = proposal
    return out


@dataclass(frozen=True)
class SpecMetadata:
    """A step's proposals in the verifier's layout."""

    draft_token_ids: torch.Tensor  # [B, N] int64 target ids, 0 past a row's nodes
    parents: torch.Tensor | None  # [B, N] int64 (-1: the last emitted token, and past a row); None: chains
    num_nodes: list[int]  # [B]
    draft_probs: torch.Tensor | None  # [B, N, Vt] float32 on the sampler's device; None: all point masses
    positions: list[int | None]  # [B] a coupled row's first target position (point-mass rows)

    @property
    def chain(self) -> bool:
        """Chains of one depth and one law: the chain kernel verifies them."""
        return self.parents is None

    @classmethod
    def build(
        cls, seqs: list[Sequence], proposals: list[Proposal], vocab_size: int, device: torch.device
    ) -> SpecMetadata:
        sizes = [len(p.token_ids) for p in proposals]
        n = max(sizes)
        dense = [p.probs is not None for p in proposals]
        # Point-mass proposals (and none) verify by coupling: each token is the one a K = 0 step
        # would draw at its position, so a seeded row's tokens do not depend on K.
        positions = [None if d else len(s.history) for s, d in zip(seqs, dense, strict=True)]
        ids = torch.tensor([[*p.token_ids, *[0] * (n - len(p.token_ids))] for p in proposals], dtype=torch.int64)
        ids = ids.view(len(proposals), n)  # [B, N] also when every row is empty
        if all(p.is_chain for p in proposals) and len(set(sizes)) == 1 and len(set(dense)) == 1:
            probs = torch.stack([p.probs for p in proposals]).to(device) if dense[0] else None
            return cls(ids, None, sizes, probs, positions)
        parents = torch.tensor([[*p.parents, *[-1] * (n - len(p.parents))] for p in proposals], dtype=torch.int64)
        probs = None
        if any(dense):  # one launch for both laws: a point mass as one-hot rows
            probs = point_mass(ids.to(device), vocab_size)  # [B, N, Vt]
            for b, p in enumerate(proposals):
                if p.probs is not None and p.token_ids:
                    probs[b, : len(p.token_ids)] = p.probs
        return cls(ids, parents.view(len(proposals), n), sizes, probs, positions)


@dataclass(frozen=True)
class Verified:
    """One row's outcome."""

    emitted: list[int]  # accepted drafts, then the correction or bonus token
    path: list[int]  # the accepted nodes, root child first
    do_sample: bool  # the row's effective mode
    logprobs: list[TokenLogprob]  # one per emitted token when the sequence asks for them


def verify(
    target: CausalLM,
    draft: CausalLM,
    verifier: Verifier,
    seqs: list[Sequence],
    proposals: list[Proposal],
    launched: Callable[[], None] = lambda: None,
) -> list[Verified]:
    """Score every row's [last token, nodes...] in one target forward, verify in one launch,
    and keep each row's accepted path in both models' KV. `launched` runs once the device has
    the step queued, before the host waits for it."""
    feeds = [[s.history[-1], *p.token_ids] for s, p in zip(seqs, proposals, strict=True)]
    tree = [[-1, *(q + 1 for q in p.parents)] for p in proposals]  # the last token is tree token 0
    logits = target.extend_tree([s.target_state for s in seqs], feeds, tree)  # B x [N_b+1, Vt]
    device = verifier.device
    meta = SpecMetadata.build(seqs, proposals, target.vocab_size, device)
    params, rngs = [s.params for s in seqs], [s.rng for s in seqs]
    if meta.chain:
        result = verifier.verify(
            meta.draft_token_ids, meta.draft_probs, torch.stack(logits).to(device), params, rngs, meta.positions
        )
    else:
        result = verifier.verify_tree(
            meta.draft_token_ids,
            meta.parents,
            meta.num_nodes,
            meta.draft_probs,
            pad_sequence(logits, batch_first=True).to(device, torch.float32),  # [B, N+1, Vt], 0 past a row
            params,
            rngs,
            meta.positions,
        )
    launched()
    emitted, paths = result.host()
    if paths is None:  # chains: the accepted nodes are the first ones
        paths = [list(range(len(e) - 1)) for e in emitted]
    out = []
    for seq, row_logits, tokens, path in zip(seqs, logits, emitted, paths, strict=True):
        target.accept_tree(seq.target_state, [0, *(n + 1 for n in path)])
        state = seq.draft_state
        if state is not None and state.tree is not None:  # the inner nodes it consumed drafting
            draft.accept_tree(state, [n for n in path if n < len(state.tree.parents)])
        logprobs = []
        if seq.logprobs:
            contexts = row_logits[[0, *(n + 1 for n in path)]]  # the contexts of the emitted tokens
            logprobs = token_logprobs(contexts.to(device), torch.tensor(tokens), seq.logprobs)
        out.append(Verified(tokens, path, not seq.params.is_greedy, logprobs))
    return out
