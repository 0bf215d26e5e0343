"""Soak: both nodes as subprocesses on loopback under a mixed load, with faults at fixed times.

    python bench/soak.py [--minutes 10] [--quick] [--long-outage] [--workers 8]

Load (a bounded thread pool, closed loop, a short pause between requests): normal requests
(seeded, greedy and stochastic, K 0-4), client cancels after a few tokens, 1-50 ms
deadlines, over-limit requests (INVALID_ARGUMENT expected) and bursts above
max_batch + max_queue (RESOURCE_EXHAUSTED expected). Faults: decode killed and restarted
after 5 s, decode SIGSTOP for 10 s then SIGCONT, prefill killed and restarted, and with
--long-outage decode down for 150 s. Reports outcomes per kind, latency of the normal
requests, RSS and threads of each node process, slots at the end, recovery times, and
lost or duplicated tokens (seeded requests re-run solo on a quiet system must match).
Writes bench/results/soak-cpu-<date>.json. Everything stops by itself (bounded in time).
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import environment, free_port, health, markdown_table, node_command, write_results
from protos import pdspec_pb2, pdspec_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
MAX_BATCH, MAX_QUEUE = 8, 16
PROMPTS = ["import ", "def ", "class Foo:\n    ", "for i in range(", "return self.", "# the "]
LOG_DIR = Path("/tmp/pdspec-soak")


def proc_status(pid: int) -> dict:
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "Threads:")):
                key, value = line.split(":", 1)
                out[key] = int(value.split()[0])
    except OSError:
        return {}
    return {"rss_mib": round(out.get("VmRSS", 0) / 1024, 1), "threads": out.get("Threads", 0)}


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("pdspec_running_requests", "pdspec_waiting_requests")):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class Node:
    """One node subprocess; `start()` again after a kill is a new incarnation."""

    def __init__(self, name: str, args: list[str], port: int, metrics_port: int) -> None:
        self.name, self.args, self.port, self.metrics_port = name, args, port, metrics_port
        self.proc: subprocess.Popen | None = None
        self.incarnations: list[dict] = []

    def start(self) -> None:
        LOG_DIR.mkdir(exist_ok=True)
        log = open(LOG_DIR / f"{self.name}-{len(self.incarnations)}.log", "w")  # noqa: SIM115
        command = node_command(self.name, self.port, self.metrics_port, *self.args)
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        self.incarnations.append({"pid": self.proc.pid, "ready": False, "first": None, "max": None, "last": None})

    def sample(self) -> None:
        """RSS and threads of the running incarnation, once it is SERVING: first, largest, last."""
        entry = self.incarnations[-1] if self.incarnations else None
        if entry and entry["ready"] and self.proc.poll() is None:
            status = proc_status(self.proc.pid)
            if status:
                entry["first"] = entry["first"] or status
                entry["last"] = status
                worst = entry["max"] or status
                entry["max"] = {key: max(worst[key], status[key]) for key in status}

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def wait_serving(self, timeout: float = 90) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if health(self.port) == SERVING:
                self.incarnations[-1]["ready"] = True
                self.sample()
                return time.monotonic()
            time.sleep(0.05)
        raise RuntimeError(f"{self.name} not SERVING after {timeout}s")


class Load:
    def __init__(self, port: int, seed: int) -> None:
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pdspec_pb2_grpc.PrefillServiceStub(self.channel)
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.outcomes: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.latencies: list[float] = []
        self.samples: list[tuple[pdspec_pb2.GenerateRequest, list[int]]] = []
        self.n = 0
        self.phase = "steady"  # "burst" or "fault" while one is under way (and 3 s after a fault)

    def record(self, kind: str, code: grpc.StatusCode, phase: str) -> None:
        with self.lock:
            self.outcomes[f"{kind} ({phase})"][code.name] += 1

    def request(self, *, prompt: str, max_new: int, seed: int | None, greedy: bool, k: int, **extra):
        with self.lock:
            self.n += 1
            n = self.n
        sampling = pdspec_pb2.SamplingParams(do_sample=not greedy, max_new_tokens=max_new)
        if seed is not None:
            sampling.seed = seed
        for key, value in extra.items():
            if key == "stop_token_ids":
                sampling.stop_token_ids.extend(value)
            else:
                setattr(sampling, key, value)
        return pdspec_pb2.GenerateRequest(
            request_id=f"soak-{n}", prompt=prompt, sampling=sampling, num_speculative_tokens=k
        )

    @staticmethod
    def run(stub, request, timeout: float, stop_after: int | None = None):
        """(code, tokens): `stop_after` messages then cancel."""
        tokens: list[int] = []
        stream = stub.Generate(request, timeout=timeout)
        try:
            for i, response in enumerate(stream):
                tokens += response.token_ids
                if stop_after is not None and i + 1 >= stop_after:
                    stream.cancel()
        except grpc.RpcError as err:
            return err.code(), tokens
        return grpc.StatusCode.OK, tokens

    def one(self) -> grpc.StatusCode:
        phase = self.phase
        with self.lock:
            r = self.rng.random()
            seed = self.rng.randrange(1 << 30)
            prompt = self.rng.choice(PROMPTS)
            k = self.rng.randrange(5)
            greedy = self.rng.random() < 0.4
            max_new = self.rng.randrange(16, 129)
            deadline = self.rng.uniform(0.001, 0.05)
            stop_after = self.rng.randrange(1, 4)
            bad = self.rng.randrange(4)
        if r < 0.55:
            kind = "normal"
            request = self.request(prompt=prompt, max_new=max_new, seed=seed, greedy=greedy, k=k)
            start = time.monotonic()
            code, tokens = self.run(self.stub, request, 30)
            if code is grpc.StatusCode.OK:
                with self.lock:
                    self.latencies.append(time.monotonic() - start)
                    if len(self.samples) < 400:
                        self.samples.append((request, tokens))
        elif r < 0.70:
            kind = "cancel"
            request = self.request(prompt=prompt, max_new=4096, seed=seed, greedy=False, k=k)
            code, _ = self.run(self.stub, request, 30, stop_after=stop_after)
        elif r < 0.85:
            kind = "deadline"
            request = self.request(prompt=prompt, max_new=4096, seed=seed, greedy=False, k=k)
            code, _ = self.run(self.stub, request, deadline)
        else:
            kind = "over_limit"
            if bad == 0:
                request = self.request(prompt=prompt, max_new=2**31 - 1, seed=seed, greedy=False, k=k)
            elif bad == 1:
                request = self.request(prompt="", max_new=16, seed=seed, greedy=False, k=k)
                request.prompt_token_ids.extend([65] * 9000)
            elif bad == 2:
                request = self.request(prompt=prompt, max_new=16, seed=seed, greedy=False, k=k)
                request.sampling.stop_token_ids.extend(range(1, 66))
            else:
                request = self.request(prompt=prompt, max_new=16, seed=seed, greedy=False, k=k)
                request.request_id = "r" * 300
            code, _ = self.run(self.stub, request, 10)
        seen = {phase, self.phase}  # a request that saw a fault or a burst begin or end counts under it
        self.record(kind, code, "fault" if "fault" in seen else "burst" if "burst" in seen else "steady")
        return code

    def burst(self, n: int) -> collections.Counter:
        """n long streams at once: each reads its first message, then all are cancelled."""
        streams = [
            self.stub.Generate(self.request(prompt="import ", max_new=4096, seed=i, greedy=False, k=4), timeout=30)
            for i in range(n)
        ]
        codes: collections.Counter = collections.Counter()

        def settle(stream):  # CANCELLED: admitted (a slot or the queue), then cancelled here
            try:
                for _ in stream:
                    pass
            except grpc.RpcError as err:
                return err.code().name
            return "OK"

        timer = threading.Timer(2.0, lambda: [s.cancel() for s in streams])
        timer.start()
        with futures.ThreadPoolExecutor(n) as pool:
            for code in pool.map(settle, streams):
                codes[code] += 1
        with self.lock:
            self.outcomes["burst"].update(codes)
        return codes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="about one minute")
    parser.add_argument("--long-outage", action="store_true", help="also a 150 s decode outage")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--replay", type=int, default=60, help="seeded requests re-run solo at the end")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    duration = 75.0 if args.quick else args.minutes * 60
    # Fault times as fractions of the run (the quick run keeps them a few seconds apart).
    schedule = [(0.15, "decode_kill"), (0.40, "decode_sigstop"), (0.65, "prefill_kill")]
    if args.long_outage:
        schedule.append((0.72, "decode_long_outage"))
        duration = max(duration, 420.0)
    bursts = [f / 8 for f in (1, 3, 5, 7)]

    dport, dmetrics, pport, pmetrics = (free_port() for _ in range(4))
    flags = ["--max-batch", str(MAX_BATCH), "--max-queue", str(MAX_QUEUE)]
    decode = Node("decode", flags, dport, dmetrics)
    prefill = Node("prefill", ["--decode-addr", f"127.0.0.1:{dport}", "--http-port", "-1"], pport, pmetrics)
    events: dict[str, object] = {}
    decode.start()
    prefill.start()
    try:
        decode.wait_serving()
        prefill.wait_serving()
        load = Load(pport, args.seed)
        stop = threading.Event()
        t0 = time.monotonic()
        end = t0 + duration

        def worker():
            while not stop.is_set() and time.monotonic() < end:
                try:
                    code = load.one()
                except Exception as err:  # a harness bug must not hang the run
                    print("worker error:", err, file=sys.stderr)
                    code = grpc.StatusCode.UNKNOWN
                time.sleep(0.2 if code is grpc.StatusCode.UNAVAILABLE else 0.02)

        def sampler():
            while not stop.is_set() and time.monotonic() < end + 5:
                decode.sample()
                prefill.sample()
                stop.wait(2)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(args.workers)]
        threads.append(threading.Thread(target=sampler, daemon=True))
        for t in threads:
            t.start()
        pending = sorted([(f, name) for f, name in schedule] + [(f, "burst") for f in bursts])
        for fraction, name in pending:
            delay = t0 + fraction * duration - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            at = round(time.monotonic() - t0, 1)
            print(f"[{at:6.1f}s] {name}", flush=True)
            load.phase = "burst" if name == "burst" else "fault"
            if name == "burst":
                events.setdefault("bursts", []).append({"at_s": at, **load.burst(MAX_BATCH + MAX_QUEUE + 8)})
            elif name in ("decode_kill", "decode_long_outage"):
                down = 5.0 if name == "decode_kill" else 150.0
                decode.kill()
                time.sleep(down)
                decode.start()
                up = decode.wait_serving()
                serving = prefill.wait_serving(30)
                events[name] = {"at_s": at, "down_s": down, "prefill_serving_after_decode_s": round(serving - up, 3)}
            elif name == "decode_sigstop":
                events[name] = {"at_s": at, **sigstop(decode, prefill, load)}
            elif name == "prefill_kill":
                prefill.kill()
                time.sleep(2)
                spawned = time.monotonic()
                prefill.start()
                up = prefill.wait_serving()
                events[name] = {"at_s": at, "prefill_serving_after_spawn_s": round(up - spawned, 2)}
            print(f"          {events.get(name, events.get('bursts', [{}])[-1])}", flush=True)
            if name != "burst":
                time.sleep(3)  # the client channel reconnects, workers come out of their pauses
            load.phase = "steady"
        remaining = end - time.monotonic()
        if remaining > 0:
            time.sleep(remaining)
        stop.set()
        for t in threads:
            t.join(40)
        time.sleep(2)  # quiet: every cancel and deadline has reached the engine
        decode.sample()
        prefill.sample()
        slots = {**scrape(dmetrics), **scrape(pmetrics)}
        replay = check_replay(load, args.replay)
        decode.sample()
        prefill.sample()
    finally:
        decode.kill()
        prefill.kill()

    lat = sorted(load.latencies)
    p = (lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3, 1)) if lat else (lambda q: None)
    outcomes = {kind: dict(counter) for kind, counter in sorted(load.outcomes.items())}
    results = {
        "duration_s": round(duration, 1),
        "workers": args.workers,
        "decode_flags": flags,
        "outcomes": outcomes,
        "normal_latency_ms": {
            "n": len(lat),
            "p50": p(0.5),
            "p99": p(0.99),
            "mean": round(statistics.mean(lat) * 1e3, 1) if lat else None,
        },
        "processes": {"decode": decode.incarnations, "prefill": prefill.incarnations},
        "slots_at_end": slots,
        "kv_blocks_in_use_at_end": "n/a (the n-gram pair has no KV pool; running/waiting above)",
        "events": events,
        "replay": replay,
    }
    rows = [
        [kind, sum(c.values()), ", ".join(f"{k} {v}" for k, v in sorted(c.items()))] for kind, c in outcomes.items()
    ]
    table = markdown_table(["kind", "requests", "outcomes"], rows)
    print(table)
    for key in ("normal_latency_ms", "processes", "slots_at_end", "events", "replay"):
        print(key, results[key])
    print("wrote", write_results("soak-quick" if args.quick else "soak", environment(), results, table))


def sigstop(decode: Node, prefill: Node, load: Load) -> dict:
    """A stream reading when decode freezes: when does it hear UNAVAILABLE, when does prefill
    go NOT_SERVING; SIGCONT after 10 s: when is prefill SERVING again."""
    out: dict[str, object] = {}
    stub = pdspec_pb2_grpc.PrefillServiceStub(load.channel)
    stream = stub.Generate(load.request(prompt="import ", max_new=4096, seed=1, greedy=False, k=4), timeout=60)
    for _ in range(3):
        next(stream)
    heard: dict[str, float] = {}

    def read():
        try:
            for _ in stream:
                pass
            heard["code"] = "OK"
        except grpc.RpcError as err:
            heard["code"] = err.code().name
        heard["at"] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    decode.proc.send_signal(signal.SIGSTOP)
    frozen = time.monotonic()
    reader.start()
    while time.monotonic() - frozen < 10:
        if "not_serving_s" not in out and health(prefill.port, 0.5) != SERVING:
            out["not_serving_s"] = round(time.monotonic() - frozen, 2)
        time.sleep(0.05)
    reader.join(1)
    out["stream"] = heard.get("code", "still open")
    out["stream_ended_s"] = round(heard["at"] - frozen, 2) if "at" in heard else None
    decode.proc.send_signal(signal.SIGCONT)
    resumed = time.monotonic()
    out["serving_after_sigcont_s"] = round(prefill.wait_serving(30) - resumed, 2)
    return out


def check_replay(load: Load, n: int) -> dict:
    """Seeded normal requests that finished under load, re-run one at a time: same tokens."""
    rng = random.Random(1)
    samples = rng.sample(load.samples, min(n, len(load.samples)))
    stub = pdspec_pb2_grpc.PrefillServiceStub(load.channel)
    mismatches, lost, extra = [], 0, 0
    for request, tokens in samples:
        code, again = Load.run(stub, request, 30)
        if code is not grpc.StatusCode.OK or again != tokens:
            common = next((i for i, (a, b) in enumerate(zip(again, tokens, strict=False)) if a != b), None)
            common = min(len(again), len(tokens)) if common is None else common
            lost += max(0, len(again) - len(tokens))
            extra += max(0, len(tokens) - len(again))
            mismatches.append(
                {
                    "request_id": request.request_id,
                    "code": code.name,
                    "under_load": len(tokens),
                    "solo": len(again),
                    "common": common,
                }
            )
    return {
        "replayed": len(samples),
        "mismatched": len(mismatches),
        "lost_tokens": lost,
        "duplicated_tokens": extra,
        "mismatches": mismatches[:10],
    }


if __name__ == "__main__":
    main()
