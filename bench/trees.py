"""Multi-draft trees with SmolLM2-135M-Instruct and a layer-skip draft: acceptance and tokens/s.

    python bench/trees.py [--device cuda] [--draft-layers 8] [--prompts 4] [--new-tokens 32]

Through the real prefill and decode engines at batch 1 (in process, no gRPC), for each
temperature (0.7, 1.0), draft law and candidates per node k in {1, 2, 4} at depth K = 4
(tree shapes from engine/proposer.tree_shape, e.g. k = 2 -> (2, 2, 2, 2), 30 nodes), and a
depth-1 tree (K = 1) per k: acceptance per depth, accepted tokens by candidate rank, mean
accept length (tokens emitted per verify pass), tokens/s and the speed-up vs K = 0 of the
same run and temperature, and vs the k = 1 chain. Every configuration first runs once untimed
(on a GPU that captures the CUDA graphs of its shapes).

Next to the measured depth-1 acceptance: its expectation at the same contexts. Along each
request's K = 0 continuation, the target's q and the draft's p at every position give the
per-node acceptance of k candidates: the closed form sum(min(p, q)) for k = 1, and for
k = 2, 4 the mean over 256 simulated draws per position (48 positions) of the real
sampler on a one-level tree
(candidates drawn without replacement by `propose_candidates`, verified by
`tree_rejection_sample`). Writes bench/results/trees-*.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.harness import dtype_for, environment, markdown_table, sync, write_results
from decode_node.engine import DecodeConfig, DecodeEngine
from engine.paged_lm import paged_pair
from engine.proposer import shape_nodes, tree_shape
from engine.spec_config import SpeculativeConfig
from models.loader import load_pair
from prefill_node.engine import PrefillConfig, PrefillEngine
from protos import pdspec_pb2
from protos.validation import Receiver, validate_decode_request
from sampling import SamplingParams, SamplingTensors, propose_candidates, tree_rejection_sample
from sampling.filtering import filtered_probs
from sampling.proposal import DraftLaw

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "Write a short poem about the sea.",
    "The three primary colors are",
    "Explain what a neural network is in one sentence.",
    "My favourite food is",
]
CANDIDATES = (1, 2, 4)
SIMULATED_DRAWS = 256  # per position
SIMULATED_POSITIONS = 48  # evenly spaced over all requests' contexts


def run_request(pair, ids, *, k, candidates, law, temperature, seed, new_tokens, device) -> dict:
    """One seeded request: prefill untimed, the decode node's steps timed."""
    prefill = PrefillEngine(
        pair, PrefillConfig(spec=SpeculativeConfig(draft_law=law, max_draft_candidates=4), device=device)
    )
    decode = DecodeEngine(
        pair,
        DecodeConfig(
            spec=SpeculativeConfig(max_speculative_tokens=max(k, 1), draft_law=law), max_batch=1, device=device
        ),
    )
    request = pdspec_pb2.GenerateRequest(
        request_id=str(seed),
        prompt_token_ids=ids,
        num_speculative_tokens=k,
        draft_candidates=candidates,
        sampling=pdspec_pb2.SamplingParams(
            do_sample=True, temperature=temperature, seed=seed, max_new_tokens=new_tokens
        ),
    )
    prefilled = prefill.prefill(prefill.check(request))
    tokens = [prefilled.first_token]
    if prefilled.finish_reason:
        return {"tokens": tokens, "seconds": 0.0, "stats": None}
    wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
    receiver = Receiver.from_contract(pair.contract(), max(k, 1), max_draft_candidates=4)
    handle = decode.submit(validate_decode_request(wire, receiver))
    start = time.perf_counter()
    while decode.load:
        decode.step()
    sync(device)
    seconds = time.perf_counter() - start
    stats = None
    while not handle.events.empty():
        event = handle.events.get()
        tokens += event.tokens
        stats = event.stats or stats
    return {"tokens": tokens, "seconds": seconds, "stats": stats}


def measure(pair, prompts, *, k, candidates, law, temperature, new_tokens, device) -> dict:
    """The second of two identical runs: the first captures the CUDA graphs of its shapes."""

    def run(i: int, ids: list[int]) -> dict:
        return run_request(
            pair,
            ids,
            k=k,
            candidates=candidates,
            law=law,
            temperature=temperature,
            seed=i,
            new_tokens=new_tokens,
            device=device,
        )

    for i, ids in enumerate(prompts[:1] if device == "cpu" else prompts):
        run(i, ids)
    runs = [run(i, ids) for i, ids in enumerate(prompts)]
    emitted = sum(len(r["tokens"]) - 1 for r in runs)  # the decode node's tokens
    seconds = sum(r["seconds"] for r in runs)
    stats = [r["stats"] for r in runs if r["stats"] is not None]
    steps = sum(s.verify_steps for s in stats)
    per_depth = [0.0] * max(k, 1)
    per_rank = [0.0] * 4
    for s in stats:
        for d, n in enumerate(s.accepted_per_position):
            per_depth[d] += n
        for rank, n in enumerate(s.accepted_per_rank[:4]):
            per_rank[rank] += n
    return {
        "k": k,
        "candidates": candidates,
        "shape": list(tree_shape(k, candidates)) if k else [],
        "nodes": shape_nodes(tree_shape(k, candidates)) if k else 0,
        "tokens": emitted,
        "seconds": seconds,
        "tokens_per_s": emitted / seconds if seconds else 0.0,
        "verify_steps": steps,
        "acceptance_per_depth": [n / max(steps, 1) for n in per_depth],
        "accepted_per_rank": per_rank,
        "mean_accept_length": emitted / steps if steps else 1.0,  # tokens per verify pass
        "continuations": [r["tokens"] for r in runs],
    }


def expected_acceptance(pair, prompts, continuations, *, law, temperature, device) -> dict[int, float]:
    """Per-node acceptance of k candidates at the contexts of the K = 0 continuations."""
    target, draft = pair.target, pair.draft
    q_rows, p_rows = [], []
    for ids, tokens in zip(prompts, continuations, strict=True):
        t_logits, t_state = target.prefill(ids)
        d_logits, d_state = draft.prefill(ids)
        rest = tokens[:-1]  # the contexts of tokens[1:] (tokens[0] came after the prompt)
        q_rows.append(torch.cat([t_logits[None], target.extend(t_state, rest)]) if rest else t_logits[None])
        p_rows.append(torch.cat([d_logits[None], draft.extend(d_state, rest)]) if rest else d_logits[None])
        target.release(t_state)
        draft.release(d_state)
    q_logits, p_logits = torch.cat(q_rows).float(), torch.cat(p_rows).float()  # [P, Vt], [P, Vd]
    positions = torch.linspace(0, q_logits.shape[0] - 1, min(SIMULATED_POSITIONS, q_logits.shape[0])).long()
    reps = SIMULATED_DRAWS
    params = SamplingTensors.from_params([SamplingParams(do_sample=True, temperature=temperature)] * reps, device)
    d2t = pair.d2t.to(device)
    generator = torch.Generator().manual_seed(0)
    out = {}
    for k in CANDIDATES:
        accepted = 0.0
        for position in positions.tolist():
            q = filtered_probs(q_logits[position : position + 1].to(device), params.select([0]))  # [1, Vt]
            logits = p_logits[position : position + 1].to(device).expand(reps, -1)  # [reps, Vd]
            u = torch.rand(reps, 3 * k + 1, generator=generator).to(device)
            sample = propose_candidates(law, logits, params, u[:, :k].contiguous(), k)
            ids = d2t.map_tokens(sample.token_ids)  # [reps, k] target ids
            probs = None
            if sample.probs is not None:
                probs = d2t.map_probs(sample.probs.reshape(reps * k, -1)).view(reps, k, -1)
            result = tree_rejection_sample(
                ids,
                torch.full((reps, k), -1, dtype=torch.int64, device=device),  # k children of the root
                sample.valid.sum(-1),  # the candidates with mass come first
                probs,
                q[:, None].expand(reps, k + 1, -1).contiguous(),
                torch.zeros(reps, k + 1, dtype=torch.int64, device=device),  # unused: every row samples
                u[:, k : 2 * k].contiguous(),
                u[:, 2 * k :].contiguous(),
                torch.ones(reps, dtype=torch.bool, device=device),
            )
            accepted += float((result.accepted_token_num > 1).float().mean())
        out[k] = accepted / len(positions)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target-model", default="smollm2-135m-instruct", help="a name, GGUF file or directory")
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--laws", nargs="+", default=[law.value for law in DraftLaw])
    args = parser.parse_args()

    dtype = dtype_for(args.device)
    pair = load_pair(target_model=args.target_model, draft_layers=args.draft_layers, dtype=dtype, device=args.device)
    pair = paged_pair(pair, args.kv_cache_bytes, eager=not args.device.startswith("cuda"))
    prompts = [pair.tokenizer.encode(p) for p in PROMPTS[: args.prompts]]
    results, table = [], []
    for temperature in args.temperatures:
        for law in [DraftLaw(v) for v in args.laws]:
            base = measure(
                pair,
                prompts,
                k=0,
                candidates=1,
                law=law,
                temperature=temperature,
                new_tokens=args.new_tokens,
                device=args.device,
            )
            expected = expected_acceptance(
                pair, prompts, base["continuations"], law=law, temperature=temperature, device=args.device
            )
            rows = []
            for k in (1, 4):
                for candidates in CANDIDATES:
                    row = measure(
                        pair,
                        prompts,
                        k=k,
                        candidates=candidates,
                        law=law,
                        temperature=temperature,
                        new_tokens=args.new_tokens,
                        device=args.device,
                    )
                    row["expected_depth1_acceptance"] = expected[candidates]
                    row["speedup_vs_k0"] = row["tokens_per_s"] / base["tokens_per_s"]
                    rows.append(row)
            for row in rows:
                chain = next(r for r in rows if r["k"] == row["k"] and r["candidates"] == 1)
                row["speedup_vs_chain"] = row["tokens_per_s"] / chain["tokens_per_s"]
            for row in [base, *rows]:
                row.pop("continuations")
            results.append({"temperature": temperature, "law": law.value, "k0": base, "trees": rows})
            for r in rows:
                table.append(
                    [
                        temperature,
                        law.value,
                        r["k"],
                        r["candidates"],
                        r["nodes"],
                        f"{r['acceptance_per_depth'][0]:.3f}",
                        f"{r['expected_depth1_acceptance']:.3f}",
                        f"{r['mean_accept_length']:.2f}",
                        f"{r['tokens_per_s']:.1f}",
                        f"{base['tokens_per_s']:.1f}",
                        f"{r['speedup_vs_k0']:.2f}x",
                        f"{r['speedup_vs_chain']:.2f}x",
                    ]
                )
            print(table[-len(rows) :], flush=True)
    header = [
        "T",
        "law",
        "K",
        "k",
        "nodes",
        "depth-1 acc",
        "expected",
        "tokens/step",
        "tok/s",
        "K=0 tok/s",
        "vs K=0",
        "vs chain",
    ]
    text = markdown_table(header, table)
    print(text)
    config = {
        "device": args.device,
        "draft_layers": args.draft_layers,
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "simulated_draws": SIMULATED_DRAWS,
        "simulated_positions": SIMULATED_POSITIONS,
    }
    print(
        write_results(
            f"trees-smollm2-{args.device.replace(':', '')}", environment(), {"config": config, "results": results}, text
        )
    )


if __name__ == "__main__":
    main()
