"""GPU end-to-end benchmark: the engine and both nodes over loopback gRPC on one GPU.

    python bench/gpu_e2e.py [--smoke] [--smollm2 PATH] [--only SECTION,...]

Random-weight bf16 checkpoints of real shapes (timing does not depend on the weights):
Llama-3-8B (32 layers, 4096 hidden, 32/8 heads, FFN 14336, vocab 128256) and TinyLlama-1.1B;
SmolLM2-135M-Instruct (the shipped GGUF) with a layer-skip draft for real acceptance.
Sections (each row says what it measures):
* floor: device copy bandwidth (read + write bytes / time) and the weight-bytes floor of a
  decode step (weights / read bandwidth);
* step: one K = 0 decode step of the paged engine (forward + sampling) at batch 1..64, eager,
  against the floor; the model forward alone; transformers' `generate` at batch 1;
* verify: one verify pass over K+1 = 5 positions vs one single-position step, batch 1 and 32;
* nodes: K = 0 greedy tokens/s through both nodes (prefill + decode over gRPC) at batch 1..64;
  with --gil-profile B,..., also who holds each node's GIL in the steady phase at those batch
  sizes (py-spy --gil; needs the py-spy executable on PATH);
* spec: SmolLM2 + layer-skip draft through both nodes, K = 4 vs K = 0, T in {0, 1}, both
  draft laws, batch 1 and 16, with the measured accept length;
* handoff: TTFT and KV handoff of 1k- and 4k-token prompts on the 8B shape (prefill, KV
  bytes, encode + serialize, parse + validate, decode import).
--smoke runs every section with tiny shapes (CPU or GPU) to check the script itself.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, gil_holders, markdown_table, write_results
from engine.paged_lm import PagedLlamaLM, bytes_per_token
from engine.spec_config import SpeculativeConfig
from models.llama import LlamaCausalLM, LlamaConfig, LlamaForCausalLM, layer_skip_draft
from models.pair import ModelPair
from models.tokenizer import ByteTokenizer
from protos.kv_layout import kv_bytes, layer_kv_layout
from sampling import DraftToTargetMap

SHAPES = {
    "llama3-8b": dict(hidden=4096, layers=32, heads=32, kv=8, ffn=14336, vocab=128256, theta=500000.0),
    "tinyllama-1.1b": dict(hidden=2048, layers=22, heads=32, kv=4, ffn=5632, vocab=32000, theta=10000.0),
    "smoke": dict(hidden=64, layers=2, heads=4, kv=2, ffn=128, vocab=300, theta=10000.0),
}


def config_of(shape: dict) -> LlamaConfig:
    return LlamaConfig.from_hf(
        {
            "model_type": "llama",
            "vocab_size": shape["vocab"],
            "hidden_size": shape["hidden"],
            "num_hidden_layers": shape["layers"],
            "num_attention_heads": shape["heads"],
            "num_key_value_heads": shape["kv"],
            "intermediate_size": shape["ffn"],
            "rms_norm_eps": 1e-5,
            "rope_theta": shape["theta"],
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
            "eos_token_id": shape["vocab"] - 1,
        }
    )


def random_model(shape: str, device: str, dtype: torch.dtype) -> LlamaCausalLM:
    """Random weights straight on the device (std 0.02: finite logits, a real softmax)."""
    config = config_of(SHAPES[shape])
    with torch.device(device):
        module = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    return LlamaCausalLM(module.eval(), source_digest=f"random-{shape}")


def weight_bytes(model: LlamaCausalLM) -> int:
    return sum(p.numel() * p.element_size() for p in model.module.parameters())


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int) -> float:
    """Median seconds of fn() (synchronized)."""
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device copy, read + write counted."""
    n = (1 << 30) if torch.device(device).type == "cuda" else (64 << 20)
    src = torch.randn(n // 4, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, 10)
    return 2 * n / seconds


def paged(model: LlamaCausalLM, tokens: int, attention: str = "auto") -> PagedLlamaLM:
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
        return timed(one, device, repeat)


def transformers_generate(shape: str, device: str, dtype: torch.dtype, steps: int) -> float | None:
    """Seconds per token of transformers' greedy `generate` at batch 1 (same shape, random)."""
    try:
        from transformers import LlamaConfig as HFConfig
        from transformers import LlamaForCausalLM as HFModel
    except ImportError:
        return None
    s = SHAPES[shape]
    config = HFConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv"],
        intermediate_size=s["ffn"],
        rope_theta=s["theta"],
        max_position_embeddings=8192,
    )
    with torch.device(device):
        model = HFModel(config).to(dtype).eval()
    ids = torch.randint(0, s["vocab"], (1, 128), device=device)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        sync(device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
        sync(device)
    seconds = (time.perf_counter() - start) / steps
    del model
    return seconds


def engine_sections(args, env, rows, tables) -> None:
    device, dtype = args.device, args.dtype
    bandwidth = copy_bandwidth(device)
    env["copy_bandwidth_GBps"] = f"{bandwidth / 1e9:.0f}"
    # A copy moves each byte twice (read + write) at the card's rate: that rate is the read ceiling.
    read_bw = bandwidth
    shapes = ["smoke"] if args.smoke else ["llama3-8b", "tinyllama-1.1b"]
    table = []
    for shape in shapes:
        model = random_model(shape, device, dtype)
        lm = paged(model, 64 * (args.context + 48) + 64)
        # the same forward with the reference attention (gather + SDPA), in the same run
        sdpa = paged(model, 64 * (args.context + 48) + 64, "sdpa") if lm.attention != "sdpa" else None
        floor = weight_bytes(model) / read_bw
        hf = transformers_generate(shape, device, dtype, 32 if not args.smoke else 4) if "hf" in args.only else None
        base = None
        for batch in args.batches:
            step = step_rows(lm, batch, args.context, 1, device, args.repeat)
            reference = step_rows(sdpa, batch, args.context, 1, device, args.repeat) if sdpa else None
            base = base or step
            row = {
                "section": "step",
                "shape": shape,
                "batch": batch,
                "step_ms": step * 1e3,
                "floor_ms": floor * 1e3,
                "fraction_of_floor": floor / step,
                "step_vs_batch1": step / base,
                "tokens_per_s": batch / step,
                "attention": lm.attention,
                "sdpa_attention_step_ms": reference and reference * 1e3,
            }
            if batch == 1 and hf:
                row["transformers_generate_ms"] = hf * 1e3
                row["speedup_vs_transformers"] = hf / step
            rows.append(row)
            table.append(
                [
                    shape,
                    batch,
                    f"{step * 1e3:.2f}",
                    f"{floor * 1e3:.2f}",
                    f"{floor / step:.0%}",
                    f"{step / base:.2f}x",
                    f"{batch / step:.0f}",
                    f"{hf * 1e3:.1f} ({hf / step:.1f}x)" if batch == 1 and hf else "",
                    f"{reference * 1e3:.2f} ({reference / step:.2f}x)" if reference else "",
                ]
            )
            print(table[-1], flush=True)
        for batch in (1, 32) if not args.smoke else (1, 2):
            one = step_rows(lm, batch, args.context, 1, device, args.repeat)
            five = step_rows(lm, batch, args.context, 5, device, args.repeat)
            reference = step_rows(sdpa, batch, args.context, 5, device, args.repeat) if sdpa else None
            rows.append(
                {
                    "section": "verify",
                    "shape": shape,
                    "batch": batch,
                    "one_ms": one * 1e3,
                    "five_ms": five * 1e3,
                    "sdpa_attention_five_ms": reference and reference * 1e3,
                }
            )
            table.append(
                [
                    shape,
                    f"verify b={batch}",
                    f"{five * 1e3:.2f}",
                    "",
                    "",
                    f"{five / one:.2f}x vs 1 pos",
                    "",
                    "",
                    f"{reference * 1e3:.2f} ({reference / five:.2f}x)" if reference else "",
                ]
            )
            print(table[-1], flush=True)
        del lm, sdpa, model
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    header = [
        "shape",
        "batch",
        "step ms",
        "floor ms",
        "of floor",
        "vs batch 1",
        "tokens/s",
        "transformers ms/token",
        "with SDPA attention ms",
    ]
    tables.append("### Engine step (K = 0; the forward, through its CUDA graph)\n\n" + markdown_table(header, table))


def serve(
    pair: ModelPair,
    device: str,
    kv_bytes: int,
    max_batch: int = 64,
    k_max: int = 8,
    law=None,
    prefill_options: dict | None = None,
):
    """Both nodes in this process on one device (loopback gRPC); returns (client, stack, prefill,
    decode). `law`: the draft law of both nodes (None: their default, point mass);
    `prefill_options`: PrefillConfig fields (default: every KV in the one Decode message)."""

    from decode_node.engine import DecodeConfig
    from decode_node.server import DecodeNodeConfig
    from decode_node.server import run_server as run_decode
    from pdspec.client import Client
    from pdspec.modelspec import ModelSpec
    from prefill_node.engine import PrefillConfig
    from prefill_node.server import PrefillNodeConfig
    from prefill_node.server import run_server as run_prefill
    from protos.validation import RequestLimits
    from sampling.proposal import DraftLaw

    law = law or DraftLaw.POINT_MASS
    stack = contextlib.ExitStack()
    spec = ModelSpec(device=device, kv_cache_bytes=kv_bytes)
    limits = RequestLimits(max_prompt_tokens=8192)
    decode = stack.enter_context(
        run_decode(
            DecodeNodeConfig(
                host="127.0.0.1",
                port=0,
                metrics_port=None,
                models=spec,
                limits=limits,
                engine=DecodeConfig(
                    spec=SpeculativeConfig(max_speculative_tokens=k_max, draft_law=law),
                    device=device,
                    max_batch=max_batch,
                    max_queue=256,
                ),
            ),
            lambda: pair,
        )
    )
    prefill = stack.enter_context(
        run_prefill(
            PrefillNodeConfig(
                decode_addr=f"127.0.0.1:{decode.port}",
                host="127.0.0.1",
                port=0,
                metrics_port=None,
                models=spec,
                # the handoff section times the one-message path (DecodeStream is bench/wire_kv.py's)
                engine=PrefillConfig(
                    spec=SpeculativeConfig(max_speculative_tokens=k_max, draft_law=law),
                    device=device,
                    limits=limits,
                    **prefill_options or {"kv_stream_threshold_bytes": 1 << 40},
                ),
                peer_check_s=0.1,
                max_streams=512,
            ),
            lambda: pair,
        )
    )
    while not prefill.peer.compatible:
        time.sleep(0.05)
    client = stack.enter_context(Client(f"127.0.0.1:{prefill.port}", max_message_bytes=1 << 30))
    return client, stack, prefill, decode


def load(client, batch: int, tokens: int, k: int, prompt_ids: list[int], greedy: bool, temperature: float = 1.0):
    """`batch` concurrent streams; returns (tokens/s over the whole run, accept length, ttfts,
    steady inter-token gaps, the steady window (start, end) in perf_counter seconds). Steady: from the moment the last
    stream got its first token from the decode node (every KV handed over, every stream
    admitted) to the moment the first stream finished, so every stream decodes throughout and
    no admission falls inside a gap; a gap is a response's wait over the tokens it carries."""
    results = [None] * batch

    def one(i: int) -> None:
        started = last = time.perf_counter()
        ttft, decoding, out, gaps = None, None, [], []
        stats = None
        for response in client.stream(
            prompt_token_ids=prompt_ids,
            max_new_tokens=tokens,
            greedy=greedy,
            temperature=temperature,
            seed=i,
            num_speculative_tokens=k,
            timeout=600,
        ):
            now = time.perf_counter()
            if ttft is None:
                ttft = now - started  # the prefill node's token
            elif response.token_ids:
                decoding = decoding or now  # the decode node's first
                gaps.append((last, now, (now - last) / len(response.token_ids), len(response.token_ids)))
            last = now
            out += response.token_ids
            if response.finished:
                stats = response.stats
        results[i] = (len(out), ttft, stats, gaps, decoding, last)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(batch)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    generated = sum(r[0] for r in results)
    steps = sum(r[2].verify_steps for r in results)
    accepted = sum(r[2].accepted_tokens for r in results)
    begin = max((r[4] for r in results if r[4] is not None), default=math.inf)
    end = min(r[5] for r in results)
    gaps = [gap for r in results for since, until, gap, n in r[3] if since >= begin and until <= end for _ in range(n)]
    accept = (accepted + steps) / steps if steps else None
    return generated / elapsed, accept, [r[1] for r in results], gaps, (begin, end)


def _node_process(
    role: str,
    shape: str,
    device: str,
    kv_bytes: int,
    decode_addr: str,
    ports,
    stop,
    shm: bool = False,
    scheduling: str = "auto",
) -> None:
    """One node in its own process (as deployed: no GIL shared with the other node); `shm`:
    the KV handed over in shared memory (--kv-transport shm / --accept-shm-kv); `scheduling`:
    the decode node's --async-scheduling."""
    torch.manual_seed(0)
    target = random_model(shape, device, torch.bfloat16 if device != "cpu" else torch.float32)
    pair = ModelPair(target, layer_skip_draft(target, 1), DraftToTargetMap.identity(target.vocab_size), ByteTokenizer())
    from decode_node.engine import DecodeConfig
    from decode_node.server import DecodeNodeConfig
    from decode_node.server import run_server as run_decode
    from pdspec.modelspec import ModelSpec
    from prefill_node.engine import KvTransport, PrefillConfig
    from prefill_node.server import PrefillNodeConfig
    from prefill_node.server import run_server as run_prefill
    from protos.validation import RequestLimits

    spec = ModelSpec(device=device, kv_cache_bytes=kv_bytes)
    if role == "decode":
        config = DecodeNodeConfig(
            host="127.0.0.1",
            port=0,
            metrics_port=0,  # any free port: the bench reads the engine's step times there
            models=spec,
            engine=DecodeConfig(device=device, max_batch=64, max_queue=256, async_scheduling=scheduling),
            limits=RequestLimits(max_prompt_tokens=8192),
            accept_shm_kv=shm,
        )
        context = run_decode(config, lambda: pair)
    else:
        config = PrefillNodeConfig(
            decode_addr=decode_addr,
            host="127.0.0.1",
            port=0,
            metrics_port=None,
            models=spec,
            engine=PrefillConfig(
                device=device,
                limits=RequestLimits(max_prompt_tokens=8192),
                kv_transport=KvTransport.SHM if shm else KvTransport.GRPC,
            ),
            peer_check_s=0.1,
            max_streams=512,
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
):
    """Decode (on `device`) and prefill (on `prefill_device`, default the same) nodes, each in
    its own process; returns (prefill port, stop, each node's process id and the decode
    node's /metrics port)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    stop, ports = ctx.Event(), ctx.Queue()
    decode = ctx.Process(
        target=_node_process, args=("decode", shape, device, kv_bytes, "", ports, stop, shm, scheduling)
    )
    decode.start()
    decode_port, decode_metrics = ports.get(timeout=600)
    prefill_kv = 8200 * 2 * bytes_per_token_of(shape)
    prefill = ctx.Process(
        target=_node_process,
        args=("prefill", shape, prefill_device or device, prefill_kv, f"127.0.0.1:{decode_port}", ports, stop, shm),
    )
    prefill.start()
    prefill_port, _ = ports.get(timeout=600)

    def shutdown() -> None:
        stop.set()
        for process in (prefill, decode):
            process.join(60)

    nodes = {"decode": {"pid": decode.pid, "metrics_port": decode_metrics}, "prefill": {"pid": prefill.pid}}
    return prefill_port, shutdown, nodes


@contextlib.contextmanager
def serving_client(port: int):
    """A client of the prefill node on `port`, once its health check says SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pdspec.client import Client

    with Client(f"127.0.0.1:{port}", max_message_bytes=1 << 30) as client:
        health = health_pb2_grpc.HealthStub(client.channel)
        while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
            time.sleep(0.2)
        yield client


class EngineSteps:
    """Samples the decode node's pdspec_engine_step_seconds (sum, count) every `period` s while
    the block runs; `mean_within(start, end)` is the mean step between two perf_counter times."""

    def __init__(self, metrics_port: int, period: float = 0.1) -> None:
        self.url, self.period = f"http://127.0.0.1:{metrics_port}/metrics", period
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
            return float("nan")
        return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])


THREADING = ("(threading.py)", "(concurrent/futures/thread.py)")  # every thread's bottom frames
GIL_PROFILE_TOKENS = 1024  # new tokens per stream while profiling: its steady phase outlasts the sampling


def gil_profile(client, batch: int, prompt: list[int], pids: dict[str, int], seconds: int = 4) -> dict:
    """Each node's GIL holders (bench.common.gil_holders) while `batch` streams are in their
    steady phase: the sampling starts once every stream should have its first token."""
    from concurrent import futures

    with futures.ThreadPoolExecutor(1 + len(pids)) as pool:
        streams = pool.submit(load, client, batch, GIL_PROFILE_TOKENS, 0, prompt, True)
        time.sleep(1.0 + 0.08 * batch)  # past the TTFT (4.4 s at 64 streams of 256 tokens, 8B shape, H200)
        spies = {node: pool.submit(gil_holders, pid, seconds) for node, pid in pids.items()}
        found = {node: spy.result() for node, spy in spies.items()}
        streams.result()
    return found


def bytes_per_token_of(shape: str) -> int:
    """A bfloat16 model's KV bytes per token, before any model of the shape is built."""
    c = config_of(SHAPES[shape])
    return kv_bytes(layer_kv_layout(c.num_layers, c.num_kv_heads, c.head_dim, torch.bfloat16), 1)


def node_sections(args, env, rows, tables) -> None:
    shape = "smoke" if args.smoke else "llama3-8b"
    per_token = bytes_per_token_of(shape) * 33 // 32  # target + a 1-layer draft
    tokens = max(args.tokens, GIL_PROFILE_TOKENS if args.gil_profile else 0)  # 64 streams fit the pool
    kv_bytes = (64 * (args.context + tokens + 32) + 64) * per_token * 2
    table, gil_table = [], []
    for scheduling in args.scheduling:
        port, shutdown, nodes = spawn_nodes(shape, args.device, kv_bytes, scheduling=scheduling)
        node_runs(args, shape, scheduling, port, shutdown, nodes, rows, table, gil_table)
    header = [
        "shape",
        "async scheduling",
        "concurrent streams",
        "tokens/s (all)",
        "tokens/s per stream",
        "TTFT p50 ms",
        "steady window s",
        "steady ITL p50 ms",
        "decode engine step ms (mean, steady window)",
    ]
    tables.append(
        "### Both nodes over loopback gRPC, one process each (K = 0 greedy)\n\n" + markdown_table(header, table)
    )
    if gil_table:
        header = [
            "async scheduling",
            "concurrent streams",
            "node",
            "GIL held",
            "held in (inclusive share of the held samples)",
        ]
        title = "### Who holds each node's GIL in the steady phase (py-spy --gil)"
        tables.append(f"{title}\n\n{markdown_table(header, gil_table)}")
    if "handoff" in args.only:
        target = random_model(shape, args.device, args.dtype)
        pair = ModelPair(
            target, layer_skip_draft(target, 1), DraftToTargetMap.identity(target.vocab_size), ByteTokenizer()
        )
        _client, stack, prefill, decode = serve(pair, args.device, 2 * 4200 * (per_token + per_token))
        with stack:
            handoff(prefill, decode, rows, tables, args)


def node_runs(args, shape, scheduling, port, shutdown, nodes, rows, table, gil_table) -> None:
    """The node section's load at each batch size against one pair of node processes."""
    pids = {node: info["pid"] for node, info in nodes.items()}
    try:
        with serving_client(port) as client:
            prompt = list(range(1, args.context + 1))
            load(client, 4, 8, 0, prompt, greedy=True)  # warm-up: graphs captured, kernels chosen
            for batch in args.batches:
                load(client, batch, 8, 0, prompt, greedy=True)
                with EngineSteps(nodes["decode"]["metrics_port"]) as steps:
                    tps, _, ttfts, gaps, window = load(client, batch, args.tokens, 0, prompt, greedy=True)
                itl = statistics.median(gaps) if gaps else float("nan")
                step = steps.mean_within(*window)
                rows.append(
                    {
                        "section": "nodes",
                        "shape": shape,
                        "async_scheduling": scheduling,
                        "batch": batch,
                        "tokens_per_s": tps,
                        "itl_p50_ms": itl * 1e3,
                        "steady_s": max(0.0, window[1] - window[0]),
                        "engine_step_ms": step * 1e3,
                    }
                )
                table.append(
                    [
                        shape,
                        scheduling,
                        batch,
                        f"{tps:.0f}",
                        f"{tps / batch:.1f}",
                        f"{statistics.median(ttfts) * 1e3:.0f}",
                        f"{max(0.0, window[1] - window[0]):.2f}",
                        f"{itl * 1e3:.2f}",
                        f"{step * 1e3:.2f}",
                    ]
                )
                print(table[-1], flush=True)
                if batch in args.gil_profile:
                    try:
                        profiles = gil_profile(client, batch, prompt, pids)
                    except RuntimeError as err:  # no py-spy, no ptrace right: the tables still get written
                        gil_table.append([scheduling, batch, "-", "", str(err)])
                        profiles = {}
                    for node, found in profiles.items():
                        rows.append(
                            {
                                "section": "nodes_gil",
                                "shape": shape,
                                "async_scheduling": scheduling,
                                "batch": batch,
                                "node": node,
                                **found,
                            }
                        )
                        shown = [(f, share) for f, share in found["functions"] if not f.endswith(THREADING)]
                        names = "; ".join(f"{f.split(' (')[0]} {share:.0%}" for f, share in shown[:6])
                        gil_table.append([scheduling, batch, node, f"{found['gil_held']:.0%}", names])
    finally:
        shutdown()


def handoff(prefill, decode, rows, tables, args) -> None:
    """TTFT and KV handoff for long prompts, timed piece by piece through the real code."""
    from protos import pdspec_pb2
    from protos.validation import DecodeInput, Receiver, validate_decode_request

    engine = prefill.engine
    recv = Receiver(engine.contract, 8, engine.pair.d2t)
    table = []
    for length in (1024, 4096) if not args.smoke else (32, 64):
        request = pdspec_pb2.GenerateRequest(
            request_id=f"h{length}",
            prompt_token_ids=list(range(1, length + 1)),
            num_speculative_tokens=0,
            sampling=pdspec_pb2.SamplingParams(max_new_tokens=2),
        )
        start = time.perf_counter()
        checked = engine.check(request)
        prefilled = engine.prefill(checked)  # prefill + KV export (device -> host)
        t_prefill = time.perf_counter() - start
        start = time.perf_counter()
        wire = prefilled.decode_request.SerializeToString()
        t_serialize = time.perf_counter() - start
        start = time.perf_counter()
        parsed = pdspec_pb2.DecodeRequest.FromString(wire)
        decoded = validate_decode_request(parsed, recv)
        assert isinstance(decoded, DecodeInput), decoded
        t_parse = time.perf_counter() - start
        model = decode.engine.pair.target  # the running decode node's model and pool
        start = time.perf_counter()
        state = model.import_state(decoded.kv_cache, decoded.prompt_token_ids)
        sync(args.device)
        t_import = time.perf_counter() - start
        model.release(state)
        kv = sum(len(t.data) for t in parsed.kv_cache)
        rows.append(
            {
                "section": "handoff",
                "prompt": length,
                "prefill_export_s": t_prefill,
                "serialize_s": t_serialize,
                "parse_validate_s": t_parse,
                "import_s": t_import,
                "kv_bytes": kv,
                "wire_GBps": kv / (t_serialize + t_parse) / 1e9,
            }
        )
        table.append(
            [
                length,
                f"{t_prefill * 1e3:.0f}",
                f"{kv / 2**20:.0f}",
                f"{t_serialize * 1e3:.0f}",
                f"{t_parse * 1e3:.0f}",
                f"{t_import * 1e3:.0f}",
            ]
        )
        print(table[-1], flush=True)
    header = ["prompt tokens", "prefill + export ms", "KV MiB", "serialize ms", "parse + validate ms", "import ms"]
    tables.append("### KV handoff (8B shape, bf16)\n\n" + markdown_table(header, table))


def spec_section(args, env, rows, tables) -> None:
    from models.loader import load_pair
    from sampling.proposal import DraftLaw

    device = args.device
    table = []
    for layers in args.draft_layers:
        if args.smoke:
            target = random_model("smoke", device, torch.float32)
            pair = ModelPair(
                target, layer_skip_draft(target, 1), DraftToTargetMap.identity(target.vocab_size), ByteTokenizer()
            )
        else:
            pair = load_pair(target_model=args.smollm2, draft_layers=layers, device=device)
        prompt = pair.tokenizer.encode("The history of the city begins in the early middle ages, when")
        for law in DraftLaw:
            kv_bytes = (4 << 30) if device != "cpu" else 256 << 20
            client, stack, _, _ = serve(pair, device, kv_bytes, law=law)
            with stack:
                for k in (0, 4):  # warm-up: graphs for both step shapes captured before timing
                    load(client, 4, 16, k, prompt, False)
                for temperature in (0.0, 1.0):
                    greedy, t = temperature == 0, max(temperature, 1e-3)
                    for batch in (1, 16) if not args.smoke else (1, 2):
                        base, *_ = load(client, batch, args.tokens, 0, prompt, greedy, t)
                        spec, accept, *_ = load(client, batch, args.tokens, 4, prompt, greedy, t)
                        rows.append(
                            {
                                "section": "spec",
                                "draft_layers": layers,
                                "law": law.value,
                                "temperature": temperature,
                                "batch": batch,
                                "k0_tokens_per_s": base,
                                "k4_tokens_per_s": spec,
                                "speedup": spec / base,
                                "accept_length": accept,
                            }
                        )
                        table.append(
                            [
                                layers,
                                law.value,
                                temperature,
                                batch,
                                f"{base:.0f}",
                                f"{spec:.0f}",
                                f"{spec / base:.2f}x",
                                f"{accept:.2f}",
                            ]
                        )
                        print(table[-1], flush=True)
    header = ["draft layers", "draft law", "T", "batch", "K=0 tokens/s", "K=4 tokens/s", "speed-up", "accept length"]
    tables.append("### SmolLM2-135M + layer-skip draft, through both nodes\n\n" + markdown_table(header, table))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smollm2", default="smollm2-135m-instruct")
    parser.add_argument("--draft-layers", type=int, nargs="+", default=[8, 28])
    parser.add_argument("--only", default="step,hf,nodes,handoff,spec")
    parser.add_argument("--context", type=int, default=256, help="context length of the decode-step rows")
    parser.add_argument(
        "--tokens", type=int, default=512, help="new tokens per request, node sections (a steady window needs many)"
    )
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--batches", default="1,8,32,64", help="step and nodes sections: batch sizes / streams")
    parser.add_argument(
        "--scheduling",
        default="on",
        help="nodes section: the decode node's --async-scheduling values to run (one pair of processes each)",
    )
    parser.add_argument(
        "--gil-profile", default="", help="nodes section: at these batch sizes, sample who holds each node's GIL"
    )
    args = parser.parse_args()
    args.gil_profile = {int(b) for b in args.gil_profile.split(",") if b}
    args.only = set(args.only.split(","))
    args.scheduling = args.scheduling.split(",")
    args.dtype = torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32
    args.batches = (1, 2) if args.smoke else tuple(int(b) for b in args.batches.split(","))
    if not args.gil_profile <= set(args.batches):
        parser.error(f"--gil-profile: expected batch sizes among {list(args.batches)}, got {sorted(args.gil_profile)}")
    if args.smoke:
        args.context, args.tokens, args.repeat = 32, 8, 3
    env = environment()
    rows: list[dict] = []
    tables: list[str] = []
    if "step" in args.only:
        engine_sections(args, env, rows, tables)
    if "nodes" in args.only:
        node_sections(args, env, rows, tables)
    if "spec" in args.only:
        spec_section(args, env, rows, tables)
    text = "\n\n".join(tables)
    print(text)
    if not args.smoke:
        print("wrote", write_results("gpu_e2e", env, rows, text))


if __name__ == "__main__":
    main()
