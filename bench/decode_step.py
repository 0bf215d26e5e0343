"""Where a decode step's time goes outside the model forward (the goal: "< 10%").

    python bench/decode_step.py [--device cuda] [--shape llama3-8b] [--batches 1,8] [--k 0,4]
                                [--scheduling off,on,ahead,held] [--freeze] [--smoke]
        [--target-model GGUF|DIR (--draft-model DIR | --draft-layers N) --method hybrid --temperatures 0,0.7]

The decode engine alone (no gRPC): `--batches` requests with a 256-token context, prefilled by
the real prefill engine, decoded by the real DecodeEngine recording the node's metrics (K draft
tokens per step from the 1-layer layer-skip draft of the random-weight checkpoint, or with `--target-model` a real
checkpoint and `--draft-model` its draft or hidden-state head, proposing by `--method`), greedy
or, per `--temperatures` above 0, sampled and seeded. Per configuration:
* the weight-bytes floor (the target's weights / the copy bandwidth, as bench/gpu_e2e.py's) against
  the K = 0 step;
* the wall time of one engine step: the median time between consecutive `step()` returns in a
  run of steps (each step reads its tokens, or with async scheduling the step before's: a
  steady period, no synchronize in between that would drain the pipeline), for each
  `--scheduling` (the decode engine's async_scheduling: off, on; ahead: on, with
  prompt-lookup rows speculating in the queued steps, `--speculate-ahead on`; held: on, with a
  batch gate that measured a speculating step at 100x a K = 0 one, so it holds every step at
  K = 0: what a batch whose speculation does not pay costs over K = 0) in the same run;
* the target forward alone at the same batch and width (bench/harness.step_rows: the graph
  replay on a GPU), so step - forward is what the engine adds: drafting, sampling, the
  rejection kernel, metadata, bookkeeping;
* the tokens each row emits per step (what a step buys: 1 at K = 0);
* the garbage collector's time and collections per step over those steps (`--freeze`: the heap
  made so far frozen first, as a node process freezes its start-up, pdspec.serving);
* the device time and count of the kernels of a step, and the kernels with the most of it
  (torch.profiler, CUDA only);
* the host functions with the most own time per step (cProfile), to say what to cut, and the
  project's functions with the most time per step callees included (`--host-top` of each).
Writes bench/results/decode_step-*.json.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import itertools
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (
    copy_bandwidth,
    environment,
    markdown_table,
    paged,
    random_model,
    random_pair,
    report,
    step_rows,
    sync,
    weight_bytes,
)
from decode_node.engine import DecodeConfig, DecodeEngine
from engine.grammar import GRAMMAR
from engine.paged_lm import bytes_per_token, paged_pair
from engine.spec_config import SpeculativeConfig
from models.pair import ModelPair
from pdspec.metrics import NodeMetrics
from pdspec.serving import freeze_start_up
from prefill_node.engine import PrefillConfig, PrefillEngine
from protos import pdspec_pb2
from protos.validation import Receiver, validate_decode_request
from sampling.proposal import PROPOSAL_SOURCES


def engine_steps(
    pair: ModelPair,
    device: str,
    batch: int,
    k: int,
    context: int,
    steps: int,
    scheduling: str,
    method: str = "draft",
    temperature: float = 0.0,
    host_top: int = 6,
):
    """(median seconds per step, tokens emitted per row and step, device ms and kernels per step
    or None, the kernels with the most device time per step, top host functions by own time,
    top project functions by time with callees, the collector's (seconds, collections) per step)."""
    spec = SpeculativeConfig(max_speculative_tokens=max(k, 1), method=method)
    prefill = PrefillEngine(pair, PrefillConfig(spec=spec, device=device))
    ahead = scheduling == "ahead"
    config = DecodeConfig(
        spec=spec,
        device=device,
        max_batch=batch,
        async_scheduling="on" if scheduling in ("ahead", "held") else scheduling,
        speculate_ahead="on" if ahead else "off",
    )
    # the node's metrics, as `pdspec serve` records them: a verified row's series are host work of every step
    metrics = NodeMetrics("decode", spec.max_speculative_tokens, methods=[method], sources=(*PROPOSAL_SOURCES, GRAMMAR))
    decode = DecodeEngine(pair, config, metrics)
    if scheduling == "held":  # a gate that measured a speculating step at 100x a K = 0 one: it holds every step
        for speculated, seconds in ((True, 100.0), (True, 100.0), (False, 1.0), (False, 1.0)):
            decode.policy.gate.record(batch, speculated, seconds)
    receiver = Receiver.from_contract(pair.contract(), max(k, 1))

    def submit(count: int, tokens: int) -> None:
        requests = [
            pdspec_pb2.GenerateRequest(
                prompt_token_ids=[(7 * i + j) % (pair.target.vocab_size - 2) + 1 for j in range(context)],
                num_speculative_tokens=k,
                sampling=pdspec_pb2.SamplingParams(
                    do_sample=temperature > 0, temperature=temperature or 1.0, max_new_tokens=tokens
                ),
            )
            for i in range(count)
        ]
        if temperature > 0:
            for i, request in enumerate(requests):
                request.sampling.seed = i
        for prefilled in prefill.prefill_many([prefill.check(r) for r in requests]):
            wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
            decode.submit(validate_decode_request(wire, receiver))

    submit(batch, 8)  # warm-up: graphs of these shapes captured, kernels chosen
    while decode.load:
        decode.step()
    submit(batch, (2 * steps + 20) * (k + 1))  # still running after every timed and profiled step
    decode.step()  # admission
    decode.step()

    def emitted() -> int:
        return sum(len(request.seq.history) for request in decode._active)

    collected = [0.0, 0, 0.0]  # seconds, collections, the running one's start

    def collecting(phase: str, info: dict) -> None:
        if phase == "start":
            collected[2] = time.perf_counter()
        else:
            collected[0] += time.perf_counter() - collected[2]
            collected[1] += 1

    times = []
    before = emitted()
    gc.callbacks.append(collecting)
    last = time.perf_counter()
    for _ in range(steps):
        decode.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    gc.callbacks.remove(collecting)
    sync(device)
    per_step = (emitted() - before) / steps / batch  # an async step's tokens land a step late: same rate
    kernels, heavy = None, []
    if torch.device(device).type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                decode.step()
            sync(device)
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        kernels = (sum(e.device_time for e in events) / 5 / 1e3, len(events) / 5)
        by_name = collections.Counter()
        for event in events:
            by_name[event.name[:60]] += event.device_time / 5 / 1e3
        heavy = by_name.most_common(4)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(5):
        decode.step()
    sync(device)
    profiler.disable()
    while decode.load:
        decode.step()
    own, inclusive = collections.Counter(), collections.Counter()
    root = str(Path(__file__).resolve().parent.parent)
    for (file, _line, name), (_, _, tottime, cumtime, _) in pstats.Stats(profiler).stats.items():
        where = f"{Path(file).parent.name}/{Path(file).name}:{name}" if file.startswith("/") else name
        own[where] += tottime / 5
        if file.startswith(root) and "/.venv/" not in file:  # the project's own functions, callees included
            inclusive[where] += cumtime / 5
    return (
        statistics.median(times),
        per_step,
        kernels,
        heavy,
        own.most_common(host_top),
        inclusive.most_common(host_top),
        (collected[0] / steps, collected[1] / steps),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="llama3-8b")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--k", default="0,4")
    parser.add_argument(
        "--scheduling",
        default="off,on",
        help="async_scheduling values (ahead: on, speculating ahead; held: on, gate holding)",
    )
    parser.add_argument("--freeze", action="store_true", help="freeze the heap before the runs, as a node process does")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--smoke", action="store_true", help="the tiny shape (CPU is fine)")
    parser.add_argument("--target-model", default=None, help="a real checkpoint (default: the random --shape)")
    parser.add_argument("--draft-model", default=None, help="its draft or hidden-state head (with --target-model)")
    parser.add_argument("--draft-layers", type=int, default=None, help="or its first N layers (the launcher's 8)")
    parser.add_argument("--method", default="draft", help="--speculative-method of both engines")
    parser.add_argument("--temperatures", default="0", help="0: greedy; above: sampled, seeded")
    parser.add_argument("--host-top", type=int, default=6, help="host functions kept per row of the results")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.context, args.steps = "smoke", 32, 5
    device = args.device
    batches = [int(b) for b in args.batches.split(",")]
    ks = [int(k) for k in args.k.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    tokens = max(batches) * (args.context + 2 * args.steps + 64) * (max(ks) + 1)
    if args.target_model:
        from pdspec.modelspec import ModelSpec

        models = ModelSpec(
            target_model=args.target_model, draft_model=args.draft_model, draft_layers=args.draft_layers, device=device
        )
        raw = models.load()
        target = raw.target
        args.shape = Path(args.target_model).name
    else:
        target = random_model(args.shape, device)
        raw = random_pair(target)
    pair = paged_pair(raw, tokens * (bytes_per_token(raw.target) + bytes_per_token(raw.draft)))
    forward_lm = paged(target, tokens)
    if args.freeze:
        freeze_start_up("decode_step")
    env = environment()
    floor = weight_bytes(target) / copy_bandwidth(device)  # the target's weights read once (gpu_e2e's floor)
    rows, table = [], []
    for batch in batches:
        forward = step_rows(forward_lm, batch, args.context, 1, device, args.steps)
        for k, scheduling, temperature in itertools.product(ks, args.scheduling.split(","), temperatures):
            step, per_step, kernels, heavy, top, inclusive, collector = engine_steps(
                pair, device, batch, k, args.context, args.steps, scheduling, args.method, temperature, args.host_top
            )
            outside = step - forward if k == 0 else None  # K > 0 adds a wider verify and the draft
            row = {
                "shape": args.shape,
                "method": args.method,
                "temperature": temperature,
                "batch": batch,
                "k": k,
                "async_scheduling": scheduling,
                "step_ms": step * 1e3,
                "tokens_per_row_step": per_step,
                "floor_ms": floor * 1e3,
                "forward_ms": forward * 1e3,
                "outside_forward_ms": None if outside is None else outside * 1e3,
                "kernel_ms": None if kernels is None else kernels[0],
                "kernels": None if kernels is None else kernels[1],
                "top_kernels_ms": [[name, t] for name, t in heavy],
                "top_host_ms": [[name, t * 1e3] for name, t in top],
                "top_host_inclusive_ms": [[name, t * 1e3] for name, t in inclusive],
                "gc_ms_per_step": collector[0] * 1e3,
                "gc_collections_per_step": collector[1],
                "frozen": args.freeze,
            }
            rows.append(row)
            table.append(
                [
                    args.shape,
                    args.method,
                    temperature,
                    batch,
                    k,
                    scheduling,
                    f"{step * 1e3:.2f}",
                    f"{per_step:.2f}",
                    f"{floor / step:.0%}" if k == 0 else "",
                    f"{forward * 1e3:.2f}",
                    "" if outside is None else f"{outside * 1e3:.2f} ({outside / step:.0%})",
                    "" if kernels is None else f"{kernels[0]:.2f} / {kernels[1]:.0f}",
                    "; ".join(f"{name} {t:.2f}" for name, t in heavy[:3]),
                    "; ".join(f"{name} {t * 1e3:.2f}" for name, t in top[:3]),
                    f"{collector[0] * 1e3:.3f} / {collector[1]:.2f}",
                ]
            )
            print(table[-1], flush=True)
    header = [
        "shape",
        "method",
        "T",
        "batch",
        "K",
        "async scheduling",
        "step ms",
        "tokens / row / step",
        "floor / step (K=0)",
        "forward ms",
        "outside the forward (K=0)",
        "kernel ms / count",
        "top kernels ms",
        "top host ms",
        "GC ms / collections per step",
    ]
    text = markdown_table(header, table)
    report("decode_step", env, rows, text, keep=not args.smoke, json_path=args.json)


if __name__ == "__main__":
    main()
