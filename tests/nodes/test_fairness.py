"""Fairness when long streams fill the decode batch (decode_node/fairness.py), through real
nodes on loopback with the built-in pair: a short request behind streams that hold every slot
gets one (they are preempted) and completes; a preempted request resumes with the same tokens
(greedy and seeded sampled, K = 0 and K = 4 of hybrid drafting: prompt lookup and the draft
model, point masses); a stream whose client stops reading is not stepped while others run,
and finishes once it reads again."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest

from decode_node.engine import DecodeConfig
from engine.adaptive import StepCosts
from engine.spec_config import SpeculativeConfig
from prefill_node.engine import PrefillConfig
from protos import pdspec_pb2, pdspec_pb2_grpc
from tests.nodes.conftest import cluster, drain, wait_until

ENDLESS = 4096  # the default --max-new-tokens-limit
# Fixed step costs: adaptive K never depends on the start-up timings (calibrate is a no-op).
COSTS = StepCosts((1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8))
PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n",
    "import os\nimport sys\nimport ",
    "class Foo:\n    def __init__(self):\n        self.x = 1\n\nclass Foo:\n",
    "return self._name\n\n    def name(self):\n        return self._",
]


def _decode_request(prefill, seed: int, max_new_tokens: int = ENDLESS) -> pdspec_pb2.DecodeRequest:
    request = pdspec_pb2.GenerateRequest(
        request_id=f"long-{seed}",
        prompt=PROMPTS[seed % len(PROMPTS)],
        num_speculative_tokens=0,
        sampling=pdspec_pb2.SamplingParams(do_sample=True, seed=seed, max_new_tokens=max_new_tokens),
    )
    return prefill.engine.prefill(prefill.engine.check(request)).decode_request


def _running(decode) -> list:
    with decode.engine._lock:
        return list(decode.engine._active)


def test_a_short_request_gets_a_slot_behind_endless_streams(pair):
    config = DecodeConfig(max_batch=4, preempt_after_steps=16)
    with cluster(pair, config) as (client, prefill, decode):
        stub = pdspec_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(f"127.0.0.1:{decode.port}"))
        calls = [stub.Decode(_decode_request(prefill, seed), timeout=60) for seed in range(4)]
        readers = [threading.Thread(target=drain, args=(call,), daemon=True) for call in calls]
        for reader in readers:
            reader.start()
        try:
            wait_until(lambda: decode.engine.running == 4, what="the streams to hold every slot")
            out = client.generate(PROMPTS[0], max_new_tokens=8, seed=1, timeout=30)
            assert len(out.token_ids) == 8 and out.finish_reason == "length"
            assert decode.engine.fairness.preemptions >= 1
            counted = decode.metrics.preemptions.labels("decode")._value.get()
            assert counted == decode.engine.fairness.preemptions
            # the endless streams are still there: preempted, not dropped
            assert decode.engine.load == 4
        finally:
            for call in calls:
                call.cancel()
            for reader in readers:
                reader.join(10)


@pytest.fixture(scope="module")
def preempting(pair):
    """Hybrid drafting (prompt lookup where the context matches, else the draft model; point
    masses), two slots, a request preempted once it has held its slot 3 steps while others wait."""
    spec = SpeculativeConfig(method="hybrid")
    config = DecodeConfig(spec=spec, step_costs=COSTS, max_batch=2, preempt_after_steps=3)
    with cluster(pair, config, PrefillConfig(spec=spec)) as running:
        yield running


@pytest.mark.parametrize("k", [0, 4])
def test_a_preempted_request_resumes_with_the_same_tokens(preempting, k):
    client, _, decode = preempting
    jobs = [
        dict(prompt=prompt, greedy=greedy, seed=None if greedy else 100 + i, num_speculative_tokens=k)
        for i, prompt in enumerate(PROMPTS)
        for greedy in (True, False)
    ]

    drafted = []

    def run(job):
        out = client.generate(max_new_tokens=40, timeout=60, **job)
        drafted.append(out.stats.draft_tokens)
        return out.token_ids

    before = decode.engine.fairness.preemptions
    alone = [run(job) for job in jobs]  # one at a time: never more than the batch holds
    assert decode.engine.fairness.preemptions == before
    with futures.ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(run, jobs))
    assert decode.engine.fairness.preemptions > before  # 8 requests for 2 slots took turns
    assert together == alone
    assert all(len(tokens) > 4 for tokens in alone)
    assert (sum(drafted) > 0) == (k > 0)


def test_a_client_that_stops_reading_is_paused(pair):
    config = DecodeConfig(max_batch=4, preempt_after_steps=0, pause_backlog=64)
    with cluster(pair, config) as (client, prefill, decode):
        # A small receive window: the servicer blocks on this stream after ~1 KiB.
        channel = grpc.insecure_channel(
            f"127.0.0.1:{decode.port}", options=[("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
        )
        stub = pdspec_pb2_grpc.DecodeServiceStub(channel)
        call = stub.Decode(_decode_request(prefill, 7), timeout=60)  # nobody reads it, for now
        try:
            wait_until(lambda: any(map(decode.engine.fairness.paused, _running(decode))), what="the stream to pause")
            (request,) = _running(decode)
            generated = request.seq.generated
            assert generated < ENDLESS
            # others run meanwhile: many steps, none of them the paused stream's
            for seed in range(3):
                out = client.generate(PROMPTS[seed], max_new_tokens=64, seed=seed, timeout=30)
                assert len(out.token_ids) == 64
            assert request.seq.generated == generated
            assert decode.engine.fairness.paused(request)
            # it reads again: the stream runs on to its end
            tokens = [t for response in call for t in response.token_ids]
            assert len(tokens) == ENDLESS - 1  # the prefill node's first token is not in the decode stream
        finally:
            call.cancel()
            channel.close()
