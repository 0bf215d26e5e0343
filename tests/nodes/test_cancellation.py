"""Cancels and short deadlines free their slot: at each node directly and through prefill.

A request whose client cancelled or whose deadline passed must leave the engine at its next
step, even when the RPC ended before the servicer registered its cancel callback (a 1 ms
deadline can expire during validation), and be counted with its true status.
"""

import random
import time
from concurrent import futures

import grpc

from decode_node.engine import DecodeConfig
from protos import pdspec_pb2, pdspec_pb2_grpc
from tests.nodes.conftest import cluster, drain, wait_until

LONG = 4096  # the default --max-new-tokens-limit: a leaked request holds its slot for seconds


def _decode_request(prefill, seed: int) -> pdspec_pb2.DecodeRequest:
    request = pdspec_pb2.GenerateRequest(
        request_id=f"storm-{seed}",
        prompt="import os\nimport sys\n" * 50,  # 1,000 ids: validation takes a while
        num_speculative_tokens=4,
        sampling=pdspec_pb2.SamplingParams(do_sample=True, seed=seed, max_new_tokens=LONG),
    )
    return prefill.engine.prefill(prefill.engine.check(request)).decode_request


def _settled(node, started: float) -> float:
    wait_until(lambda: node.engine.load == 0, timeout=5, what="engine idle after the storm")
    return time.monotonic() - started


def test_short_deadline_storm_at_the_decode_node(pair):
    with cluster(pair, DecodeConfig(max_batch=8, max_queue=300)) as (_, prefill, decode):
        stub = pdspec_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(f"127.0.0.1:{decode.port}"))
        requests = [_decode_request(prefill, seed) for seed in range(8)]
        rng = random.Random(0)
        deadlines = [rng.choice([0.001, 0.002, 0.005, 0.01, 0.02, 0.05]) for _ in range(200)]
        with futures.ThreadPoolExecutor(16) as pool:
            codes = list(
                pool.map(
                    lambda i: drain(stub.Decode(requests[i % 8], timeout=deadlines[i])),
                    range(len(deadlines)),
                )
            )
        assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
        assert _settled(decode, time.monotonic()) < 1.0
        # Counted with the status the client saw, none as OK or CANCELLED. (gRPC itself turns
        # away a request whose deadline passed before a handler ran: those are never counted.)
        time.sleep(0.5)
        counts = {c: decode.metrics.requests.labels("decode", c)._value.get() for c in ("OK", "CANCELLED")}
        assert counts == {"OK": 0, "CANCELLED": 0}
        assert 0 < decode.metrics.requests.labels("decode", "DEADLINE_EXCEEDED")._value.get() <= len(deadlines)
        # Fresh requests still fill every slot and the queue.
        done = drain(stub.Decode(_short(requests[0]), timeout=30))
        assert done is grpc.StatusCode.OK


def _short(request: pdspec_pb2.DecodeRequest) -> pdspec_pb2.DecodeRequest:
    short = pdspec_pb2.DecodeRequest()
    short.CopyFrom(request)
    short.sampling.max_new_tokens = 8
    return short


def test_max_batch_1_survives_four_short_deadline_calls(pair):
    with cluster(pair, DecodeConfig(max_batch=1, max_queue=4)) as (client, prefill, decode):
        stub = pdspec_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(f"127.0.0.1:{decode.port}"))
        request = _decode_request(prefill, 1)
        for timeout in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05) * 4:
            assert drain(stub.Decode(request, timeout=timeout)) is grpc.StatusCode.DEADLINE_EXCEEDED
        _settled(decode, time.monotonic())
        out = client.generate("def ", max_new_tokens=10, seed=2, timeout=10)
        assert len(out.token_ids) == 10


def test_cancel_and_deadline_storm_through_prefill(pair):
    with cluster(pair, DecodeConfig(max_batch=8, max_queue=300)) as (client, prefill, decode):
        rng = random.Random(1)

        def one(i: int) -> grpc.StatusCode:
            if i % 2:  # a deadline of 1-50 ms
                return drain(client.stream("import ", max_new_tokens=LONG, seed=i, timeout=rng.uniform(0.001, 0.05)))
            stream = client.stream("import ", max_new_tokens=LONG, seed=i, timeout=30)
            next(stream)  # the first token came from prefill; the decode call is under way
            stream.cancel()
            return drain(stream)

        with futures.ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(one, range(100)))
        assert set(codes) <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
        assert _settled(decode, time.monotonic()) < 1.0
        time.sleep(0.5)
        counted = {
            code: prefill.metrics.requests.labels("prefill", code)._value.get()
            for code in ("OK", "CANCELLED", "DEADLINE_EXCEEDED")
        }
        assert counted["OK"] == 0 and counted["CANCELLED"] >= 50  # every cancel reached a handler
        assert counted["CANCELLED"] + counted["DEADLINE_EXCEEDED"] <= 100
        assert len(client.generate("def ", max_new_tokens=5, timeout=10).token_ids) == 5
