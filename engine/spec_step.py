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

`queue` is the step of async scheduling: queued on the device before the step before it is
read, each row's first input token that step's last emitted one, still on the device, then any
drafts the row made ahead of it (point-mass chains). Its positions and KV slots are built on the
host as if the step in flight accepted all its drafts, and moved back on the device by what it
rejected (`engine/kv_cache.Shift`), so the host builds step n+1 while the device runs step n.

Terms: a row EMITS its accepted drafts plus one token (the correction at the first rejection,
or the bonus after the last draft); `path` lists the accepted nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from common.transfer import HostCopy, shared_tensor, to_device, to_host_async
from engine.grammar import guide, jump_forward
from engine.proposer import Plan, Proposer
from engine.sequence import Sequence
from models.base import CausalLM
from sampling import NO_PROPOSAL, Proposal, Verifier, VerifyBatch
from sampling.logprobs import TokenLogprob, token_logprobs
from sampling.proposal import LOOKUP


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
    """A step queued on the device, not yet read (async scheduling)."""

    tokens: torch.Tensor  # [B] int64 on the device: each row's last emitted token, the next step's first input
    shift: torch.Tensor | None  # [B] int64 on the device: accepted - drafted (<= 0); None: no row drafted
    copy: HostCopy  # [B, K+2] int64 on its way to the host: the emitted tokens (-1 after), then their count
    slots: list[int]  # where each row's first fed token sits in its target state's tokens (UNREAD until read)
    proposals: list[Proposal]  # each row's drafts, verified by this step (point-mass chains; none at K = 0)

    def host(self) -> list[list[int]]:
        """Each row's emitted tokens: the host waits for the step here."""
        packed = self.copy.wait().tolist()
        return [row[: row[-1]] for row in packed]


def queue(
    target: CausalLM,
    verifier: Verifier,
    seqs: list[Sequence],
    drafts: list[list[int]],
    carried: list[int | None],
    earlier: Queued | None,
    device: torch.device | str,
) -> Queued:
    """Queue one step of every row, nothing read back. Row r feeds the token the step in flight
    emitted last for it (its row carried[r] of `earlier`), or, new to the batch (None), its last
    history token; then drafts[r], a chain of point masses (prompt lookup drafting ahead of the
    step in flight: any tokens at all, since the verifier is exact for any point mass, the
    drafts of a wrong guess are rejected). Where `earlier` drafted, its rows' tokens go back by
    what it rejected, on the device (`shift`), and so do the positions whose uniforms a sampled
    row draws with: every sampled row is verified by coupling, its tokens those a K = 0 step
    would draw at their positions, whatever it drafted."""
    fresh = [r for r, at in enumerate(carried) if at is None]
    width = 0 if earlier is None else len(earlier.tokens)
    where = {r: width + i for i, r in enumerate(fresh)}  # row -> its token in cat(earlier's, the fresh rows')
    index = [where[r] if at is None else at for r, at in enumerate(carried)]
    rows, feeds = len(seqs), [1 + len(d) for d in drafts]
    # the flattened feed, as indices into cat(earlier's tokens, the fresh rows', the drafts)
    flat = []
    drafted = width + len(fresh)
    for r, d in enumerate(drafts):
        flat.append(index[r])
        flat.extend(range(drafted, drafted + len(d)))
        drafted += len(d)
    packed = torch.tensor(
        [*index, *flat, *(seqs[r].history[-1] for r in fresh), *(t for d in drafts for t in d)], dtype=torch.int64
    )
    packed = to_device(packed, device)  # one copy for the indices and the host's tokens
    values = packed[rows + len(flat) :]
    values = values if earlier is None else torch.cat([earlier.tokens, values])  # [B' + fresh + drafts]
    tokens = values[packed[rows : rows + len(flat)]]  # [sum of feeds] int64
    shift = None
    if earlier is not None and earlier.shift is not None:
        moves = torch.cat([earlier.shift, torch.zeros(len(fresh), dtype=torch.int64, device=earlier.shift.device)])
        shift = moves[packed[:rows]]  # [B]: a fresh row sits where the host put it
    states = [s.target_state for s in seqs]
    logits = target.extend_batch(states, [[UNREAD, *d] for d in drafts], device_tokens=tokens, shift=shift)
    slots = [len(state.tokens) - n for state, n in zip(states, feeds, strict=True)]
    # a coupled row's position: its history, then the tokens in flight as if that step accepted
    # all its drafts, moved back on the device by what it rejected (`shift`)
    positions = [
        len(s.history) + (0 if at is None else 1 + len(earlier.proposals[at].token_ids))
        for s, at in zip(seqs, carried, strict=True)
    ]
    proposals = [Proposal(d, list(range(-1, len(d) - 1)), None, LOOKUP) if d else NO_PROPOSAL for d in drafts]
    if any(drafts):
        batch = VerifyBatch.build(proposals, positions, target.vocab_size, verifier.device)
    else:  # a K = 0 step: no layout to build
        batch = VerifyBatch(torch.empty(rows, 0, dtype=torch.int64), positions=positions)
    batch = replace(batch, position_shift=shift)
    result = verifier.verify(batch, logits, [s.params for s in seqs], [s.rng for s in seqs])
    output = result.output_token_ids.to(torch.int64)  # [B, K+1]
    emitted = result.accepted_token_num.to(torch.int64)  # [B]: 1..K+1
    last = output.gather(1, (emitted - 1)[:, None])[:, 0]  # [B]
    shift = None
    if any(drafts):
        shift = emitted - 1 - shared_tensor([len(d) for d in drafts], torch.int64, emitted.device)
    packed = torch.cat([output, emitted[:, None]], 1)  # [B, K+2]
    # its own stream: not behind a KV export's copies (a prefill node in the same process)
    return Queued(last, shift, to_host_async(packed, purpose="tokens"), slots, proposals)
