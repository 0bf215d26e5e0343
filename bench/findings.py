"""Re-measure the reliability findings (as of fbed5d7) with probes of the same shape.

    python bench/findings.py [--only 1,2,3,5,6,7] [--outage 30]

1 slots after early cancel/deadline, 2 admission with default limits, 3 unbounded requests,
5 tiny temperatures, 6 prefill's lag behind a returning decode node, 7 /metrics threads
and unparseable bodies. (4, a hung decode node, is measured by bench/soak.py and
tests/nodes/test_security.py::test_frozen_decode_node.) Nodes run in this process on
loopback unless a probe needs a subprocess. Writes bench/results/findings-cpu-<date>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    Reader,
    drain,
    environment,
    free_port,
    health,
    node_command,
    nodes,
    results_dir,
    wait_until,
    write_results,
)
from decode_node.engine import DecodeConfig
from models.loader import load_pair
from prefill_node.server import PrefillNodeConfig
from prefill_node.server import run_server as run_prefill
from protos import pdspec_pb2, pdspec_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
LONG = 4096


def rss_mib() -> float:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def threads(pid: int | None = None) -> int:
    return len(os.listdir(f"/proc/{pid or os.getpid()}/task"))


def cluster(pair, decode: DecodeConfig | None = None):
    """Both nodes in this process as the probes have always run them: each with a /metrics
    endpoint (finding 7 counts the threads of the prefill node's)."""
    return nodes(pair, decode=decode, decode_node={"metrics_port": 0}, prefill_node={"metrics_port": 0})


def start_decode(port: int) -> subprocess.Popen:
    """`python -m decode_node` on loopback `port`, no /metrics, its output discarded."""
    return subprocess.Popen(node_command("decode", port, -1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def counted(node, code: str) -> float:
    value = node.metrics.registry.get_sample_value("pdspec_requests_total", {"node": node.metrics.node, "code": code})
    return value or 0.0


def finding_1(pair) -> dict:
    out = {}
    with cluster(pair, DecodeConfig(max_batch=8, max_queue=300)) as (client, prefill, decode):
        stub = pdspec_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(f"127.0.0.1:{decode.port}"))
        request = pdspec_pb2.GenerateRequest(
            request_id="leak",
            prompt="import os\nimport sys\n" * 50,
            num_speculative_tokens=4,
            sampling=pdspec_pb2.SamplingParams(do_sample=True, seed=1, max_new_tokens=LONG),
        )
        decode_request = prefill.engine.prefill(prefill.engine.check(request)).decode_request
        rng = random.Random(0)
        deadlines = [rng.choice([0.001, 0.002, 0.005, 0.01, 0.02, 0.05]) for _ in range(200)]
        with futures.ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(lambda t: drain(stub.Decode(decode_request, timeout=t)), deadlines))
        time.sleep(1.0)
        out["decode_storm"] = {
            "calls": len(deadlines),
            "deadline_exceeded": codes.count(grpc.StatusCode.DEADLINE_EXCEEDED),
            "engine_load_1s_after": decode.engine.load,
            "counted_ok_ran_for_nobody": counted(decode, "OK"),
        }
        # Through prefill: a cancel after the first token; how long does decode keep the request?
        lags = []
        for i in range(20):
            stream = client.stream("import ", max_new_tokens=LONG, seed=i, timeout=30)
            next(stream)
            next(stream)  # decode's first message: the request runs
            stream.cancel()
            t = time.monotonic()
            wait_until(lambda: decode.engine.load == 0, timeout=30, what="engine idle")
            lags.append(time.monotonic() - t)
        out["prefill_cancel_engine_stops_s"] = {"max": round(max(lags), 3), "median": round(sorted(lags)[10], 3)}

        # RSS over 30 s of cancel/deadline storms through prefill (MiB/min).
        def one(i: int):
            if i % 2:
                return drain(client.stream("import ", max_new_tokens=LONG, seed=i, timeout=0.001 + (i % 50) / 1000))
            stream = client.stream("import ", max_new_tokens=LONG, seed=i, timeout=30)
            next(stream)
            stream.cancel()
            return drain(stream)

        with futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(one, range(200)))  # warm-up
        gc.collect()
        rss0, t0, n = rss_mib(), time.monotonic(), 0
        with futures.ThreadPoolExecutor(16) as pool:
            while time.monotonic() - t0 < 30:
                list(pool.map(one, range(n, n + 100)))
                n += 100
        wait_until(lambda: decode.engine.load == 0, timeout=5, what="engine idle")
        gc.collect()
        minutes = (time.monotonic() - t0) / 60
        out["rss_storm"] = {
            "requests": n,
            "rss_mib": [round(rss0, 1), round(rss_mib(), 1)],
            "mib_per_min": round((rss_mib() - rss0) / minutes, 1),
        }
    with cluster(pair, DecodeConfig(max_batch=1, max_queue=4)) as (client, prefill, decode):
        stub = pdspec_pb2_grpc.DecodeServiceStub(grpc.insecure_channel(f"127.0.0.1:{decode.port}"))
        decode_request = prefill.engine.prefill(prefill.engine.check(request)).decode_request
        codes = [drain(stub.Decode(decode_request, timeout=t)) for t in (0.001, 0.002, 0.005, 0.01, 0.02, 0.05) * 4]
        t = time.monotonic()
        result = client.generate("def ", max_new_tokens=10, seed=2, timeout=30)
        out["max_batch_1_after_24_short_deadlines"] = {
            "deadline_exceeded": codes.count(grpc.StatusCode.DEADLINE_EXCEEDED),
            "next_request_tokens": len(result.token_ids),
            "next_request_s": round(time.monotonic() - t, 3),
        }
    return out


def finding_2(pair) -> dict:
    """Defaults: decode max_batch 32 + max_queue 128, prefill --max-streams 160; 240 long streams."""
    with cluster(pair) as (client, prefill, decode):
        n = 240
        sent = time.perf_counter()
        readers = [Reader(client.stream("import ", max_new_tokens=LONG, seed=i, timeout=120), sent) for i in range(n)]
        streams = [r.stream for r in readers]
        wait_until(lambda: sum(s.code is not None for s in streams) >= n - 160, timeout=30, what="rejections")
        rejected_in = max(s.ended for s in streams if s.code is not None) - sent
        checks, not_serving, t0 = [], 0.0, time.monotonic()
        channels = {
            name: grpc.insecure_channel(f"127.0.0.1:{port}") for name, port in (("p", prefill.port), ("d", decode.port))
        }
        while time.monotonic() - t0 < 10:
            for name, channel in channels.items():
                t = time.perf_counter()
                try:
                    status = (
                        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    )
                except grpc.RpcError:
                    status = -1
                checks.append((time.perf_counter() - t) * 1e3)
                if name == "p" and status != SERVING:
                    not_serving += 0.2
            time.sleep(0.2)
        codes = {}
        for s in streams:
            key = s.code.name if s.code else "in flight"
            codes[key] = codes.get(key, 0) + 1
        load = (decode.engine.running, decode.engine.waiting, prefill.service.in_flight)
        for r in readers:
            r.cancel()
        t = time.monotonic()
        wait_until(lambda: decode.engine.load == 0, timeout=30, what="engine idle")
        return {
            "streams": n,
            "codes": codes,
            "rejections_done_s": round(rejected_in, 2),
            "decode_running_waiting_prefill_in_flight": load,
            "health_check_ms": {"max": round(max(checks), 1), "median": round(sorted(checks)[len(checks) // 2], 1)},
            "prefill_not_serving_s": round(not_serving, 1),
            "drained_after_cancel_s": round(time.monotonic() - t, 2),
        }


def finding_3(pair) -> dict:
    out = {}
    with cluster(pair) as (client, _prefill, _):
        stub = client.stub

        def probe(name: str, build) -> None:
            request = pdspec_pb2.GenerateRequest(
                request_id=name, prompt="import ", sampling=pdspec_pb2.SamplingParams(max_new_tokens=16, seed=1)
            )
            build(request)
            t = time.perf_counter()
            try:
                for _ in stub.Generate(request, timeout=30):
                    pass
                code, details = "OK", ""
            except grpc.RpcError as err:
                code, details = err.code().name, err.details() or ""
            out[name] = {"code": code, "ms": round((time.perf_counter() - t) * 1e3, 1), "details_bytes": len(details)}

        probe("max_new_tokens=2**31-1", lambda r: setattr(r.sampling, "max_new_tokens", 2**31 - 1))
        probe("max_new_tokens=4097", lambda r: setattr(r.sampling, "max_new_tokens", 4097))
        probe("prompt 8193 ids", lambda r: r.prompt_token_ids.extend([65] * 8193))
        probe("prompt 1e6 ids", lambda r: r.prompt_token_ids.extend([65] * 1_000_000))
        probe("65 stop ids", lambda r: r.sampling.stop_token_ids.extend(range(1, 66)))
        probe("1e6 stop ids", lambda r: r.sampling.stop_token_ids.extend(range(1_000_000)))
        probe("100 KB request_id", lambda r: setattr(r, "request_id", "r" * 100_000))
        probe("257-byte request_id", lambda r: setattr(r, "request_id", "r" * 257))

        # Neighbour slowdown: a 64-token request alone, next to 8 requests with 64 stop ids (the
        # most allowed), and next to a flood of 1e6-stop-id requests (rejected).
        def neighbour() -> float:
            t = time.perf_counter()
            client.generate("def ", max_new_tokens=64, seed=5, greedy=True, timeout=60)
            return (time.perf_counter() - t) * 1e3

        alone = min(neighbour() for _ in range(5))
        heavy = pdspec_pb2.GenerateRequest(
            request_id="heavy",
            prompt="import ",
            sampling=pdspec_pb2.SamplingParams(max_new_tokens=64, seed=1, stop_token_ids=list(range(1000, 1064))),
        )
        flood = pdspec_pb2.GenerateRequest(request_id="flood", prompt="import ")
        flood.sampling.stop_token_ids.extend(range(1_000_000))
        results = {}
        for name, request in (("64 stop ids x8", heavy), ("1e6 stop ids x8 (rejected)", flood)):
            stop = threading.Event()

            def loop(req=request, stop=stop):
                while not stop.is_set():
                    drain(stub.Generate(req, timeout=30))

            workers = [threading.Thread(target=loop, daemon=True) for _ in range(8)]
            for w in workers:
                w.start()
            time.sleep(0.5)
            results[name] = round(sorted(neighbour() for _ in range(5))[2], 1)
            stop.set()
            for w in workers:
                w.join(30)
        out["neighbour_64_tokens_ms"] = {"alone": round(alone, 1), **results}
    return out


def finding_5(pair) -> dict:
    out = {}
    with cluster(pair) as (client, _, _):
        greedy = client.generate("def ", max_new_tokens=32, greedy=True, timeout=30).token_ids
        for t in (1e-30, 1.2e-38, 1.1754944e-38, 1e-38, 1e-40, 1e-45):
            got = client.generate("def ", max_new_tokens=32, temperature=t, seed=3, timeout=30).token_ids
            out[f"{t:g}"] = {"equals_greedy": got == greedy, "zeros": got.count(0)}
    return out


def finding_6(pair, outage: float) -> dict:
    port = free_port()
    decode = start_decode(port)
    config = PrefillNodeConfig(decode_addr=f"127.0.0.1:{port}", host="127.0.0.1", port=0, metrics_port=None)
    try:
        with run_prefill(config, lambda: pair) as prefill:
            wait_until(lambda: prefill.peer.compatible, timeout=60, what="decode up")
            decode.kill()
            decode.wait()
            time.sleep(outage)
            decode = start_decode(port)
            wait_until(lambda: health(port) == SERVING, timeout=60, what="decode restarted")
            up = time.monotonic()
            wait_until(lambda: health(prefill.port) == SERVING, timeout=60, what="prefill SERVING")
            return {"outage_s": outage, "prefill_serving_after_decode_s": round(time.monotonic() - up, 3)}
    finally:
        decode.kill()
        decode.wait()


def finding_7(pair) -> dict:
    with cluster(pair) as (_, prefill, _):
        before = threads()
        sockets = []
        for _ in range(50):
            s = socket.create_connection(("127.0.0.1", prefill.metrics_port))
            sockets.append(s)
        time.sleep(1.0)
        during = threads()
        for s in sockets:
            s.close()
        channel = grpc.insecure_channel(f"127.0.0.1:{prefill.port}")
        call = channel.unary_stream(
            "/pdspec.v1.PrefillService/Generate", request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        code = drain(call(b"\x0a\xff", timeout=5))
        return {
            "threads_before_50_idle_metrics_connections": before,
            "threads_with_them": during,
            "unparseable_body": code.name,
            "counted_invalid_argument": counted(prefill, "INVALID_ARGUMENT"),
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="1,2,3,5,6,7")
    parser.add_argument("--outage", type=float, default=30.0)
    args = parser.parse_args()
    pair = load_pair()
    wanted = set(args.only.split(","))
    results = {}
    probes = {
        "1": lambda: finding_1(pair),
        "2": lambda: finding_2(pair),
        "3": lambda: finding_3(pair),
        "5": lambda: finding_5(pair),
        "6": lambda: finding_6(pair, args.outage),
        "7": lambda: finding_7(pair),
    }
    for key, probe in probes.items():
        if key in wanted:
            t = time.monotonic()
            results[key] = probe()
            print(f"finding {key} ({time.monotonic() - t:.0f}s):", json.dumps(results[key]), flush=True)
    env = environment()
    earlier = results_dir() / f"findings-cpu-{env['date'][:10]}.json"
    if earlier.exists():  # sections run separately (--only) accumulate in the day's file
        results = {**json.loads(earlier.read_text())["rows"], **results}
    print("wrote", write_results("findings", env, results, json.dumps(results, indent=1)))


if __name__ == "__main__":
    main()
