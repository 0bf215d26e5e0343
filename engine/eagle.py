"""Drafting with a hidden-state head (`EagleProposer`, models/eagle.py).

The head lags the target by one token: its position i reads the target's features at i and
token i + 1. Before drafting, a row's head catches up with what the target has computed since
(`catch_up`): the features the target's forwards left on its state (the prompt's on the prefill
node; the accepted path of each verify pass on the decode node, never the prompt again), paired
with the tokens after them, in one head forward for the batch. Its last output then drafts a
chain: depth d draws from the head's logits at the request's parameters (`propose_candidates`,
the exact law, mapped to the target's vocabulary by d2t), and feeds the drawn token with the
head's own output hidden in place of the target's features. The depths run over a stacked copy
of the rows' KV (`EagleDraft.chain`; on a GPU one CUDA-graph replay per depth), so the drafted
positions never enter the head's own KV: the next catch-up writes those positions from the
target's features.

On the prefill node the head's state rides on the target's (`State.rides`), so its KV ships
with the target's; on the decode node the imported one is where the proposer starts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.proposer import Plan, Row
from models.eagle import EagleDraft, HeadState
from sampling import DraftToTargetMap, SamplingTensors, propose_candidates, stream_uniforms
from sampling.proposal import DRAFT, NO_PROPOSAL, Drafted, DraftLaw, Proposal
from sampling.tree import MAX_TREE_NODES

EAGLE = "eagle"


class EagleProposer:
    """Chains from a hidden-state head, in the law `law`, its ids mapped by `d2t`."""

    method = EAGLE
    sources = (DRAFT,)
    uses_draft = True
    match_driven = False
    trees = False  # one draw per depth

    def __init__(
        self, draft: EagleDraft, d2t: DraftToTargetMap, law: DraftLaw, max_tree_nodes: int = MAX_TREE_NODES
    ) -> None:
        self.draft, self.d2t, self.law = draft, d2t, law
        self.max_tree_nodes = max_tree_nodes

    def start(self, rows: Sequence[Row], kv_needs: Sequence[int]) -> None:
        """Each row's head state (the one shipped with its KV where there is one), caught up
        with the target: then it rides on the target's state, for the KV export."""
        for row in rows:
            rides = row.target_state.rides
            row.draft_state = rides if rides is not None else self.draft.empty_state()
            row.target_state.rides = row.draft_state
        self.catch_up(rows)

    def stop(self, row: Row) -> None:
        if row.draft_state is not None:
            self.draft.release(row.draft_state)
            row.draft_state = None
        if row.target_state is not None:
            row.target_state.rides = None

    def plan(self, rows: Sequence[Row], caps: Sequence[int]) -> list[Plan]:
        return [Plan(DRAFT, cap) for cap in caps]  # a draft model's costs: a forward per depth

    def propose(self, rows: Sequence[Row], plans: Sequence[Plan], depths: Sequence[int]) -> list[Proposal]:
        out = [NO_PROPOSAL] * len(rows)
        drafting = [r for r, depth in enumerate(depths) if depth > 0]
        if drafting:
            drafted = self.draft_rows([rows[r] for r in drafting], [depths[r] for r in drafting])
            for r, proposal in zip(drafting, drafted, strict=True):
                out[r] = proposal
        return out

    def max_nodes(self, depth: int, candidates: int) -> int:
        return min(depth, self.max_tree_nodes)

    def catch_up(self, rows: Sequence[Row]) -> None:
        """Feed each row's head the target's features it has not read, with the tokens after them."""
        behind, ids, features = [], [], []
        for row in rows:
            state, target = row.draft_state, row.target_state
            end = len(row.history) - 1  # the head's positions run to the target's last consumed token
            if len(state.tokens) == end:
                continue
            held = 0 if target.features is None else len(target.features)
            first = len(target.tokens) - held  # the first position whose features the target holds
            if len(target.tokens) != end or not first <= len(state.tokens):
                raise ValueError(
                    f"target_state: expected the features of positions {len(state.tokens)}..{end - 1}, "
                    f"got {first}..{len(target.tokens) - 1}"
                )
            behind.append(state)
            ids.append(row.history[len(state.tokens) + 1 :])
            features.append(target.features[len(state.tokens) - first :])
            target.features = None  # read: the head holds them now
        if behind:
            self.draft.extend(behind, ids, features, fused=False)

    def draft_rows(self, rows: Sequence[Row], depths: Sequence[int]) -> list[Proposal]:
        """Every row's chain to its depth (> 0): one head forward to catch up, then one chain
        step per depth for all rows (`EagleDraft.chain`: a graph replay on a GPU; a row past its
        own depth drafts on, unread). The depths run on the device, each fed the last one's
        draws and outputs; the drawn ids come to the host once, at the end."""
        self.catch_up(rows)
        states: list[HeadState] = [row.draft_state for row in rows]
        device = self.d2t.d2t.device
        deepest = max(depths)
        # One uniform per node, for either law: a seeded stream never depends on the law.
        uniforms = stream_uniforms([row.rng for row in rows], depths, device)  # [R, K_max], zero padded
        params = SamplingTensors.from_params([row.params for row in rows], device)
        logits = torch.stack([state.last[0] for state in states]).to(device)  # [R, Vd]
        hidden = torch.stack([state.last[1] for state in states])  # [R, H]
        chain = self.draft.chain(states, deepest - 1) if deepest > 1 else None
        laws: list[torch.Tensor] = []  # per depth: the law of each row's draw [R, Vd]
        drawn, mapped = [], []  # per depth: each row's draft and target id [R]
        for depth in range(deepest):
            sample = propose_candidates(self.law, logits, params, uniforms[:, depth : depth + 1], 1)
            drawn.append(sample.token_ids[:, 0])
            mapped.append(self.d2t.map_tokens(drawn[-1]))
            if sample.probs is not None:
                laws.append(sample.probs[:, 0])
            if depth + 1 < deepest:  # the drawn token and the head's own output feed the next depth
                logits, hidden = chain.step(mapped[-1], hidden)
        ids = torch.stack([*drawn, *mapped]).tolist()  # [2K, R]: the one host read of the chain
        row_laws = list(torch.stack(laws, 1).unbind(0)) if laws else [None] * len(rows)  # [K, Vd] each
        chains = [
            Drafted(
                [ids[d][r] for d in range(depth)],
                [ids[deepest + d][r] for d in range(depth)],
                list(range(-1, depth - 1)),
                None if law is None else law[:depth],
            )
            for r, (depth, law) in enumerate(zip(depths, row_laws, strict=True))
        ]
        return self.d2t.proposals(chains)
