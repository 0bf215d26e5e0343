"""Prometheus metrics of both nodes (docs/design.md §4: fixed names), one label schema.

Each node owns a `NodeMetrics` with its own CollectorRegistry, so two nodes can run in
one process (tests) and each /metrics page shows only its node's series.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterable, Sequence

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
)
from prometheus_client.exposition import choose_encoder

from protos.constraint import KINDS

log = logging.getLogger(__name__)

DO_SAMPLE = ("false", "true")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# First tokens and gaps between tokens take milliseconds: resolve them.
# A grammar's masks for one step: tens of microseconds per context.
MASK_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)
FAST_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class NodeMetrics:
    def __init__(
        self,
        node: str,
        max_speculative_tokens: int,
        fields: Iterable[str] = (),
        methods: Iterable[str] = (),
        sources: Iterable[str] = (),
    ) -> None:
        """`fields`, `methods`, `sources`: the label values pre-initialised to 0 (validation
        fields, speculative methods, proposal sources)."""
        self.node = node
        self.registry = CollectorRegistry()
        reg = self.registry
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):  # process_*, python_*
            reg.register(collector)
        self.verify_steps = Counter("pdspec_spec_verify_steps", "Speculative verify steps", ["do_sample"], registry=reg)
        self.draft_tokens = Counter("pdspec_spec_draft_tokens", "Draft tokens verified", ["do_sample"], registry=reg)
        self.accepted_tokens = Counter(
            "pdspec_spec_accepted_tokens", "Accepted draft tokens", ["do_sample"], registry=reg
        )
        self.emitted_tokens = Counter(
            "pdspec_spec_emitted_tokens",
            "Tokens emitted by verify steps (accepted drafts plus the recovered or bonus token)",
            ["do_sample"],
            registry=reg,
        )
        self.accepted_per_position = Counter(
            "pdspec_spec_accepted_tokens_per_position",
            "Accepted draft tokens by 0-based draft position",
            ["do_sample", "position"],
            registry=reg,
        )
        self.accepted_per_rank = Counter(
            "pdspec_spec_accepted_tokens_per_rank",
            "Accepted draft tokens by rank among their sibling candidates (0 = drawn first; chains: 0)",
            ["do_sample", "rank"],
            registry=reg,
        )
        self.accept_length = Histogram(
            "pdspec_spec_accept_length",
            "Emitted tokens per verify step",
            ["do_sample"],
            buckets=tuple(range(1, max_speculative_tokens + 2)),
            registry=reg,
        )
        # By proposal source (draft = the draft model, prompt-lookup), beside the do_sample series.
        self.source_draft_tokens = Counter(
            "pdspec_spec_source_draft_tokens", "Draft tokens verified, by what proposed them", ["source"], registry=reg
        )
        self.source_accepted_tokens = Counter(
            "pdspec_spec_source_accepted_tokens",
            "Accepted draft tokens, by what proposed them",
            ["source"],
            registry=reg,
        )
        self.chosen_k = Histogram(
            "pdspec_spec_chosen_k",
            "Draft tokens chosen per request per decode step (adaptive K; 0 = none), by speculative method",
            ["method"],
            buckets=tuple(range(0, max_speculative_tokens + 1)),
            registry=reg,
        )
        self.requests = Counter(
            "pdspec_requests", "Requests by node and final gRPC status code", ["node", "code"], registry=reg
        )
        self.request_latency = Histogram(
            "pdspec_request_latency_seconds", "Request latency", ["node"], buckets=LATENCY_BUCKETS, registry=reg
        )
        self.time_to_first_token = Histogram(
            "pdspec_time_to_first_token_seconds",
            "Time from request arrival to its first streamed token",
            ["node"],
            buckets=FAST_BUCKETS,
            registry=reg,
        )
        self.proposal_bytes = Counter(
            "pdspec_proposal_bytes",
            "Serialized proposal bytes (sent by prefill, received by decode)",
            ["node", "encoding"],
            registry=reg,
        )
        self.kv_bytes = Counter("pdspec_kv_bytes", "KV-cache payload bytes transferred", ["node"], registry=reg)
        self.validation_rejections = Counter(
            "pdspec_validation_rejections", "Rejected requests by offending field", ["node", "field"], registry=reg
        )
        self.http_requests = Counter(
            "pdspec_http_requests",
            "HTTP API requests by route template (other: no route) and HTTP status code, refusals included",
            ["route", "code"],
            registry=reg,
        )
        self.generated_tokens = Counter("pdspec_generated_tokens", "Tokens streamed to clients", ["node"], registry=reg)
        self.prompt_tokens = Counter(
            "pdspec_prompt_tokens", "Prompt tokens of admitted requests", ["node"], registry=reg
        )
        self.preemptions = Counter(
            "pdspec_preemptions",
            "Decode: running requests that gave their batch slot up to waiting ones (recomputed when resumed)",
            ["node"],
            registry=reg,
        )
        self.running = Gauge("pdspec_running_requests", "Requests in the running batch", ["node"], registry=reg)
        self.waiting = Gauge("pdspec_waiting_requests", "Requests waiting for a batch slot", ["node"], registry=reg)
        self.inter_token_latency = Histogram(
            "pdspec_inter_token_latency_seconds",
            "Time between consecutive streamed messages of a request, per token they carry",
            ["node"],
            buckets=FAST_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "pdspec_queue_time_seconds",
            "Time a request waited before its first engine step",
            ["node"],
            buckets=FAST_BUCKETS,
            registry=reg,
        )
        self.engine_step = Histogram(
            "pdspec_engine_step_seconds",
            "Wall time of one engine step (prefill: prompt chunks, first tokens, proposals, KV exports;"
            " decode: drafting, verify, emitting)",
            ["node"],
            buckets=FAST_BUCKETS,
            registry=reg,
        )
        self.structured_requests = Counter(
            "pdspec_structured_output_requests",
            "Requests with a structured-output constraint, by its kind",
            ["node", "kind"],
            registry=reg,
        )
        self.grammar_mask_seconds = Histogram(
            "pdspec_grammar_mask_seconds",
            "Time computing one constrained row's grammar masks for a step (every context of its proposal)",
            ["node"],
            buckets=MASK_BUCKETS,
            registry=reg,
        )
        self.grammar_rejected_drafts = Counter(
            "pdspec_grammar_rejected_drafts", "Draft tokens the grammar forbade", ["node"], registry=reg
        )
        self.jump_forward_tokens = Counter(
            "pdspec_grammar_jump_forward_tokens",
            "Tokens the grammar forced, proposed as free drafts (jump-forward)",
            ["node"],
            registry=reg,
        )
        self.node_info = Info("pdspec_node", "The node: role, version, models, device, backends", registry=reg)
        self._preinitialise(max_speculative_tokens, fields)
        for source in sources:
            self.source_draft_tokens.labels(source)
            self.source_accepted_tokens.labels(source)
        for method in methods:
            self.chosen_k.labels(method)
        # Bound once: every streamed message records these (a labels() lookup costs ~2.5 µs, per
        # message per stream, on the host path of every decode step)
        self._ttft = self.time_to_first_token.labels(node)
        self._itl = self.inter_token_latency.labels(node)
        self._generated = self.generated_tokens.labels(node)
        # and every verified row of every decode step its do_sample label's series, on the engine
        # thread: (verify steps, draft, accepted, emitted tokens, accept length), and the accepted
        # tokens of positions 0..max_k-1
        self._spec = {
            label: (
                tuple(
                    f.labels(label)
                    for f in (
                        self.verify_steps,
                        self.draft_tokens,
                        self.accepted_tokens,
                        self.emitted_tokens,
                        self.accept_length,
                    )
                ),
                [self.accepted_per_position.labels(label, str(p)) for p in range(max_speculative_tokens)],
            )
            for label in DO_SAMPLE
        }
        self._children: dict[tuple, object] = {}  # (family, *labels) -> child, bound on first use
        # Counts of the verified rows of the steps not yet delivered, added up per counter and
        # published by `flush`: one locked increment per counter and step, not several per row.
        self._pending: dict[object, float] = {}

    def _preinitialise(self, max_k: int, fields: Iterable[str]) -> None:
        for do_sample in DO_SAMPLE:
            for family in (
                self.verify_steps,
                self.draft_tokens,
                self.accepted_tokens,
                self.emitted_tokens,
                self.accept_length,
            ):
                family.labels(do_sample)
            for position in range(max_k):
                self.accepted_per_position.labels(do_sample, str(position))
        for code in (
            "OK",
            "INVALID_ARGUMENT",
            "FAILED_PRECONDITION",
            "RESOURCE_EXHAUSTED",
            "UNAVAILABLE",
            "CANCELLED",
            "DEADLINE_EXCEEDED",
            "INTERNAL",
            "UNKNOWN",
            "UNAUTHENTICATED",
        ):
            self.requests.labels(self.node, code)
        self.request_latency.labels(self.node)
        self.time_to_first_token.labels(self.node)
        self.kv_bytes.labels(self.node)
        self.generated_tokens.labels(self.node)
        for family in (
            self.prompt_tokens,
            self.preemptions,
            self.running,
            self.waiting,
            self.inter_token_latency,
            self.queue_time,
        ):
            family.labels(self.node)
        for encoding in ("dense", "point-mass", "sparse"):
            self.proposal_bytes.labels(self.node, encoding)
        for name in fields:
            self.validation_rejections.labels(self.node, name)
        for kind in KINDS:
            self.structured_requests.labels(self.node, kind)
        for family in (self.grammar_mask_seconds, self.grammar_rejected_drafts, self.jump_forward_tokens):
            family.labels(self.node)

    def record_step(
        self, do_sample: bool, num_draft: int, accepted: int, emitted: int, ranks: Sequence[int] = ()
    ) -> None:
        """One row of one verify step (num_draft: draft tokens or tree nodes; ranks: of each
        accepted node among its siblings); K = 0 steps verify nothing and are not recorded."""
        if num_draft == 0:
            return
        label = DO_SAMPLE[int(do_sample)]
        (steps, drafts, accepts, emits, length), positions = self._spec[label]
        pending = self._pending
        for child, amount in ((steps, 1), (drafts, num_draft), (accepts, accepted), (emits, emitted)):
            pending[child] = pending.get(child, 0) + amount
        for position in range(accepted):  # a tree may go deeper than --max-speculative-tokens
            child = positions[position] if position < len(positions) else None
            child = child or self._child(self.accepted_per_position, label, str(position))
            pending[child] = pending.get(child, 0) + 1
        for rank in ranks:
            child = self._child(self.accepted_per_rank, label, str(rank))
            pending[child] = pending.get(child, 0) + 1
        length.observe(emitted)

    def record_source(self, source: str, num_draft: int, accepted: int) -> None:
        """The same row by what proposed it (engine/proposer.py: draft or prompt-lookup)."""
        if num_draft:
            pending = self._pending
            for child, amount in (
                (self._child(self.source_draft_tokens, source), num_draft),
                (self._child(self.source_accepted_tokens, source), accepted),
            ):
                pending[child] = pending.get(child, 0) + amount

    def flush(self) -> None:
        """Publish the counts `record_step` and `record_source` added up since the last flush
        (the decode engine flushes each time before it hands events to their streams: a client
        that has its tokens sees them counted)."""
        pending, self._pending = self._pending, {}
        for child, amount in pending.items():
            if amount:
                child.inc(amount)

    def record_chosen(self, method: str, depth: int) -> None:
        """The draft tokens one row's step chose (adaptive K), by speculative method."""
        self._child(self.chosen_k, method).observe(depth)

    def _child(self, family, *labels: str):
        """`family.labels(*labels)`, looked up once (a labels() lookup costs ~2 µs, several per
        verified row of every step): a child is never removed, and two threads binding one at
        once get the same child from the family."""
        key = (id(family), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*labels)
        return child

    def record_grammar(self, mask_seconds: Iterable[float], rejected_drafts: int, jump_forward_tokens: int) -> None:
        """A constrained request's structured-output work on this node, at its end: the time of
        each step's masks, the drafts its grammar forbade, the forced tokens it proposed."""
        histogram = self.grammar_mask_seconds.labels(self.node)
        for seconds in mask_seconds:
            histogram.observe(seconds)
        self.grammar_rejected_drafts.labels(self.node).inc(rejected_drafts)
        self.jump_forward_tokens.labels(self.node).inc(jump_forward_tokens)

    def streamed(self, tokens: int, elapsed: float, first: bool) -> None:
        """One message of `tokens` tokens streamed `elapsed` seconds after the request's previous
        one (after its arrival for the `first`): the time to first token, or the gap per token."""
        if first:
            self._ttft.observe(elapsed)
        elif tokens:
            gap = elapsed / tokens
            for _ in range(tokens):
                self._itl.observe(gap)
        self._generated.inc(tokens)

    def finish_request(self, started: float, code: str) -> None:
        """Count one finished request by final status code and record its latency."""
        self.requests.labels(self.node, code).inc()
        self.request_latency.labels(self.node).observe(time.monotonic() - started)

    def serve(self, port: int, host: str = "0.0.0.0") -> MetricsServer:
        """Expose /metrics on `host`:`port` (0 = any free port); returns the running server."""
        return MetricsServer(self.registry, host, port)


class MetricsServer:
    """/metrics from one thread whatever the number of connections (prometheus_client's
    start_http_server spawns a thread per connection: idle connections pile up threads).

    An asyncio loop in one daemon thread: idle connections cost a socket, not a thread; a
    request head must arrive within `head_timeout_s` and fit in 8 KiB, at most
    `max_connections` are open at once (more are closed at once), every response closes its
    connection. GET or HEAD of /metrics (any query; every other path is 404); the exposition
    format follows the Accept header (Prometheus text or OpenMetrics)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        *,
        max_connections: int = 256,
        head_timeout_s: float = 5.0,
    ) -> None:
        self.registry = registry
        self.max_connections, self.head_timeout_s = max_connections, head_timeout_s
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        self.socket = socket.create_server((host, port), family=family)
        self.server_port = self.socket.getsockname()[1]
        self.open = 0
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, sock=self.socket, limit=8192))
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self._loop.run_until_complete(server.wait_closed())
            self._loop.close()

    def shutdown(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        try:
            if self.open <= self.max_connections:
                await self._respond(reader, writer)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            pass  # a client that left, stalled or sent junk: nothing to answer
        except Exception:
            log.exception("/metrics request failed")
        finally:
            self.open -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _respond(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.head_timeout_s)
        lines = head.decode("latin-1").split("\r\n")
        method, target, _version = lines[0].split(" ", 2)
        headers = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
        accept = next((v.strip() for k, v in headers.items() if k.strip().lower() == "accept"), "")
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET /metrics\n"
        elif path != "/metrics":
            status, ctype, body = "404 Not Found", "text/plain", b"GET /metrics\n"
        else:
            encoder, ctype = choose_encoder(accept)
            status, body = "200 OK", encoder(self.registry)
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        if method != "HEAD":
            writer.write(body)
        await writer.drain()


class SummaryLogger:
    """Every `interval` seconds while there is traffic, one INFO line of what the node did
    (vLLM-style): tokens/s, requests finished, running/waiting, draft acceptance by do_sample."""

    def __init__(self, metrics: NodeMetrics, interval: float) -> None:
        self.metrics, self.interval = metrics, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{metrics.node}-summary", daemon=True)
        self._last = self._read()

    def start(self) -> None:
        if self.interval > 0:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _read(self) -> dict[str, float]:
        get, node = self.metrics.registry.get_sample_value, self.metrics.node
        out = {
            "tokens": get("pdspec_generated_tokens_total", {"node": node}) or 0.0,
            "requests": sum(
                get("pdspec_requests_total", {"node": node, "code": code}) or 0.0
                for code in ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")
            ),
        }
        for label in DO_SAMPLE:
            out[f"draft_{label}"] = get("pdspec_spec_draft_tokens_total", {"do_sample": label}) or 0.0
            out[f"accepted_{label}"] = get("pdspec_spec_accepted_tokens_total", {"do_sample": label}) or 0.0
        return out

    def line(self, now: dict[str, float], seconds: float) -> str:
        get, node = self.metrics.registry.get_sample_value, self.metrics.node
        delta = {k: now[k] - self._last[k] for k in now}
        acceptance = ", ".join(
            f"do_sample={label} {delta[f'accepted_{label}'] / delta[f'draft_{label}']:.1%}"
            for label in DO_SAMPLE
            if delta[f"draft_{label}"]
        )
        return (
            f"{delta['tokens'] / seconds:.1f} tokens/s, {delta['requests']:.0f} requests ended, "
            f"running {get('pdspec_running_requests', {'node': node}) or 0:.0f}, "
            f"waiting {get('pdspec_waiting_requests', {'node': node}) or 0:.0f}"
            + (f", draft acceptance {acceptance}" if acceptance else "")
        )

    def _run(self) -> None:
        started = time.monotonic()
        while not self._stop.wait(self.interval):
            now, ended = self._read(), time.monotonic()
            if now != self._last:
                log.info("%s", self.line(now, ended - started))
            self._last, started = now, ended
