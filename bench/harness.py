"""What the bench scripts share: the environment and the results file, timing, concurrent
requests, random-weight models of real shapes, and nodes started on loopback.

The project's packages are imported inside the functions that use them: bench/batch_meta.py
--root times another checkout's engine, which it puts first on sys.path after importing this.
bench does not import tests (nor tests bench): tests/nodes/conftest.py has its own nodes."""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

import grpc
import torch

if TYPE_CHECKING:
    from decode_node.engine import DecodeConfig
    from engine.paged_lm import PagedLlamaLM
    from models.llama import LlamaCausalLM, LlamaConfig
    from models.pair import ModelPair
    from pdspec.modelspec import ModelSpec
    from prefill_node.engine import PrefillConfig

T = TypeVar("T")
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LOOPBACK = "127.0.0.1"


# --- the environment and the results file -------------------------------------------------


_SECRET = re.compile("KEY|TOKEN|SECRET|PASSWORD|CERT", re.IGNORECASE)  # never written into a results file


def environment() -> dict[str, str]:
    """What a figure depends on besides the code: the machine, the versions, the commit, when,
    and the command line that made it, with the PDSPEC_* variables it ran under (the nodes'
    flag defaults: `pdspec serve` passes them on), secrets left out."""
    settings = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("PDSPEC_") and not _SECRET.search(k)]
    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit(),
        "command": shlex.join([*settings, Path(sys.executable).name, *sys.argv]),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_model(),
        "cpu_cores": str(os.cpu_count()),
        "cpu_threads": str(torch.get_num_threads()),
    }
    for package in ("grpcio", "protobuf", "transformers"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            env[package] = importlib.metadata.version(package)
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["gpus"] = str(torch.cuda.device_count())
        env["cuda"] = str(torch.version.cuda or torch.version.hip)
    try:
        import cupy  # its distribution's name says the CUDA version (cupy-cuda13x...): ask the module

        env["cupy"] = cupy.__version__
    except ImportError:
        pass
    return env


def commit(tree: Path = ROOT) -> str:
    """`tree`'s commit: git's short sha, with `-dirty` when it has uncommitted changes. Where the
    tree was copied without .git (the GPU machine) PDSPEC_COMMIT names this checkout's, and
    `.carry/commit` any tree's, as `bench/gpu_check.py --prep` wrote it."""
    if tree == ROOT and os.environ.get("PDSPEC_COMMIT"):
        return os.environ["PDSPEC_COMMIT"]
    top = _git(tree, "rev-parse", "--show-toplevel")
    if top is not None and Path(top).resolve() == tree.resolve():  # not a folder inside another checkout
        return _git(tree, "rev-parse", "--short", "HEAD") + ("-dirty" if _git(tree, "status", "--porcelain") else "")
    carried = tree / ".carry" / "commit"
    return carried.read_text().strip() if carried.is_file() else "unknown"


def results_dir() -> Path:
    """bench/results, or PDSPEC_RESULTS (bench/gpu_check.py gathers its steps' files there)."""
    return Path(os.environ.get("PDSPEC_RESULTS") or RESULTS)


def write_results(
    name: str, env: dict[str, str], rows: list[dict] | dict, table: str, directory: Path | None = None
) -> Path:
    """`<name>-<GPU or cpu>-<date>-<commit>.json` in `directory` (default results_dir()): one
    file per run, never overwritten by another commit's."""
    directory = directory or results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    tag = env.get("gpu", "cpu").replace(" ", "-")
    path = directory / f"{name}-{tag}-{env['date'][:10]}-{env['commit']}.json"
    path.write_text(json.dumps({"environment": env, "rows": rows, "table": table}, indent=2) + "\n")
    return path


def report(
    name: str,
    env: dict[str, str],
    rows: list[dict] | dict,
    text: str,
    *,
    keep: bool = True,
    json_path: Path | None = None,
) -> None:
    """A run's end: its tables printed, its rows written to `json_path` when asked, and its
    results file unless `keep` is False (a --smoke run checks the script: no figures kept)."""
    print(text)
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=2) + "\n")
    if keep:
        print("wrote", write_results(name, env, rows, text))


def markdown_table(header: list[str], rows: list[list[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _git(tree: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=tree)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def gil_holders(pid: int, seconds: int, rate: int = 250, top: int = 20) -> dict:
    """Who holds process `pid`'s GIL (py-spy's --gil sampling for `seconds`): the share of the
    nominal seconds x rate samples in which any thread held it (low if py-spy fell behind), and
    the functions (inclusive) those samples were in, as a share of them. Needs the py-spy
    executable (pip install py-spy) and the right to ptrace `pid`."""
    spy = shutil.which("py-spy")
    if spy is None:
        raise RuntimeError("py-spy: expected on PATH (pip install py-spy), got none")
    with tempfile.NamedTemporaryFile(suffix=".txt") as out:
        cmd = [spy, "record", "--gil", "--nonblocking", "-f", "raw", "-r", str(rate), "-d", str(seconds)]
        done = subprocess.run([*cmd, "-p", str(pid), "-o", out.name], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"py-spy on pid {pid}: exit {done.returncode}: {done.stderr.strip()[-300:]}")
        lines = Path(out.name).read_text().splitlines()
    held, inclusive = 0, collections.Counter()
    for line in lines:
        stack, count = line.rsplit(" ", 1)
        held += int(count)
        for frame in {re.sub(r":\d+\)$", ")", f) for f in stack.split(";")}:  # each function once per sample
            inclusive[frame] += int(count)
    return {
        "gil_held": held / (seconds * rate),
        "functions": [(frame, n / held) for frame, n in inclusive.most_common(top)] if held else [],
    }


class _MallInfo2(ctypes.Structure):
    _fields_: ClassVar = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _mallinfo2():
    try:
        function = ctypes.CDLL("libc.so.6").mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


_MALLINFO2 = _mallinfo2()


def heap_in_use() -> int | None:
    """Bytes the process has allocated and not freed, by glibc's count (every malloc: torch,
    numpy, gRPC, Python alike), or None without glibc's mallinfo2. Unlike RSS it does not
    count memory freed but kept by the allocator."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return info.uordblks + info.hblkhd


# --- timing -------------------------------------------------------------------------------


def sync(device: str | torch.device | None) -> None:
    """Wait for the device's queued work: a host clock read after it counts that work."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def median_time(
    fn: Callable[[], object], repeat: int = 15, *, warmup: int = 3, device: str | None = None, events: bool = False
) -> float:
    """Median seconds of fn() over `repeat` calls, after `warmup` untimed ones (module loads,
    compilation, graph capture stay out). On a GPU (`device`) each call is synchronized;
    `events`: timed by CUDA events around it, the device's time alone, not the launch's."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(repeat):
        if events:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def graph_of(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (warmed up on a side stream first, as capture requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        fn()
    torch.cuda.synchronize()
    return graph


def graph_us(fn: Callable[[], object]) -> float:
    """Median µs of a CUDA-graph replay of fn, L2 flushed before each (triton's do_bench)."""
    from triton.testing import do_bench

    return 1e3 * do_bench(graph_of(fn).replay, warmup=25, rep=200, return_mode="median")


def eager_us(fn: Callable[[], object], calls: int = 200, trials: int = 7) -> float:
    """Back-to-back calls from Python, one sync per trial: median per-call wall time, µs."""
    return 1e6 * median_time(lambda: [fn() for _ in range(calls)], trials, warmup=1, device="cuda") / calls


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device copy, read + write counted."""
    n = (1 << 30) if torch.device(device).type == "cuda" else (64 << 20)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    seconds = median_time(lambda: dst.copy_(src), 10, warmup=1, device=device)
    return 2 * n / seconds


def percentile(values: list[float], q: float) -> float | None:
    """The nearest-rank `q` quantile (0..1), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


# --- concurrent requests ------------------------------------------------------------------


def concurrently(fn: Callable[[int], T], n: int, workers: int | None = None) -> tuple[list[T], float]:
    """fn(0) .. fn(n - 1) on `workers` threads (default n: all at once): their results in order
    and the wall seconds from the first start to the last end. A call's exception is raised here."""
    with ThreadPoolExecutor(workers or n) as pool:
        start = time.perf_counter()
        results = list(pool.map(fn, range(n)))
        return results, time.perf_counter() - start


@dataclass
class Stream:
    """One streamed request as its client saw it (times are time.perf_counter's)."""

    started: float
    arrivals: list[float] = field(default_factory=list)  # each message's
    sizes: list[int] = field(default_factory=list)  # the tokens each message carried
    tokens: list[int] = field(default_factory=list)
    stats: Any = None  # the final message's RequestStats
    finish_reason: str = ""
    code: grpc.StatusCode | None = None  # how it ended, None while it runs
    ended: float | None = None

    @property
    def ttft(self) -> float:
        """Seconds to the first message (the prefill node's token)."""
        return self.arrivals[0] - self.started

    def token_times(self) -> list[float]:
        """Seconds from the start to each token's arrival."""
        return [at - self.started for at, n in zip(self.arrivals, self.sizes, strict=True) for _ in range(n)]

    def checked(self) -> Stream:
        """This stream, once it ended OK (a bench's figures need every request it sent)."""
        if self.code != grpc.StatusCode.OK:
            raise RuntimeError(f"stream: expected OK, got {self.code} after {len(self.tokens)} tokens")
        return self

    def gaps(self) -> list[tuple[float, float, int]]:
        """(since, until, tokens) of each message after the first that carried tokens: its wait
        since the message before it (the decode node's inter-token latency, over `tokens`)."""
        return [
            (self.arrivals[i - 1], self.arrivals[i], self.sizes[i])
            for i in range(1, len(self.arrivals))
            if self.sizes[i]
        ]


def read(call, into: Stream | None = None) -> Stream:
    """A response stream (a client's `stream(...)` or a stub's call) read to its end."""
    out = into or Stream(time.perf_counter())
    try:
        for response in call:
            out.arrivals.append(time.perf_counter())
            out.sizes.append(len(response.token_ids))
            out.tokens += response.token_ids
            if response.finished:
                out.stats, out.finish_reason = response.stats, response.finish_reason
        out.code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        out.code = err.code()
    out.ended = time.perf_counter()
    return out


class Reader:
    """A response stream read on its own thread; `stream` is what has arrived so far."""

    def __init__(self, call, started: float | None = None) -> None:
        self.call, self.stream = call, Stream(started or time.perf_counter())
        self.thread = threading.Thread(target=read, args=(call, self.stream), daemon=True)
        self.thread.start()

    def cancel(self) -> None:
        self.call.cancel()


def drain(call) -> grpc.StatusCode:
    """A response stream of any message type read to its end: the status it ended with."""
    try:
        for _ in call:
            pass
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


# --- random-weight models of real shapes --------------------------------------------------

SHAPES = {
    "llama3-8b": dict(hidden=4096, layers=32, heads=32, kv=8, ffn=14336, vocab=128256, theta=500000.0),
    # SmolLM2-135M-Instruct's shape: a model whose decode step is host-bound on a GPU
    "smollm2-135m": dict(hidden=576, layers=30, heads=9, kv=3, ffn=1536, vocab=49152, theta=100000.0),
    "tinyllama-1.1b": dict(hidden=2048, layers=22, heads=32, kv=4, ffn=5632, vocab=32000, theta=10000.0),
    # a small model whose prefill and KV handoff take comparable time on a CPU (bench/layerwise.py)
    "kv-heavy": dict(hidden=256, layers=8, heads=4, kv=4, ffn=512, vocab=512, theta=10000.0),
    "smoke": dict(hidden=64, layers=2, heads=4, kv=2, ffn=128, vocab=300, theta=10000.0),
}


def config_of(shape: str) -> LlamaConfig:
    from models.llama import LlamaConfig

    s = SHAPES[shape]
    return LlamaConfig.from_hf(
        {
            "model_type": "llama",
            "vocab_size": s["vocab"],
            "hidden_size": s["hidden"],
            "num_hidden_layers": s["layers"],
            "num_attention_heads": s["heads"],
            "num_key_value_heads": s["kv"],
            "intermediate_size": s["ffn"],
            "rms_norm_eps": 1e-5,
            "rope_theta": s["theta"],
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
            "eos_token_id": s["vocab"] - 1,
        }
    )


def dtype_for(device: str) -> torch.dtype:
    """bf16 on a GPU, as served; float32 on the CPU."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def random_model(shape: str, device: str, dtype: torch.dtype | None = None) -> LlamaCausalLM:
    """Random weights straight on the device (std 0.02: finite logits, a real softmax); timing
    does not depend on the weights. The same weights every time (seeded): what a run generates,
    and so when it stops (a row that draws the EOS id), is the same from run to run."""
    from models.llama import LlamaCausalLM, LlamaForCausalLM

    with torch.device(device):
        module = LlamaForCausalLM(config_of(shape)).to(dtype or dtype_for(device))
    generator = torch.Generator(device=module.lm_head.weight.device).manual_seed(0)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return LlamaCausalLM(module.eval(), source_digest=f"random-{shape}")


def random_pair(target: LlamaCausalLM, draft_layers: int = 1) -> ModelPair:
    """`target` with its first `draft_layers` layers as the draft, byte tokens."""
    from models.llama import layer_skip_draft
    from models.pair import ModelPair
    from models.tokenizer import ByteTokenizer
    from sampling import DraftToTargetMap

    draft = layer_skip_draft(target, draft_layers)
    return ModelPair(target, draft, DraftToTargetMap.identity(target.vocab_size), ByteTokenizer())


def weight_bytes(model: LlamaCausalLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.module.parameters())


def bytes_per_token_of(shape: str) -> int:
    """A bfloat16 model's KV bytes per token, before any model of the shape is built."""
    from protos.kv_layout import kv_bytes, layer_kv_layout

    c = config_of(shape)
    return kv_bytes(layer_kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, torch.bfloat16), 1)


def paged(model: LlamaCausalLM, tokens: int, attention: str = "auto") -> PagedLlamaLM:
    """`model` on a KV pool of `tokens` tokens."""
    from engine.paged_lm import PagedLlamaLM, bytes_per_token

    return PagedLlamaLM.with_pool(model, tokens * bytes_per_token(model), attention=attention)


@contextlib.contextmanager
def prefilled_rows(lm: PagedLlamaLM, batch: int, context: int, new: int) -> Iterator[Callable[[], None]]:
    """`batch` rows of `context` random tokens prefilled; yields one() = an extend of `new`
    tokens per row, truncated back after (so it can repeat). Releases the rows at the end."""
    states = []
    for row in range(batch):
        ids = torch.randint(0, lm.vocab_size - 1, (context,), generator=torch.Generator().manual_seed(row)).tolist()
        _, state = lm.prefill(ids)
        lm.reserve(state, context + new)
        states.append(state)
    feed = [[1] * new for _ in range(batch)]

    def one() -> None:
        lm.extend_batch(states, feed)
        for state in states:
            lm.truncate(state, context)

    try:
        yield one
    finally:
        for state in states:
            lm.release(state)


def step_rows(lm: PagedLlamaLM, batch: int, context: int, new: int, device: str, repeat: int) -> float:
    """Median seconds of one extend over `batch` rows of `context` tokens, `new` tokens each."""
    with prefilled_rows(lm, batch, context, new) as one:
        return median_time(one, repeat, warmup=1, device=device)


# --- nodes --------------------------------------------------------------------------------

MAX_PROMPT_TOKENS = 8192  # the GPU benches' prompt limit: 4k-token handoffs, pd_gpus's arrivals
MAX_QUEUE = 256  # the decode node's: every stream of the largest batch admitted or queued
MAX_STREAMS = 512  # the prefill node's concurrent Generate streams


class Nodes(NamedTuple):
    client: Any  # pdspec.client.Client of the prefill node
    prefill: Any  # prefill_node.server.RunningPrefillNode
    decode: Any  # decode_node.server.RunningDecodeNode


@contextlib.contextmanager
def nodes(
    pair: ModelPair | None = None,
    *,
    models: ModelSpec | None = None,
    decode: DecodeConfig | None = None,
    prefill: PrefillConfig | None = None,
    decode_node: dict | None = None,
    prefill_node: dict | None = None,
    engine_factory: Callable | None = None,
    max_message_bytes: int = 64 << 20,
) -> Iterator[Nodes]:
    """A decode and a prefill node in this process on loopback, on ports the OS chooses, and a
    client of the prefill node once it has found its decode peer compatible. `pair`: what both
    nodes serve (None: each loads `models`); `decode`, `prefill`: the engines' configs;
    `decode_node`, `prefill_node`: more fields of the nodes' own configs (metrics_port=0 for a
    /metrics endpoint...); `engine_factory`: builds the decode engine (a recording verifier)."""
    from decode_node.engine import DecodeConfig, DecodeEngine
    from decode_node.server import DecodeNodeConfig
    from decode_node.server import run_server as run_decode
    from pdspec.client import Client
    from pdspec.local import GPU_SHARES
    from pdspec.modelspec import ModelSpec
    from prefill_node.engine import PrefillConfig
    from prefill_node.server import PrefillNodeConfig
    from prefill_node.server import run_server as run_prefill

    models = models or ModelSpec()
    loader = None if pair is None else (lambda: pair)
    common = {"host": LOOPBACK, "port": 0, "metrics_port": None}

    def share(role: str) -> ModelSpec:
        """Both nodes size their KV pools from one device's memory: each takes the launcher's
        share of it (GPU_SHARES), not the whole of `gpu_memory_utilization` each."""
        if models.kv_cache_bytes is not None:
            return models
        return replace(models, gpu_memory_utilization=GPU_SHARES[role])

    config = DecodeNodeConfig(
        **{**common, "models": share("decode"), "engine": decode or DecodeConfig(), **(decode_node or {})}
    )
    with run_decode(config, loader, engine_factory or DecodeEngine) as decode_running:
        peer = {"decode_addr": f"{LOOPBACK}:{decode_running.port}", "peer_check_s": 0.1}
        fields = {**common, **peer, "models": share("prefill"), "engine": prefill or PrefillConfig()}
        config = PrefillNodeConfig(**{**fields, **(prefill_node or {})})
        with run_prefill(config, loader) as prefill_running:
            wait_until(lambda: prefill_running.peer.compatible, 120, "the prefill node's decode peer")
            with Client(f"{LOOPBACK}:{prefill_running.port}", max_message_bytes=max_message_bytes) as client:
                yield Nodes(client, prefill_running, decode_running)


def serving_nodes(
    pair: ModelPair,
    device: str,
    kv_bytes: int,
    *,
    max_batch: int = 64,
    k_max: int = 8,
    law=None,
    prefill_options: dict | None = None,
) -> contextlib.AbstractContextManager[Nodes]:
    """nodes() as the GPU benches serve a pair on one device: each node's KV pool `kv_bytes`,
    prompts up to MAX_PROMPT_TOKENS, K up to `k_max`, `law` the draft law of both (None: their
    default, point mass); `prefill_options`: PrefillConfig fields (default: every KV in the one
    Decode message)."""
    from decode_node.engine import DecodeConfig
    from engine.spec_config import SpeculativeConfig
    from pdspec.modelspec import ModelSpec
    from prefill_node.engine import PrefillConfig
    from protos.validation import RequestLimits

    limits = RequestLimits(max_prompt_tokens=MAX_PROMPT_TOKENS)
    spec = SpeculativeConfig(max_speculative_tokens=k_max, **({} if law is None else {"draft_law": law}))
    return nodes(
        pair,
        models=ModelSpec(device=device, kv_cache_bytes=kv_bytes),
        decode=DecodeConfig(spec=spec, device=device, max_batch=max_batch, max_queue=MAX_QUEUE),
        prefill=PrefillConfig(
            spec=spec, device=device, limits=limits, **prefill_options or {"kv_stream_threshold_bytes": 1 << 40}
        ),
        decode_node={"limits": limits},
        prefill_node={"max_streams": MAX_STREAMS},
        max_message_bytes=1 << 30,
    )


def method_nodes(models: ModelSpec, method: str, max_batch: int) -> contextlib.AbstractContextManager[Nodes]:
    """nodes() loading `models`, both proposing with `method` as `--speculative-method` does
    (adaptive K at its default: on for prompt-lookup and hybrid)."""
    from decode_node.engine import DecodeConfig
    from engine.spec_config import SpeculativeConfig
    from prefill_node.engine import PrefillConfig

    return nodes(
        models=models,
        decode=DecodeConfig(spec=SpeculativeConfig(method=method), max_batch=max_batch, device=models.device),
        prefill=PrefillConfig(spec=SpeculativeConfig(method=method), device=models.device),
    )


def _node_process(role: str, shape: str, device: str, kv_bytes: int, decode_addr: str, ports, stop, options) -> None:
    """One node of a random-weight `shape` in its own process (as deployed: no GIL shared with
    the other node); `options`: spawn_nodes's `shm` and `scheduling`."""
    from decode_node.engine import DecodeConfig
    from decode_node.server import DecodeNodeConfig
    from decode_node.server import run_server as run_decode
    from pdspec.modelspec import ModelSpec
    from prefill_node.engine import KvTransport, PrefillConfig
    from prefill_node.server import PrefillNodeConfig
    from prefill_node.server import run_server as run_prefill
    from protos.validation import RequestLimits

    torch.manual_seed(0)
    pair = random_pair(random_model(shape, device))
    spec = ModelSpec(device=device, kv_cache_bytes=kv_bytes)
    limits = RequestLimits(max_prompt_tokens=MAX_PROMPT_TOKENS)
    if role == "decode":
        config = DecodeNodeConfig(
            host=LOOPBACK,
            port=0,
            metrics_port=0,  # any free port: the bench reads the engine's step times there
            models=spec,
            engine=DecodeConfig(
                device=device, max_batch=64, max_queue=MAX_QUEUE, async_scheduling=options["scheduling"]
            ),
            limits=limits,
            accept_shm_kv=options["shm"],
        )
        context = run_decode(config, lambda: pair)
    else:
        transport = KvTransport.SHM if options["shm"] else KvTransport.GRPC
        config = PrefillNodeConfig(
            decode_addr=decode_addr,
            host=LOOPBACK,
            port=0,
            metrics_port=None,
            models=spec,
            engine=PrefillConfig(device=device, limits=limits, kv_transport=transport),
            peer_check_s=0.1,
            max_streams=MAX_STREAMS,
        )
        context = run_prefill(config, lambda: pair)
    with context as node:
        ports.put((node.port, node.metrics_port))
        stop.wait()


def spawn_nodes(
    shape: str,
    device: str,
    kv_bytes: int,
    *,
    prefill_device: str | None = None,
    shm: bool = False,
    scheduling: str = "auto",
) -> tuple[int, Callable[[], None], dict[str, dict]]:
    """Decode (on `device`) and prefill (on `prefill_device`, default the same) nodes of a
    random-weight `shape`, each in its own process; `shm`: the KV handed over in shared memory
    (--kv-transport shm / --accept-shm-kv); `scheduling`: the decode node's --async-scheduling.
    Returns (the prefill node's port, stop(), each node's process id and the decode node's
    /metrics port)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    stop, ports = ctx.Event(), ctx.Queue()
    options = {"shm": shm, "scheduling": scheduling}
    decode = ctx.Process(target=_node_process, args=("decode", shape, device, kv_bytes, "", ports, stop, options))
    decode.start()
    decode_port, decode_metrics = ports.get(timeout=600)
    prefill_kv = 8200 * 2 * bytes_per_token_of(shape)
    decode_addr = f"{LOOPBACK}:{decode_port}"
    prefill = ctx.Process(
        target=_node_process,
        args=("prefill", shape, prefill_device or device, prefill_kv, decode_addr, ports, stop, options),
    )
    prefill.start()
    prefill_port, _ = ports.get(timeout=600)

    def shutdown() -> None:
        stop.set()
        for process in (prefill, decode):
            process.join(60)

    info = {"decode": {"pid": decode.pid, "metrics_port": decode_metrics}, "prefill": {"pid": prefill.pid}}
    return prefill_port, shutdown, info


@contextlib.contextmanager
def serving_client(port: int):
    """A client of the prefill node on `port`, once its health check says SERVING."""
    from grpc_health.v1 import health_pb2

    from pdspec.client import Client

    with Client(f"{LOOPBACK}:{port}", max_message_bytes=1 << 30) as client:
        wait_until(lambda: health(port) == health_pb2.HealthCheckResponse.SERVING, 600, f"port {port} SERVING")
        yield client


def health(port: int, timeout: float = 1.0) -> int:
    """The health status of the node on `port` (HealthCheckResponse.ServingStatus), -1 unreachable."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(f"{LOOPBACK}:{port}") as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout).status
    except grpc.RpcError:
        return -1


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class Served(NamedTuple):
    http: int  # the OpenAI API's port
    ports: dict[str, int]  # prefill, decode, prefill-metrics, decode-metrics, http
    process: subprocess.Popen


def served_arguments(parser: argparse.ArgumentParser, start_timeout: float) -> None:
    """The flags of a benchmark that runs `served` once per tree: --tree (repeat; default this
    checkout), --device, --serve-flag (repeat), --start-timeout."""
    parser.add_argument("--tree", type=Path, action="append", help="a checkout to serve from (repeat; default: this)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--serve-flag", action="append", default=[], help="a flag for `pdspec serve` (repeat)")
    parser.add_argument("--start-timeout", type=float, default=start_timeout)


@contextlib.contextmanager
def served(
    device: str, flags: list[str], timeout: float, tree: Path | None = None, env: dict[str, str] | None = None
) -> Iterator[Served]:
    """`pdspec serve` (both nodes and the HTTP API, as a user starts them) on free loopback
    ports, once the HTTP API answers /v1/models; `tree`: another checkout's code (a baseline),
    run from there; `env`: variables set for it and its nodes (PYTHONPATH: before the tree's,
    both before the one this process runs with)."""
    import urllib.request

    ports = {name: free_port() for name in ("prefill", "decode", "prefill-metrics", "decode-metrics", "http")}
    command = [
        sys.executable,
        "-m",
        "pdspec.local",
        "--device",
        device,
        *("--prefill-port", str(ports["prefill"]), "--decode-port", str(ports["decode"])),
        *("--prefill-metrics-port", str(ports["prefill-metrics"])),
        *("--decode-metrics-port", str(ports["decode-metrics"]), "--http-port", str(ports["http"])),
        *flags,
    ]
    print("#", " ".join(command), flush=True)
    variables = dict(env or {})
    path = [variables.pop("PYTHONPATH")] if "PYTHONPATH" in variables else []
    if tree is not None:
        path.append(str(tree))
    if path:  # then what this process was given (a GPU machine's wheels)
        variables["PYTHONPATH"] = os.pathsep.join([*path, *filter(None, [os.environ.get("PYTHONPATH")])])
    process = subprocess.Popen(
        command, start_new_session=True, cwd=tree, env={**os.environ, **variables} if variables else None
    )
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise SystemExit(f"pdspec serve exited with {process.returncode}")
            url = f"http://{LOOPBACK}:{ports['http']}/v1/models"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as answer:
                if answer.status == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"the HTTP API did not answer within {timeout:.0f} s")
            time.sleep(0.5)
        yield Served(ports["http"], ports, process)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A node's /metrics: {(sample name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=5).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def node_command(role: str, port: int, metrics_port: int, *flags: str) -> list[str]:
    """`python -m <role>_node` on loopback `port` (metrics_port -1: no /metrics), as a user starts it."""
    command = [sys.executable, "-m", f"{role}_node", "--host", LOOPBACK, "--port", str(port)]
    return [*command, "--metrics-port", str(metrics_port), *flags]


class EngineSteps:
    """Samples the decode node's pdspec_engine_step_seconds (sum, count) every `period` s while
    the block runs; `mean_within(start, end)` is the mean step between two perf_counter times."""

    def __init__(self, metrics_port: int, period: float = 0.1) -> None:
        self.url, self.period = f"http://{LOOPBACK}:{metrics_port}/metrics", period
        self.samples: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EngineSteps:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        while not self._stop.wait(self.period):
            now = time.perf_counter()
            text = urllib.request.urlopen(self.url, timeout=5).read().decode()
            found = {}
            for family in text_string_to_metric_families(text):
                if family.name == "pdspec_engine_step_seconds":
                    found = {s.name: s.value for s in family.samples if s.name.endswith(("_sum", "_count"))}
            self.samples.append(
                (
                    now,
                    found.get("pdspec_engine_step_seconds_sum", 0.0),
                    found.get("pdspec_engine_step_seconds_count", 0.0),
                )
            )

    def mean_within(self, start: float, end: float) -> float:
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return math.nan
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])
