"""Run the PD pair as two local processes in the foreground (`make run`); Ctrl-C stops both.

    python -m pdspec.local [--prefill-port 50051] [--decode-port 50052] [--scrape-every 0]

Waits until the prefill node reports SERVING through grpc.health.v1 (models loaded and the
decode peer compatible), prints a ready-to-paste `pdspec generate` command, then keeps both
nodes running. With --scrape-every N it also reads both /metrics endpoints every N seconds
and prints the speculative-decoding series (what Prometheus would scrape).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families


def wait_serving(addr: str, deadline_s: float, processes: list[subprocess.Popen]) -> None:
    channel = grpc.insecure_channel(addr)
    stub = health_pb2_grpc.HealthStub(channel)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if any(p.poll() is not None for p in processes):
            raise SystemExit("a node exited during start-up (see its log above)")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                channel.close()
                return
        except grpc.RpcError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{addr} not SERVING after {deadline_s:.0f}s")


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("pdspec_spec_") and sample.name.endswith("_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill-port", type=int, default=50051)
    parser.add_argument("--decode-port", type=int, default=50052)
    parser.add_argument("--prefill-metrics-port", type=int, default=9401)
    parser.add_argument("--decode-metrics-port", type=int, default=9402)
    parser.add_argument("--scrape-every", type=float, default=0, help="seconds between /metrics scrapes (0 = off)")
    parser.add_argument("--start-timeout", type=float, default=120)
    args = parser.parse_args(argv)
    python = sys.executable
    decode = subprocess.Popen(
        [
            python,
            "-m",
            "decode_node",
            "--host",
            "127.0.0.1",
            "--port",
            str(args.decode_port),
            "--metrics-port",
            str(args.decode_metrics_port),
        ]
    )
    prefill = subprocess.Popen(
        [
            python,
            "-m",
            "prefill_node",
            "--host",
            "127.0.0.1",
            "--port",
            str(args.prefill_port),
            "--metrics-port",
            str(args.prefill_metrics_port),
            "--decode-addr",
            f"127.0.0.1:{args.decode_port}",
        ]
    )
    processes = [decode, prefill]
    try:
        wait_serving(f"127.0.0.1:{args.prefill_port}", args.start_timeout, processes)
        pdspec = os.path.join(os.path.dirname(python), "pdspec")
        print(
            f"\npdspec is serving. In another terminal:\n\n  {pdspec} generate --stats --max-new-tokens 80 "
            f'--prefill-addr 127.0.0.1:{args.prefill_port} "def fibonacci(n):"\n\nCtrl-C stops both nodes.',
            flush=True,
        )
        while all(p.poll() is None for p in processes):
            time.sleep(args.scrape_every or 1)
            if args.scrape_every:
                for name, port in (("decode", args.decode_metrics_port),):
                    for series, value in scrape(port).items():
                        print(f"[{name}] {series} {value:g}", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not abandon the children
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in processes:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
