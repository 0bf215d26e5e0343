"""Reliability under load and faults, on real gRPC over loopback with the built-in n-gram pair.

(a) admission: beyond max_batch + max_queue exactly the excess hears RESOURCE_EXHAUSTED, while
health and GetInfo of both nodes answer within 100 ms; (b) a canary behind a full batch;
(c) SIGTERM of a decode node drains its streams; (d) a prefill node killed mid-stream frees
its decode slot; (e) a client that stops reading; (f) RSS and threads flat after hundreds of
cancelled and expired requests. Every figure is printed (pytest -s) and asserted.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_node.engine import DecodeConfig
from decode_node.server import DecodeNodeConfig
from decode_node.server import run_server as run_decode
from pdspec.client import Client
from prefill_node.engine import PrefillConfig
from prefill_node.server import PrefillNodeConfig
from prefill_node.server import run_server as run_prefill
from protos import pdspec_pb2, pdspec_pb2_grpc
from protos.validation import RequestLimits
from tests.nodes.conftest import cluster, drain, health_status, wait_until
from tests.nodes.test_faults import free_port

LONG = 4096  # the default --max-new-tokens-limit: ~14 s of the n-gram pair alone, longer at batch 4
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SMALL = DecodeConfig(max_batch=4, max_queue=4)
# Greedy "import " never reaches EOS under the n-gram pair, so these streams hold their slots
# until cancelled: a slot frees only when the test frees it, whatever the machine's speed.
ENDLESS = 1 << 16
ENDLESS_LIMITS = RequestLimits(max_new_tokens=ENDLESS)


class Reader:
    """A stream read on its own thread: first-message time, tokens, final status."""

    def __init__(self, stream, started: float | None = None) -> None:
        self.stream, self.started = stream, started or time.monotonic()
        self.first_at: float | None = None
        self.messages = 0
        self.tokens: list[int] = []
        self.code: grpc.StatusCode | None = None
        self.finish_reason = ""
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for response in self.stream:
                self.messages += 1
                if self.first_at is None:
                    self.first_at = time.monotonic()
                self.tokens += response.token_ids
                if response.finished:
                    self.finish_reason = response.finish_reason
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as err:
            self.code = err.code()
        self.ended_at = time.monotonic()

    def cancel(self) -> None:
        self.stream.cancel()

    def join(self, timeout: float = 30) -> Reader:
        self.thread.join(timeout)
        return self


def probe_ms(ports: dict[str, int], rounds: int = 5) -> dict[str, float]:
    """The slowest of `rounds` health Checks and GetInfos per node, in ms, on warm channels."""
    worst: dict[str, float] = {}
    for name, port in ports.items():
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = (pdspec_pb2_grpc.PrefillServiceStub if name == "prefill" else pdspec_pb2_grpc.DecodeServiceStub)(
                channel
            )
            health.Check(health_pb2.HealthCheckRequest(), timeout=5)  # connect outside the timing
            for call, label in (
                (lambda h=health: h.Check(health_pb2.HealthCheckRequest(), timeout=5), "health"),
                (lambda s=stub: s.GetInfo(pdspec_pb2.InfoRequest(), timeout=5), "info"),
            ):
                times = []
                for _ in range(rounds):
                    t = time.perf_counter()
                    call()
                    times.append((time.perf_counter() - t) * 1e3)
                    time.sleep(0.02)
                worst[f"{name} {label}"] = round(max(times), 1)
    return worst


def endless_cluster(pair, decode: DecodeConfig = SMALL):
    """Both nodes with SMALL decode limits and no max_new_tokens bound (endless streams hold
    their slots until cancelled, or until preempted), prefill taking up to 64 streams."""
    return cluster(
        pair, decode, PrefillConfig(limits=ENDLESS_LIMITS), decode_node={"limits": ENDLESS_LIMITS}, max_streams=64
    )


def test_admission_fires_and_health_answers_under_full_load(pair):
    """14 long streams at max_batch 4 + max_queue 4 (prefill --max-streams 64): the first token
    is prefill's own, then exactly 6 hear RESOURCE_EXHAUSTED from decode's admission."""
    with endless_cluster(pair) as (client, prefill, decode):
        n = 14
        readers = []

        def settled() -> int:  # requests decode holds or refused
            refused = sum(r.code is grpc.StatusCode.RESOURCE_EXHAUSTED for r in readers)
            return decode.engine.load + refused

        for i in range(n):
            # Endless greedy streams: an admitted one holds its slot until cancelled.
            readers.append(Reader(client.stream("import ", max_new_tokens=ENDLESS, greedy=True, timeout=300)))
            # Arrival order is submission order: the next is sent once decode has this one's verdict.
            wait_until(lambda i=i: settled() == i + 1, timeout=60, what=f"decode's verdict on request {i}")
        codes = [r.code for r in readers]
        rejected = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
        load = (decode.engine.running, decode.engine.waiting)
        worst = probe_ms({"prefill": prefill.port, "decode": decode.port})
        print(f"admission: {rejected}/{n} RESOURCE_EXHAUSTED, decode running/waiting {load}, slowest ms {worst}")
        assert rejected == n - 8 and codes.count(None) == 8, codes
        assert load == (4, 4)
        assert all(r.messages == 1 for r in readers if r.code is grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert max(worst.values()) < 100, worst
        assert health_status(prefill.port) == SERVING and health_status(decode.port) == SERVING
        for r in readers:
            r.cancel()
        cancelled = time.monotonic()
        wait_until(lambda: decode.engine.load == 0, timeout=60, what="decode idle")
        print(f"drained {time.monotonic() - cancelled:.2f}s after cancelling the 8 admitted")
        wait_until(lambda: prefill.service.in_flight == 0, timeout=60, what="prefill idle")
        assert len(client.generate("def ", max_new_tokens=8, seed=1, timeout=10).token_ids) == 8


def test_canary_behind_a_full_batch(pair):
    """With preemption off (--preempt-after-steps 0; on, a waiting request gets a slot within a
    bounded number of steps: tests/nodes/test_fairness.py): decode admits in arrival order; a
    request that finds every slot taken waits in the queue (not rejected) and starts once a slot
    frees. Its first token is prefill's own, so time to first token does not depend on decode's load.

    Synchronised on state, not on the clock (this failed under load with 1 s bounds): the batch
    is held by endless greedy streams, so the only slot that ever frees is the one the test
    frees; the canary's first token must come while decode's batch is full and it is queued,
    and its decode tokens only after the slot freed. The times are printed, not asserted."""
    with endless_cluster(pair, dataclasses.replace(SMALL, preempt_after_steps=0)) as (client, _, decode):
        longs = [Reader(client.stream("import ", max_new_tokens=ENDLESS, greedy=True, timeout=300)) for _ in range(4)]
        wait_until(lambda: decode.engine.running == 4, timeout=60, what="a full batch")
        sent = time.monotonic()
        canary = Reader(client.stream("def ", max_new_tokens=16, seed=7, timeout=300), sent)
        wait_until(lambda: canary.first_at is not None, timeout=60, what="the canary's first token")
        first = canary.first_at - sent
        wait_until(lambda: decode.engine.waiting == 1, timeout=60, what="the canary queued")
        assert decode.engine.running == 4, "a slot freed before the test freed one"
        # The window under test, counted from the canary's arrival at decode: longer than the
        # relay watchdog (3 s), so a queued request must not be taken for a stalled one.
        arrived = decode.engine._pending[0].arrived
        wait_until(lambda: time.monotonic() - arrived > 4.0, timeout=60, what="4 s in the queue")
        queued_messages = canary.messages  # nothing from decode while the batch stays full
        load = (decode.engine.running, decode.engine.waiting)
        assert load == (4, 1) and all(r.code is None for r in longs), [(r.code, r.finish_reason) for r in longs]
        assert canary.code is None, (canary.code, canary.finish_reason)
        longs[0].cancel()
        freed = time.monotonic()
        wait_until(lambda: canary.messages > 1 or canary.code is not None, timeout=60, what="the canary decoding")
        admitted = time.monotonic() - freed
        canary.join(60)
        print(
            f"canary: first token {first * 1e3:.0f} ms (prefill's), queued behind {load[0]} running; "
            f"first decode token {admitted * 1e3:.0f} ms after a slot freed; {len(canary.tokens)} tokens"
        )
        assert queued_messages == 1, [(r.code, r.finish_reason, len(r.tokens)) for r in longs]
        assert canary.code is grpc.StatusCode.OK and len(canary.tokens) == 16
        assert all(r.code is None for r in longs[1:]), "a running stream was preempted"
        for r in longs:
            r.cancel()
        wait_until(lambda: decode.engine.load == 0, timeout=60, what="decode idle")


def start_decode(port: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "decode_node",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--metrics-port",
            "-1",
            *flags,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_sigterm_of_decode_drains_its_streams(pair):
    """SIGTERM: decode stops taking calls and finishes the ones it has within --grace-seconds;
    prefill goes NOT_SERVING while they drain, and those streams end OK with every token."""
    port = free_port()
    # 300 tokens end well within it even on a loaded 2-core machine. (The decode process used to
    # abort at exit in a few runs in 20, whatever the grace: "terminate called without an active
    # exception", rc -6, after every stream ended OK; tests/nodes/test_shutdown.py says why.)
    grace = 10
    decode = start_decode(port, "--grace-seconds", str(grace), "--max-batch", "4")
    config = PrefillNodeConfig(decode_addr=f"127.0.0.1:{port}", host="127.0.0.1", port=0, metrics_port=None)
    try:
        with run_prefill(config, lambda: pair) as prefill, Client(f"127.0.0.1:{prefill.port}") as client:
            wait_until(lambda: prefill.peer.compatible, timeout=60, what="decode subprocess up")
            n_tokens = 300
            readers = [Reader(client.stream("import ", max_new_tokens=n_tokens, seed=i, timeout=60)) for i in range(4)]
            wait_until(lambda: all(r.messages >= 2 for r in readers), timeout=60, what="streams decoding")
            decode.send_signal(signal.SIGTERM)
            term = time.monotonic()
            not_serving = None
            while time.monotonic() - term < grace + 5 and not (not_serving and all(r.code for r in readers)):
                if not_serving is None and health_status(prefill.port) == NOT_SERVING:
                    not_serving = time.monotonic() - term
                time.sleep(0.02)
            for r in readers:
                r.join(grace + 5)
            last_done = max(r.ended_at for r in readers) - term
            decode.wait(grace + 5)
            exited = time.monotonic() - term
            print(
                f"SIGTERM: prefill NOT_SERVING after {not_serving}s, streams done {last_done:.2f}s, "
                f"decode exited {exited:.2f}s (rc {decode.returncode}); "
                f"{[(r.code.name, r.finish_reason, len(r.tokens)) for r in readers]}"
            )
            # Each ends OK by itself: at the length, or at an EOS its seed sampled earlier.
            assert all(r.code is grpc.StatusCode.OK for r in readers)
            assert all(
                (r.finish_reason, len(r.tokens)) == ("length", n_tokens)
                or (r.finish_reason == "stop" and r.tokens[-1] in pair.target.eos_token_ids)
                for r in readers
            ), [(r.finish_reason, len(r.tokens)) for r in readers]
            assert not_serving is not None and not_serving < last_done, (not_serving, last_done)
            assert last_done < grace and decode.returncode == 0
            with pytest.raises(grpc.RpcError) as err:
                client.generate("def ", max_new_tokens=4, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        decode.kill()
        decode.wait()


def test_prefill_killed_mid_stream_frees_the_decode_slot(pair):
    config = DecodeNodeConfig(host="127.0.0.1", port=0, metrics_port=None, engine=SMALL)
    with run_decode(config, lambda: pair) as decode:
        port = free_port()
        command = [sys.executable, "-m", "prefill_node", "--decode-addr", f"127.0.0.1:{decode.port}"]
        command += ["--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1", "--http-port", "-1"]
        prefill = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            wait_until(lambda: health_status(port) == SERVING, timeout=60, what="prefill subprocess up")
            with Client(f"127.0.0.1:{port}") as client:
                readers = [Reader(client.stream("import ", max_new_tokens=LONG, seed=i, timeout=60)) for i in range(3)]
                wait_until(lambda: all(r.messages >= 3 for r in readers), timeout=60, what="streams decoding")
                assert decode.engine.load == 3
                prefill.kill()
                killed = time.monotonic()
                # Freed by the broken connection, not by the calls' 60 s deadline.
                wait_until(lambda: decode.engine.load == 0, timeout=30, what="decode slots freed")
                freed = time.monotonic() - killed
                for r in readers:
                    r.join(30)
                heard = max(r.ended_at for r in readers) - killed
                print(f"prefill killed: decode slots freed after {freed:.3f}s, clients heard {heard:.3f}s")
                assert {r.code for r in readers} == {grpc.StatusCode.UNAVAILABLE}
                assert heard < 30
        finally:
            prefill.kill()
            prefill.wait()


def test_a_client_that_stops_reading(pair):
    """A client with a fixed 64 KiB window (no BDP probing) reads one message and stops for 5 s.
    Decode does not slow down: the engine runs to max_new_tokens (bounded by the 4096 limit),
    the tokens wait in gRPC buffers; the relay watchdog does not take the reader's flow control
    for a stalled decode node (before the fix: UNAVAILABLE after 3 s and the peer suspected)."""
    with cluster(pair, SMALL) as (_, prefill, decode):
        channel = grpc.insecure_channel(f"127.0.0.1:{prefill.port}", options=[("grpc.http2.bdp_probe", 0)])
        stub = pdspec_pb2_grpc.PrefillServiceStub(channel)
        request = pdspec_pb2.GenerateRequest(
            request_id="slow-" + "x" * 200,
            prompt="import ",
            sampling=pdspec_pb2.SamplingParams(do_sample=True, seed=3, max_new_tokens=LONG, logprobs=5),
        )
        stream = stub.Generate(request, timeout=60)
        read = len(next(stream).token_ids)
        ahead, suspected = 0, False
        for _ in range(50):
            time.sleep(0.1)
            active = list(decode.engine._active)
            if active:
                ahead = max(ahead, active[0].seq.generated - read)
            suspected |= not prefill.peer.compatible
        size, code = 0, grpc.StatusCode.OK
        try:
            for response in stream:
                read += len(response.token_ids)
                size += response.ByteSize()
        except grpc.RpcError as err:
            code = err.code()
        channel.close()
        print(
            f"slow consumer: engine {ahead} tokens ahead of the reader after 5 s; "
            f"{read} tokens read, {size / 1024:.0f} KiB, {code.name}"
        )
        assert code is grpc.StatusCode.OK and read == LONG
        assert 0 < ahead <= LONG and not suspected
        assert decode.engine.load == 0


def _rss_kib() -> int:
    with open(f"/proc/{os.getpid()}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _threads(*shells) -> int:
    """This process's Python threads, less those of the `shells`' worker pools, which are
    bounded and never exit (they are checked apart). gRPC C-core's own thread pool is not
    counted: it grows under load and reaps idle threads on its own timer (tens of seconds
    on a loaded machine), which says nothing about pdspec."""
    return threading.active_count() - sum(_pooled(shell) for shell in shells)


def _pooled(shell) -> int:
    return sum(thread.name.startswith(f"{shell.thread_prefix}_") for thread in threading.enumerate())


def test_rss_and_threads_flat_after_cancels_and_deadlines(pair):
    with cluster(pair, DecodeConfig(max_batch=8, max_queue=64)) as (client, prefill, decode):

        def one(i: int) -> grpc.StatusCode:
            if i % 2:
                stream = client.stream("import ", max_new_tokens=LONG, seed=i, timeout=0.001 + (i % 50) / 1000)
            else:
                stream = client.stream("import ", max_new_tokens=LONG, seed=i, timeout=30)
                next(stream)
                stream.cancel()
            return drain(stream)

        def storm(n: int, offset: int) -> set:
            with futures.ThreadPoolExecutor(16) as pool:
                codes = set(pool.map(one, range(offset, offset + n)))
            wait_until(lambda: decode.engine.load == 0, timeout=5, what="decode idle")
            gc.collect()
            return codes

        # Warm-up: caches fill; then they hold still. The nodes' worker pools grow on demand up
        # to their bound and keep their threads, so they are counted apart: within their bound,
        # whatever the storm's timing.
        shells = (prefill.shell, decode.shell)
        sizes = []
        for round_ in range(4):
            storm(200, 200 * round_)
            sizes.append(_threads(*shells))
            if len(sizes) > 1 and sizes[-1] <= sizes[-2]:
                break
        rss0, threads0 = _rss_kib(), _threads(*shells)
        codes = storm(400, 1000)
        # A thread a call started ends after the call: wait for the count to come back (a leak
        # never does), then measure.
        wait_until(lambda: _threads(*shells) <= threads0 * 1.10, timeout=60, what="the storm's threads to exit")
        gc.collect()
        rss1, threads1 = _rss_kib(), _threads(*shells)
        pools = {shell.thread_prefix: (_pooled(shell), shell.pool_threads) for shell in shells}
        print(
            f"400 cancels/deadlines: RSS {rss0 // 1024} -> {rss1 // 1024} MiB, threads outside the pools "
            f"{threads0} -> {threads1} (warm-up {sizes}), pools (threads, bound) {pools}"
        )
        assert codes <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED}
        assert rss1 <= rss0 * 1.10 and threads1 <= threads0 * 1.10, (rss0, rss1, threads0, threads1)
        assert all(0 < threads <= bound for threads, bound in pools.values()), pools
        wait_until(lambda: prefill.service.in_flight == 0, timeout=10, what="prefill calls ended")
        assert decode.engine.load == 0
