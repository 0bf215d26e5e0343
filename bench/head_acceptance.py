"""A hidden-state head's acceptance on target generations its training never saw.

    python bench/head_acceptance.py --draft-model DIR [--target-model smollm2-135m-instruct]
                                    [--tokens 6000] [--max-new-tokens 128] [--gen-batch 16]
                                    [--seed 1] [--k 6] [--device cpu] [--smoke]

The target generates conversations exactly as `pdspec train-draft` makes its data (a sampled
user turn after the chat template's prefix, then a sampled answer), with a seed other than the
training's (its default is 0), so the sequences are held out by construction; the head then
drafts a chain of K from every position and `models.eagle_train.acceptance` scores it: greedy
(the head's argmax is the target's, every earlier one too) and at T = 0.7 (the chained expected
overlap of the two tempered laws). What `train-draft --eval` reports on its own held-out tenth,
for a head whose training data is gone. Results: head_acceptance-<hw>-<date>-<commit>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import environment, markdown_table, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft-model", required=True, help="a head's directory (eagle.json, model.safetensors)")
    parser.add_argument("--target-model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=6000, help="generated tokens in all (user turns and answers)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per generated turn")
    parser.add_argument("--gen-batch", type=int, default=16, help="conversations generated at once")
    parser.add_argument("--seed", type=int, default=1, help="the generations' seed (training's default is 0)")
    parser.add_argument("--k", type=int, default=6, help="chain length scored")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--smoke", action="store_true", help="a few tokens, no results file (checks the script)")
    args = parser.parse_args()
    if args.smoke:
        args.tokens, args.max_new_tokens, args.gen_batch = 32, 8, 2

    import torch

    from models import distill, eagle_train
    from models.eagle import load_eagle
    from models.loader import load_model, resolve_dtype

    env = environment()
    target, tokenizer = load_model(args.target_model, dtype=resolve_dtype(None, args.device), device=args.device)
    head = load_eagle(args.draft_model, target).head.float()
    started = time.perf_counter()
    with torch.inference_mode():
        sequences = distill.generate_samples(
            target,
            tokenizer,
            tokens=args.tokens,
            max_new_tokens=args.max_new_tokens,
            batch=args.gen_batch,
            seed=args.seed,
        )
    generated = time.perf_counter() - started
    found = eagle_train.acceptance(head, target.module, sequences, k=args.k, temperature=0.7)
    rows = {
        "draft_model": str(args.draft_model),
        "sequences": len(sequences),
        "tokens": sum(len(s) for s in sequences),
        "seed": args.seed,
        "generation_s": round(generated, 1),
        "starts": found["starts"],
        "T=0": found["greedy"],
        "T=0.7": found["stochastic"],
    }
    table = markdown_table(
        ["T", *[f"pos {i}" for i in range(args.k)], *[f"E[acc] K={k}" for k in (1, 3, 5)]],
        [
            [
                name,
                *[f"{a:.3f}" for a in rows[name]["per_position"]],
                *[f"{rows[name]['mean_accepted'][k - 1]:.2f}" for k in (1, 3, 5) if k <= args.k],
            ]
            for name in ("T=0", "T=0.7")
        ],
    )
    text = (
        f"{len(sequences)} held-out conversations ({rows['tokens']} tokens, seed {args.seed}), "
        f"{found['starts']} chain starts\n{table}"
    )
    report("head_acceptance", env, rows, text, keep=not args.smoke)


if __name__ == "__main__":
    main()
