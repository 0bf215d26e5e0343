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
import math
import statistics
import sys
import time
from concurrent import futures
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    SHAPES,
    EngineSteps,
    Stream,
    bytes_per_token_of,
    concurrently,
    copy_bandwidth,
    environment,
    gil_holders,
    markdown_table,
    paged,
    random_model,
    random_pair,
    read,
    report,
    serving_client,
    serving_nodes,
    spawn_nodes,
    step_rows,
    sync,
    weight_bytes,
)


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


def load(client, batch: int, tokens: int, k: int, prompt_ids: list[int], greedy: bool, temperature: float = 1.0):
    """`batch` concurrent streams; returns (tokens/s over the whole run, accept length, ttfts,
    steady inter-token gaps, the steady window (start, end) in perf_counter seconds). Steady: from the moment the last
    stream got its first token from the decode node (every KV handed over, every stream
    admitted) to the moment the first stream finished, so every stream decodes throughout and
    no admission falls inside a gap; a gap is a response's wait over the tokens it carries."""

    def one(i: int) -> Stream:
        call = client.stream(
            prompt_token_ids=prompt_ids,
            max_new_tokens=tokens,
            greedy=greedy,
            temperature=temperature,
            seed=i,
            num_speculative_tokens=k,
            timeout=600,
        )
        return read(call).checked()

    streams, elapsed = concurrently(one, batch)
    steps = sum(s.stats.verify_steps for s in streams)
    accepted = sum(s.stats.accepted_tokens for s in streams)
    gaps = [s.gaps() for s in streams]
    begin = max((g[0][1] for g in gaps if g), default=math.inf)  # each stream's first token from the decode node
    end = min(s.arrivals[-1] for s in streams)
    steady = [(b - a) / n for g in gaps for a, b, n in g if a >= begin and b <= end for _ in range(n)]
    accept = (accepted + steps) / steps if steps else None
    return sum(len(s.tokens) for s in streams) / elapsed, accept, [s.ttft for s in streams], steady, (begin, end)


THREADING = ("(threading.py)", "(concurrent/futures/thread.py)")  # every thread's bottom frames
GIL_PROFILE_TOKENS = 1024  # new tokens per stream while profiling: its steady phase outlasts the sampling


def gil_profile(client, batch: int, prompt: list[int], pids: dict[str, int], seconds: int = 4) -> dict:
    """Each node's GIL holders (bench.harness.gil_holders) while `batch` streams are in their
    steady phase: the sampling starts once every stream should have its first token."""
    with futures.ThreadPoolExecutor(1 + len(pids)) as pool:
        streams = pool.submit(load, client, batch, GIL_PROFILE_TOKENS, 0, prompt, True)
        time.sleep(1.0 + 0.08 * batch)  # past the TTFT (4.4 s at 64 streams of 256 tokens, 8B shape, H200)
        spies = {node: pool.submit(gil_holders, pid, seconds) for node, pid in pids.items()}
        found = {node: spy.result() for node, spy in spies.items()}
        streams.result()
    return found


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
        pair = random_pair(random_model(shape, args.device, args.dtype))
        with serving_nodes(pair, args.device, 2 * 4200 * (per_token + per_token)) as (_, prefill, decode):
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
            pair = random_pair(random_model("smoke", device, torch.float32))
        else:
            pair = load_pair(target_model=args.smollm2, draft_layers=layers, device=device)
        prompt = pair.tokenizer.encode("The history of the city begins in the early middle ages, when")
        for law in DraftLaw:
            kv_bytes = (4 << 30) if device != "cpu" else 256 << 20
            with serving_nodes(pair, device, kv_bytes, law=law) as (client, _, _):
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
    parser.add_argument("--json", type=Path, help="also write the rows here (--smoke too)")
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
    report("gpu_e2e", env, rows, text, keep=not args.smoke, json_path=args.json)


if __name__ == "__main__":
    main()
