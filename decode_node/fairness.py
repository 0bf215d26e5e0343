"""Fairness when long streams fill the decode batch: paused readers and preemption.

The decode engine (decode_node/engine.py) asks `Fairness.step` once per step, before it admits.

* **Paused readers.** A stream whose client has stopped reading backs up: the servicer is
  blocked sending to it, and its undelivered events pile up in `Request.events`. Once
  `pause_backlog` of them wait (--pause-backlog), the request is not stepped; it runs again as
  soon as the servicer has taken them (the client read). It generates nothing for nobody
  meanwhile, and it is the first to give its slot up when others wait.
* **Preemption by recompute** (vLLM's RECOMPUTE). When more requests are ready to run than
  slots are free, running requests give theirs up: paused ones, then those that have held their
  slot more than `after_steps` steps since they were (re)admitted (--preempt-after-steps),
  longest-held first, at most one per request left without a slot. A preempted request frees
  its KV (target and draft) and waits behind every waiting request that never ran (`rank`: a
  newcomer, a short request, gets the next free slot), keeping its `Sequence`: its
  history, its generator, its adaptive-K state and its statistics. When its turn comes its KV
  is recomputed, as a prefill computes a prompt's: the target consumes its history but the last
  token over an empty reserved state (`claim_state`, `recompute`), and the proposer starts it
  anew (the draft prefilled on the same tokens, the prompt-lookup index rebuilt). Its next step
  reads exactly what it would have read unpreempted, so its output law is unchanged, and a
  seeded request's tokens are the same wherever the model's forward does not depend on how
  the context was batched (the built-in pair; a GPU's kernels may round a recomputed KV
  differently from the one built step by step, which can move a near tie, as a different batch
  can).

Never preempted: a request on its first step (it verifies the prefill node's proposal over the
prefill's KV), nor one whose KV is still being uploaded (such a request is not running yet).
Waiting requests take turns: a preempted request counts as waiting, so with more ready
requests than slots every running request yields its slot after about `after_steps` steps (a
round robin whose quantum is `after_steps`; each turn costs one recompute of the context).
"""

from __future__ import annotations

from collections.abc import Sequence

from decode_node.request import Request
from models.base import CausalLM, State
from models.pair import ModelPair
from pdspec.metrics import NodeMetrics


class Fairness:
    def __init__(self, max_batch: int, after_steps: int, backlog: int, metrics: NodeMetrics | None = None) -> None:
        self.max_batch = max_batch
        self.after_steps = after_steps  # 0: never preempt
        self.backlog = backlog  # 0: never pause
        self.metrics = metrics
        self.steps = 0  # engine steps so far: a request's slot is held since `Request.since`
        self.preemptions = 0

    def paused(self, request: Request) -> bool:
        """Its client has not read `backlog` events: it is not stepped."""
        return self.backlog > 0 and request.events.qsize() >= self.backlog

    def ready(self, request: Request) -> bool:
        """A waiting request that would run if it had a slot (its KV in, its client reading)."""
        return (
            not request.cancelled.is_set() and (request.imported or not request.streamed) and not self.paused(request)
        )

    def rank(self, request: Request) -> bool:
        """Admission order (a stable sort of the queue): requests that never ran, in arrival
        order, before preempted ones, in the order they were preempted."""
        return request.preemptions > 0

    def step(self, active: Sequence[Request], pending: Sequence[Request]) -> list[Request]:
        """Once per engine step, with the engine's lock held: the running requests to preempt now."""
        self.steps += 1
        if not self.after_steps:
            return []
        short = sum(map(self.ready, pending)) - (self.max_batch - len(active))  # ready, and no slot for them
        if short <= 0:
            return []
        held = []
        for request in active:
            if request.cancelled.is_set() or request.seq.first_step:
                continue
            paused = self.paused(request)
            if paused or self.steps - request.since > self.after_steps:
                held.append((not paused, request.since, request))  # paused first, then the longest-held
        held.sort(key=lambda entry: entry[:2])
        return [request for _, _, request in held[:short]]

    def admitted(self, request: Request) -> None:
        request.since = self.steps

    def preempted(self, request: Request) -> None:
        request.preemptions += 1
        request.seq.stats.preemptions += 1
        self.preemptions += 1
        if self.metrics:
            self.metrics.preemptions.labels("decode").inc()


def claim_state(pair: ModelPair, request: Request) -> State:
    """The target state a request's turn reserves KV for (all it may need; the caller checked
    `can_reserve`): its prompt's, for the prefill node's KV (the pair's `begin_import`: a
    hidden-state head's state rides on it), or, preempted, an empty one that admission fills
    (`recompute`). A request that never drafts (K = 0) keeps no hidden states."""
    target = pair.target
    if not request.preemptions:
        state = pair.begin_import(request.seq.prompt, request.kv_need)
    else:
        state = target.empty_state()
        target.reserve(state, request.kv_need)
    state.keeps_features = request.seq.k > 0
    return state


def recompute(target: CausalLM, history: list[int], state: State) -> None:
    """A preempted request's target KV: its history but the last token (which its next step
    feeds), consumed over its `claim_state`."""
    if len(history) > 1:
        target.extend_last([state], [history[:-1]])
