"""In-process PD pipeline without gRPC: prefill engine -> wire bytes -> validator -> decode engine.

Used where a statistical test needs tens of thousands of requests: every request still
goes through the real prefill engine, a serialized DecodeRequest, the decode-boundary
validator and the decode engine's batched steps; only the transport is left out (the
gRPC tests cover it).
"""

from __future__ import annotations

from collections.abc import Sequence

from decode_node.engine import DecodeConfig, DecodeEngine
from models.pair import ModelPair
from prefill_node.engine import PrefillConfig, PrefillEngine
from protos import pdspec_pb2
from protos.validation import DecodeInput, Receiver, validate_decode_request
from sampling import Verifier
from sampling.proposal import DraftLaw


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
) -> list[list[int]]:
    """Token lists of one seeded stochastic request per seed (first token included)."""
    prefill = PrefillEngine(pair, PrefillConfig(draft_law=law))
    decode = DecodeEngine(
        pair,
        DecodeConfig(max_speculative_tokens=max(k, 1), max_batch=batch, max_queue=len(seeds), draft_law=law),
        verifier=Verifier("torch", sampler=sampler),
    )
    receiver = Receiver(pair.contract(), max(k, 1), pair.d2t)
    outputs, handles = [], []
    for seed in seeds:
        request = pdspec_pb2.GenerateRequest(
            request_id=str(seed),
            prompt_token_ids=list(prompt),
            num_speculative_tokens=k,
            sampling=pdspec_pb2.SamplingParams(
                do_sample=True, temperature=temperature, seed=seed, max_new_tokens=max_new_tokens
            ),
        )
        prefilled = prefill.prefill(prefill.check(request))
        outputs.append([prefilled.first_token])
        if prefilled.finish_reason:
            handles.append(None)
            continue
        wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
        decoded = validate_decode_request(wire, receiver)
        assert isinstance(decoded, DecodeInput), decoded
        handles.append(decode.submit(decoded))
    while decode.load:
        decode.step()
    for out, handle in zip(outputs, handles, strict=True):
        while handle is not None and not handle.events.empty():
            out += handle.events.get().tokens
    return outputs


def exact_joint(pair: ModelPair, prompt: Sequence[int], n: int, samples: int) -> dict[tuple[int, ...], float]:
    """P(first n tokens) under the target at temperature 1 (q = the model's probabilities),
    for every prefix whose expected count is at least 0.5 among `samples`; the mass of the
    others is left out (it goes to a "rest" bin)."""
    joint = {(): 1.0}
    for _ in range(n):
        grown = {}
        for prefix, prob in joint.items():
            p = pair.target.next_token_probs([*prompt, *prefix])
            for token in (p * prob * samples >= 0.5).nonzero()[0]:
                grown[(*prefix, int(token))] = prob * float(p[token])
        joint = grown
    return joint
