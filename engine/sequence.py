"""One request's state: the same object in both nodes.

A sequence is its prompt and every token generated after it (`history`), the rule that ends
it (`budget`, EOS and stop ids, applied by `append`), what it may draft (K cap, candidates
per node), its generator, the model states holding its KV, its prompt-lookup index and
adaptive-K state, and its statistics. Everything about a request is resolved once, when its
sequence is made; the node engines are schedulers over sequences (`engine/proposer.Row` is
what a proposer reads of one).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from engine.grammar import GrammarError, Grammars, GrammarState
from engine.prompt_lookup import ContextIndex
from models.base import State
from protos.validation import DecodeInput
from sampling import RequestRng, SamplingParams
from sampling.proposal import LOOKUP, Proposal


def finish_reason(token: int, eos: Collection[int], stop: Collection[int], emitted: int, budget: int) -> str:
    """Why a request ends at `token`, its `emitted`-th generated token ("" = it goes on):
    an EOS id wins over a stop id, both over the length budget."""
    if token in eos:
        return "eos"
    if token in stop:
        return "stop"
    return "length" if emitted >= budget else ""


@dataclass
class Stats:
    """A request's speculation counts on one node. `accepted_tokens` counts accepted DRAFT
    tokens only (a step EMITS those plus the correction or bonus token)."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # by depth
    accepted_per_rank: list[int] = field(default_factory=list)  # by rank among siblings
    chosen_k: list[int] = field(default_factory=list)  # this node's steps by the K chosen for them
    method: str = ""  # the speculative method
    prompt_lookup_tokens: int = 0  # draft tokens prompt lookup proposed
    preemptions: int = 0  # decode node: times it gave its batch slot up (decode_node/fairness.py)
    jump_forward_tokens: int = 0  # structured outputs: tokens the grammar forced, proposed as free drafts
    grammar_rejected_drafts: int = 0  # structured outputs: drafts the grammar forbade

    def record(self, proposal: Proposal, path: list[int]) -> list[int]:
        """A verified proposal whose nodes `path` were accepted; returns their ranks among siblings."""
        self.verify_steps += 1
        self.draft_tokens += len(proposal.token_ids)
        self.accepted_tokens += len(path)
        if proposal.source == LOOKUP:
            self.prompt_lookup_tokens += len(proposal.token_ids)
        ranks = [proposal.rank(n) for n in path]
        for position, rank in enumerate(ranks):
            self.accepted_per_position[position] += 1
            self.accepted_per_rank[rank] += 1
        return ranks


@dataclass(eq=False)
class Sequence:
    """One request. `budget` is the client's total of generated tokens (the prefill node's first
    token included), the server default already applied; `k` caps its proposals' depth (0: it
    never speculates)."""

    prompt: list[int]
    params: SamplingParams
    budget: int
    eos_token_ids: tuple[int, ...]
    stop_token_ids: tuple[int, ...]
    rng: RequestRng
    k: int = 0
    candidates: int = 1  # per proposal-tree node (1: chains)
    logprobs: int = 0  # top log-probabilities reported per token (0: none)
    method: str = ""  # the node's speculative method (statistics)
    history: list[int] = field(default_factory=list)  # prompt + every generated token
    target_state: State | None = None  # consumed all of history but its last token
    draft_state: State | None = None  # consumed a prefix of history (catches up before drafting)
    lookup: ContextIndex | None = None  # history, indexed for prompt lookup (holds the same list)
    stats: Stats = field(default_factory=Stats)
    # Decode side: the proposal that came with the request (the prefill node's), verified at the
    # sequence's first step on this node; None once that step has run.
    received: Proposal | None = None
    # Structured outputs: the matcher of the request's constraint (engine/grammar.py), at the end
    # of `history`; every step's target law is restricted to the tokens it allows.
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        if not self.history:
            self.history = list(self.prompt)
        self.stats.accepted_per_position = [0] * self.k
        self.stats.accepted_per_rank = [0] * max(self.candidates, 1)
        self.stats.chosen_k = [0] * (self.k + 1)
        self.stats.method = self.method

    @property
    def generated(self) -> int:
        return len(self.history) - len(self.prompt)

    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return self.budget - self.generated

    @property
    def first_step(self) -> bool:
        return self.received is not None

    @property
    def plain(self) -> bool:
        """K = 0 (so nothing received to verify either) and no logprobs: one token per step and
        nothing else read back, what async scheduling queues without waiting (a constrained row
        needs its grammar's mask with every step)."""
        return not self.k and not self.logprobs and self.grammar is None

    @classmethod
    def decoding(
        cls,
        decode_input: DecodeInput,
        eos: Collection[int],
        default_budget: int,
        method: str,
        grammars: Grammars | None = None,
    ) -> Sequence:
        """A decode node's sequence of a validated DecodeRequest: prompt + the prefill node's first
        token, the budget (`default_budget` where the client gave none), the stop rule, its K and
        candidates, its generator (stream "decode"), the proposal it came with (verified at its
        first step, its law moved to the device then) and its constraint's matcher, compiled by
        `grammars` (GrammarError where it does not compile), past the first token."""
        grammar = None
        if decode_input.constraint is not None and grammars is not None:
            grammar = grammars.compile(decode_input.constraint)
            first = decode_input.first_token_id
            if first >= 0:  # else it comes last (DecodeStream): `receive` makes the sequence anew
                if not grammar.allows(first):
                    raise GrammarError("first_token_id", str(first), "a token the constraint allows first")
                grammar.settle([first])
        return cls(
            prompt=decode_input.prompt_token_ids,
            params=decode_input.params,
            budget=decode_input.max_new_tokens or default_budget,
            eos_token_ids=tuple(eos),
            stop_token_ids=tuple(decode_input.stop_token_ids),
            rng=RequestRng(decode_input.params.seed, stream="decode"),
            k=decode_input.num_speculative_tokens,
            candidates=decode_input.draft_candidates,
            logprobs=decode_input.logprobs,
            method=method,
            history=[*decode_input.prompt_token_ids, decode_input.first_token_id],
            received=decode_input.proposal,
            grammar=grammar,
        )

    def kv_need(self, proposal_nodes: int) -> int:
        """KV positions it may ever occupy with proposals of up to `proposal_nodes` nodes: prompt,
        every token it may generate, a proposal's nodes and the token they follow."""
        return len(self.prompt) + self.budget + proposal_nodes + 1

    def append(self, tokens: list[int]) -> tuple[list[int], str]:
        """Add the tokens a step emitted, up to the one that ends the sequence. Returns the tokens
        kept and why it ended ("" while it goes on). The rule: an EOS id wins over a stop id, both
        over the budget. A constrained sequence ends with "stop" once its grammar is complete: at
        an EOS (allowed only there), or as soon as the grammar admits nothing more."""
        kept: list[int] = []
        reason = ""
        grammar = self.grammar
        for token in tokens:
            kept.append(token)
            reason = finish_reason(
                token, self.eos_token_ids, self.stop_token_ids, self.generated + len(kept), self.budget
            )
            if grammar is not None:  # token by token: a step may emit more after the grammar completes
                if token not in self.eos_token_ids:
                    grammar.settle([token])
                if reason == "eos" or (grammar.done and reason != "stop"):
                    reason = "stop"
            if reason:
                break
        self.history += kept  # in place: the prompt-lookup index holds this list
        if grammar is not None and reason:  # the request's structured-output counts, for its stats
            self.stats.jump_forward_tokens = grammar.jump_forward_tokens
            self.stats.grammar_rejected_drafts = grammar.rejected_drafts
        return kept, reason
