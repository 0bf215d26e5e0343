"""In-process PD pipeline without gRPC: prefill engine -> wire bytes -> validator -> decode engine.

Used where a statistical test needs tens of thousands of requests: every request still
goes through the real prefill engine, a serialized DecodeRequest, the decode-boundary
validator and the decode engine's batched steps; only the transport is left out (the
gRPC tests cover it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from decode_node.engine import DecodeConfig, DecodeEngine
from engine.spec_config import SpeculativeConfig
from models.pair import ModelPair
from prefill_node.engine import PrefillConfig, PrefillEngine
from protos import pdspec_pb2
from protos.validation import DecodeInput, Receiver, validate_decode_request
from sampling import Verifier
from sampling.proposal import DraftLaw


class MemoizedModel:
    """A CausalLM proxy that memoizes `prefill` and `extend` by token history.

    The model's output after a history is a deterministic function of that history (same
    weights, same inputs, same code path on the CPU), so a statistical test that sends the
    same prompt 20,000 times may compute each distinct history once: a hit returns the
    logits and a fresh copy of the state (through the model's own export_state /
    import_state) exactly as the computation would. `extend_batch` (the decode node's
    batched verify pass), `truncate` and the KV export/import the engines do themselves go
    to the model unchanged. `tests/nodes/test_transformer_distribution.py` checks that
    outputs with and without it are identical."""

    def __init__(self, model) -> None:
        self.model = model
        self._prefills: dict[tuple[int, ...], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self._extends: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.hits = self.misses = 0

    def __getattr__(self, name):  # name, vocab_size, eos_token_ids, kv_layout, extend_batch, truncate, ...
        return getattr(self.model, name)

    def prefill(self, ids):
        key = tuple(ids)
        found = self._prefills.get(key)
        if found is None:
            self.misses += 1
            logits, state = self.model.prefill(ids)
            self._prefills[key] = found = (logits, self.model.export_state(state))
            return logits.clone(), state
        self.hits += 1
        return found[0].clone(), self.model.import_state(found[1], key)

    def extend_last(self, states, ids):
        """Row by row through the memo (the prefill engine's batched prompt pass)."""
        return torch.stack([self._extend_last(state, row) for state, row in zip(states, ids, strict=True)])

    def _extend_last(self, state, ids):
        key = ("last", tuple(state.tokens), tuple(ids))
        found = self._extends.get(key)
        if found is None:
            self.misses += 1
            logits = self.model.extend_last([state], [ids])[0]
            self._extends[key] = (logits, self.model.export_state(state))
            return logits.clone()
        self.hits += 1
        copy = self.model.import_state(found[1], (*key[1], *key[2]))
        self.model.release(state)
        state.tokens, state.kv = copy.tokens, copy.kv
        return found[0].clone()

    def extend(self, state, ids):
        key = (tuple(state.tokens), tuple(ids))
        found = self._extends.get(key)
        if found is None:
            self.misses += 1
            logits = self.model.extend(state, ids)
            self._extends[key] = (logits, self.model.export_state(state))
            return logits.clone()
        self.hits += 1
        copy = self.model.import_state(found[1], (*key[0], *key[1]))
        state.tokens, state.kv = copy.tokens, copy.kv
        return found[0].clone()


def memoized(pair: ModelPair) -> ModelPair:
    """The pair with both models behind a MemoizedModel (same contract, same d2t, same tokenizer)."""
    return ModelPair(MemoizedModel(pair.target), MemoizedModel(pair.draft), pair.d2t, pair.tokenizer)


def generate_many(
    pair: ModelPair,
    prompt: Sequence[int],
    seeds: Sequence[int],
    *,
    k: int,
    law: DraftLaw,
    max_new_tokens: int,
    temperature: float = 1.0,
    sampler=None,
    batch: int = 4096,
    memoize: bool = False,
    candidates: int = 1,
    tree_sampler=None,
    method: str = "draft",
) -> list[list[int]]:
    """Token lists of one seeded stochastic request per seed (first token included).
    `prompt` is token ids (the request's prompt_token_ids)."""
    return generate_many_verifiers(
        pair,
        prompt,
        seeds,
        k=k,
        law=law,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        samplers=[sampler],
        batch=batch,
        memoize=memoize,
        candidates=candidates,
        tree_samplers=[tree_sampler],
        method=method,
    )[0]


def generate_many_verifiers(
    pair: ModelPair,
    prompt: Sequence[int],
    seeds: Sequence[int],
    *,
    k: int,
    law: DraftLaw,
    max_new_tokens: int,
    samplers: Sequence,
    temperature: float = 1.0,
    batch: int = 4096,
    memoize: bool = False,
    device: str = "cpu",
    backend: str = "torch",
    candidates: int = 1,
    tree_samplers: Sequence | None = None,
    method: str = "draft",
) -> list[list[list[int]]]:
    """generate_many for several verifiers (None = the real rejection sampler) at the cost
    of one prefill per seed: each request's validated DecodeInput goes to one decode engine
    per sampler (what a decode node receives does not depend on its verifier). One token
    list per seed for each sampler, in `samplers` order. `candidates` > 1: proposals are
    candidate trees, verified by the matching entry of `tree_samplers` (None = the real one).
    `method`: both nodes' speculative method (`eagle` for a hidden-state head)."""
    tree_samplers = tree_samplers or [None] * len(samplers)
    if memoize:
        pair = memoized(pair)
    prefill = PrefillEngine(pair, PrefillConfig(spec=SpeculativeConfig(method=method, draft_law=law), device=device))
    decodes = [
        DecodeEngine(
            pair,
            DecodeConfig(
                spec=SpeculativeConfig(
                    method=method, max_speculative_tokens=max(k, 1), draft_law=law, max_draft_candidates=candidates
                ),
                max_batch=batch,
                max_queue=len(seeds),
                device=device,
            ),
            verifier=Verifier(backend, device, sampler=sampler, tree_sampler=tree_sampler),
        )
        for sampler, tree_sampler in zip(samplers, tree_samplers, strict=True)
    ]
    receiver = Receiver.from_contract(pair.contract(), max(k, 1), max_draft_candidates=candidates)
    requests = [
        prefill.check(
            pdspec_pb2.GenerateRequest(
                request_id=str(seed),
                prompt_token_ids=list(prompt),
                num_speculative_tokens=k,
                draft_candidates=candidates,
                sampling=pdspec_pb2.SamplingParams(
                    do_sample=True, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens
                ),
            )
        )
        for seed in seeds
    ]
    firsts, handles = [], []
    for prefilled in prefill.prefill_many(requests):  # batched like concurrent requests: seeded, so the same tokens
        firsts.append(prefilled.first_token)
        if prefilled.finish_reason:
            handles.append([None] * len(decodes))
            continue
        wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
        decoded = validate_decode_request(wire, receiver)
        assert isinstance(decoded, DecodeInput), decoded
        handles.append([decode.submit(decoded) for decode in decodes])
    results = []
    for index, decode in enumerate(decodes):
        while decode.load:
            decode.step()
        outputs = []
        for first, per_sampler in zip(firsts, handles, strict=True):
            out, handle = [first], per_sampler[index]
            while handle is not None and not handle.events.empty():
                out += handle.events.get().tokens
            outputs.append(out)
        results.append(outputs)
    return results


def target_probs(pair: ModelPair, ids: Sequence[int]) -> np.ndarray:
    """The target's next-token distribution at temperature 1 after `ids`, float64: the
    n-gram's exact probabilities, or softmax of a neural model's own logits."""
    target = pair.target
    if hasattr(target, "next_token_probs"):
        return np.asarray(target.next_token_probs(list(ids)), dtype=np.float64)
    logits, _ = target.prefill(list(ids))
    return torch.softmax(logits.double(), -1).cpu().numpy()


def exact_joint(pair: ModelPair, prompt: Sequence[int], n: int, samples: int) -> dict[tuple[int, ...], float]:
    """P(first n tokens) under the target at temperature 1 (q = the model's probabilities),
    for every prefix whose expected count is at least 0.5 among `samples`; the mass of the
    others is left out (it goes to a "rest" bin)."""
    joint = {(): 1.0}
    for _ in range(n):
        grown = {}
        for prefix, prob in joint.items():
            p = target_probs(pair, [*prompt, *prefix])
            for token in (p * prob * samples >= 0.5).nonzero()[0]:
                grown[(*prefix, int(token))] = prob * float(p[token])
        joint = grown
    return joint
