"""The speculative step for a batch of sequences: propose, verify, accept, fix up the KV.

1. `propose`: each sequence's proposal in TARGET space: the one that came with it on its first
   step (the prefill node's), else the proposer's of the depth the scheduler chose.
2. `verify`: ONE target forward over [last token, nodes...] of every row (tree attention); the
   batch's proposals in the verifier's layout, once (`sampling.VerifyBatch.build`, vLLM's
   SpecDecodeMetadata: padded ids, tree parents, node counts, the laws and the coupling
   positions); ONE rejection-sampling launch (`Verifier.verify`: the chain kernel for chains of
   one depth and one law, else the tree kernel), and the step's one device -> host read.
3. Accept: each row's accepted path becomes history in both models (`accept_tree`), every
   other node's KV is dropped.
The scheduler then appends the emitted tokens to the sequences (`Sequence.append`).

`queue_plain` is the K = 0 step of async scheduling: queued on the device before the step
before it is read, its input tokens that step's sampled tokens, still on the device; its
positions and KV slots are known without them (every row gains exactly one token), so the host
builds step n+1 while the device runs step n.

Terms: a row EMITS its accepted drafts plus one token (the correction at the first rejection,
or the bonus after the last draft); `path` lists the accepted nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from common.transfer import HostCopy, to_device, to_host_async
from engine.grammar import guide, jump_forward
from engine.proposer import Plan, Proposer
from engine.sequence import Sequence
from models.base import CausalLM
from sampling import NO_PROPOSAL, Proposal, Verifier, VerifyBatch
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
    (depth 0: none). A constrained row that may speculate proposes the tokens its grammar forces
    instead, when it forces any (jump-forward, engine/grammar.py), and its point-mass chains are
    cut where the grammar forbids."""
    out = [NO_PROPOSAL] * len(seqs)
    own = []
    for r, seq in enumerate(seqs):
        if seq.received is not None:
            if not hold:
                probs = seq.received.probs
                out[r] = replace(seq.received, probs=None if probs is None else to_device(probs, device))
            seq.received = None
        elif seq.k and not hold and (forced := jump_forward(seq.grammar, seq.k)) is not None:
            out[r] = forced
        elif depths[r]:
            own.append(r)
    drafted = proposer.propose([seqs[r] for r in own], [plans[r] for r in own], [depths[r] for r in own])
    for r, proposal in zip(own, drafted, strict=True):
        out[r] = guide(seqs[r].grammar, proposal)
    return out


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
    masks = [
        None if s.grammar is None else s.grammar.masks(p.token_ids, p.parents)
        for s, p in zip(seqs, proposals, strict=True)
    ]
    batch = VerifyBatch.build(proposals, [len(s.history) for s in seqs], target.vocab_size, device, masks)
    result = verifier.verify(batch, logits, [s.params for s in seqs], [s.rng for s in seqs])
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


UNREAD = -1  # a target state's token whose value is still on the device (async scheduling)


@dataclass(frozen=True)
class Queued:
    """A K = 0 step queued on the device, not yet read."""

    tokens: torch.Tensor  # [B] int64 on the device: each row's sampled token, the next step's input
    copy: HostCopy  # the same tokens on their way to the host
    slots: list[int]  # where each row's fed token sits in its target state's tokens (UNREAD until read)


def queue_plain(
    target: CausalLM,
    verifier: Verifier,
    seqs: list[Sequence],
    carried: list[int | None],
    earlier: torch.Tensor | None,
    device: torch.device | str,
) -> Queued:
    """Queue one K = 0 step of every row, nothing read back. Row r feeds the token the step in
    flight sampled for it at carried[r] of `earlier` ([B'] int64 on the device), or, new to the
    batch (None), its last history token."""
    fresh = [r for r, at in enumerate(carried) if at is None]
    width = 0 if earlier is None else len(earlier)
    where = {r: width + i for i, r in enumerate(fresh)}  # row -> its token in cat(earlier, the fresh rows' tokens)
    index = [where[r] if at is None else at for r, at in enumerate(carried)]
    packed = torch.tensor([*index, *(seqs[r].history[-1] for r in fresh)], dtype=torch.int64)  # one copy for both
    packed = to_device(packed, device)
    earlier = packed[:0] if earlier is None else earlier
    tokens = torch.cat([earlier, packed[len(seqs) :]])[packed[: len(seqs)]]  # [B] int64
    states = [s.target_state for s in seqs]
    logits = target.extend_batch(states, [[UNREAD]] * len(seqs), device_tokens=tokens)  # no tree
    slots = [len(state.tokens) - 1 for state in states]
    positions = [len(s.history) + (at is not None) for s, at in zip(seqs, carried, strict=True)]  # carried: unread
    no_drafts = VerifyBatch(torch.empty(len(seqs), 0, dtype=torch.int64), positions=positions)
    result = verifier.verify(
        no_drafts, torch.stack(logits).to(verifier.device), [s.params for s in seqs], [s.rng for s in seqs]
    )
    sampled = result.output_token_ids[:, 0].to(torch.int64)  # [B]: K = 0 emits one token per row
    # its own stream: not behind a KV export's copies (a prefill node in the same process)
    return Queued(sampled, to_host_async(sampled, purpose="tokens"), slots)
