"""`pdspec train-draft`: distil a small draft from a Llama-family target.

`--kind layers` (models/distill.py): a draft of the target's first N layers, trained; DIR
receives data.pt (the generated sequences and the target's top-k laws, made once: a resumed
run reads them back), checkpoints/ (weights + optimizer state), and at the end a
transformers-style draft directory (config.json, model.safetensors, the target's tokenizer)
for `--draft-model DIR`; with --eval also eval.json.

`--kind eagle` (models/eagle_train.py): a hidden-state head over a reduced vocabulary
(`--draft-vocab`, default 8192); DIR also receives features.pt (the target's hidden states of
the same sequences), and at the end eagle.json + model.safetensors for
`--speculative-method eagle|hybrid --draft-model DIR`, and with --eval eval.json (acceptance by
position at T = 0 and 0.7, mean accepted drafts at K = 1..6).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

from pdspec.config import EnvArgumentParser

HELD_OUT_FRACTION = 10  # one generated sequence in ten is held out (at least one)
EVAL_K = 4
KINDS = ("layers", "eagle")
EAGLE_VOCAB = 8192  # a head's reduced vocabulary where --draft-vocab is 0


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {raw}")
    return value


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {raw}")
    return value


def _non_negative_float(raw: str) -> float:
    value = float(raw)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {raw}")
    return value


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {raw}")
    return value


def build_parser() -> EnvArgumentParser:
    parser = EnvArgumentParser(
        "train_draft", prog="pdspec train-draft", description="distil a small draft model from a Llama-family target"
    )
    flag = parser.add_flag
    flag("--target-model", required=True, help="smollm2-135m-instruct, a .gguf file or an HF checkpoint directory")
    flag(
        "--kind",
        default="layers",
        choices=KINDS,
        help="layers: a draft of the target's first --layers layers; eagle: a hidden-state head (one layer "
        "reading the target's low/mid/high-layer states, a reduced vocabulary)",
    )
    flag("--passes", default=3, type=_positive_int, help="eagle: training-time test passes (the head's own outputs)")
    flag(
        "--feature-weight",
        default=0.1,
        type=_non_negative_float,
        help="eagle: weight of the feature loss (smooth-L1 to the target's last hidden state; 0 = EAGLE-3's "
        "distribution loss alone)",
    )
    flag("--out", required=True, type=Path, help="output directory (draft, checkpoints, data, eval)")
    flag("--layers", default=2, type=_positive_int, help="decoder layers of the draft (at most the target's)")
    flag("--tokens", default=20000, type=_positive_int, help="target-generated training tokens, in total")
    flag("--max-new-tokens", default=128, type=_positive_int, help="tokens per generated turn (user turn, answer)")
    flag("--top-k", default=64, type=_non_negative_int, help="target law kept per position (0 = full vocabulary)")
    flag("--data", default=None, type=Path, help="extra training text: one document per line")
    flag("--steps", default=1000, type=_positive_int, help="optimizer steps in total")
    flag("--batch", default=8, type=_positive_int, help="sequences per optimizer step")
    flag("--gen-batch", default=32, type=_positive_int, help="sequences the target generates at once")
    flag(
        "--draft-vocab",
        default=0,
        type=_non_negative_int,
        help="a reduced head of the N most frequent ids, served through d2t.json (0 = the whole vocabulary)",
    )
    flag("--train-embeddings", default=False, type=bool, help="train the embeddings and head too (default: frozen)")
    flag("--lr", default=3e-4, type=_positive_float, help="peak AdamW learning rate")
    flag("--seed", default=0, type=int, help="seed of the generations and the data order")
    flag("--device", default="cpu", help="cpu, cuda or cuda:N")
    flag("--save-every", default=100, type=_positive_int, help="checkpoint period in steps")
    flag("--log-every", default=10, type=_positive_int, help="progress line period in steps")
    flag("--resume", default=False, type=bool, help="continue from the last checkpoint in --out")
    flag("--eval", default=False, type=bool, help="acceptance per position on held-out generations (eval.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    began = time.perf_counter()
    parser = build_parser()
    args = parser.parse_args(argv)
    from models import distill

    out: Path = args.out
    checkpoint = distill.latest_checkpoint(out)
    if args.resume and checkpoint is None:
        parser.error(f"--resume: expected a checkpoint in {out / 'checkpoints'}, got none")
    if not args.resume and checkpoint is not None:
        parser.error(f"--out: {out} holds checkpoints already; pass --resume to continue, or name another directory")
    if args.data is not None and not args.data.is_file():
        parser.error(f"--data: expected a text file, got {args.data}")

    from models.llama import LlamaCausalLM
    from models.loader import load_model, resolve_dtype

    try:
        target, tokenizer = load_model(args.target_model, dtype=resolve_dtype(None, args.device), device=args.device)
    except ValueError as err:
        parser.error(f"--target-model: {err}")
    if not isinstance(target, LlamaCausalLM):
        parser.error(f"--target-model: expected a Llama-family model (own model code), got {type(target).__name__}")
    total = target.config.num_layers
    if args.layers > total:
        parser.error(f"--layers: expected 1..{total} (the target's layer count), got {args.layers}")
    vocab = target.vocab_size
    if args.draft_vocab > vocab:
        parser.error(f"--draft-vocab: expected 0..{vocab} (the target's vocabulary size), got {args.draft_vocab}")

    try:
        train_items, held_out = _data(args, target, tokenizer)
    except DataMismatch as err:
        parser.error(f"--out: {err}")
    if args.kind == "eagle":
        return _train_eagle(args, parser, target, tokenizer, train_items, held_out, checkpoint, began)
    settings = distill.TrainSettings(
        args.steps, args.batch, args.lr, args.seed, args.layers, train_embeddings=args.train_embeddings
    )
    draft = distill.init_draft(target.module, args.layers, train_embeddings=args.train_embeddings)
    print(
        f"draft: the target's first {args.layers} of {total} layers, then trained; "
        f"{len(train_items)} training / {len(held_out)} held-out sequences",
        flush=True,
    )
    head_ids = None
    if args.draft_vocab:
        stops = [*tokenizer.eos_token_ids, *target.eos_token_ids]
        head_ids = distill.draft_vocabulary([item.tokens for item in train_items], args.draft_vocab, vocab, stops)
    held_tokens = [item.tokens for item in held_out]
    baseline = None
    if args.eval:  # the untrained draft is the layer-skip draft of --draft-layers N: the baseline
        baseline = distill.acceptance(target.module, draft, held_tokens, k=EVAL_K, head_ids=head_ids)
    try:
        distill.train(
            draft,
            train_items,
            held_out,
            settings,
            out,
            resume=checkpoint,
            save_every=args.save_every,
            log_every=args.log_every,
            log=lambda line: print(line, flush=True),
        )
    except distill.CheckpointMismatch as err:
        parser.error(f"--resume: {err}")
    distill.save_hf_draft(draft, tokenizer, out)
    if head_ids is not None:
        distill.save_d2t(head_ids, out)
    print(f"draft saved to {out} (serve it with --draft-model {out}); {time.perf_counter() - began:.0f} s in all")
    if args.eval:
        trained = distill.acceptance(target.module, draft, held_tokens, k=EVAL_K, head_ids=head_ids)
        (out / "eval.json").write_text(json.dumps({"trained": trained, "layer_skip": baseline}, indent=2) + "\n")
        print(_table(trained, baseline))
    return 0


def _train_eagle(args, parser, target, tokenizer, train_items, held_out, checkpoint, began) -> int:
    """`--kind eagle`: the head trained on the target's features (features.pt beside data.pt)."""
    import torch
    from safetensors.torch import load_file

    from models import distill, eagle_train
    from models.eagle import EAGLE_WEIGHTS, EagleConfig, save_eagle

    stops = [*tokenizer.eos_token_ids, *target.eos_token_ids]
    size = min(args.draft_vocab or EAGLE_VOCAB, target.vocab_size)
    head_ids = distill.draft_vocabulary([item.tokens for item in train_items], size, target.vocab_size, stops)
    config = EagleConfig.for_target(target, head_ids.tolist())
    module = target.module.requires_grad_(False)
    path = args.out / "features.pt"
    if path.is_file():  # data.pt matched these flags: its features are of the same sequences
        saved = torch.load(path, weights_only=True)
        features, held_features = saved["train"], saved["held"]
    else:
        started = time.perf_counter()
        features = eagle_train.target_features(
            module, [i.tokens for i in train_items], config.feature_layers, batch=args.batch
        )
        held_features = eagle_train.target_features(
            module, [i.tokens for i in held_out], config.feature_layers, batch=args.batch
        )
        torch.save({"train": features, "held": held_features}, path)
        print(f"target hidden states in {time.perf_counter() - started:.0f} s", flush=True)
    settings = eagle_train.HeadSettings(
        args.steps, args.batch, args.lr, args.seed, passes=args.passes, feature_weight=args.feature_weight
    )
    torch.manual_seed(args.seed)
    head = eagle_train.init_head(config, module)
    print(
        f"head: one layer on target layers {config.feature_layers}, {config.draft_vocab_size} draft ids; "
        f"{len(train_items)} training / {len(held_out)} held-out sequences",
        flush=True,
    )
    try:
        eagle_train.train_head(
            head,
            train_items,
            features,
            settings,
            args.out,
            resume=checkpoint,
            save_every=args.save_every,
            log_every=args.log_every,
            log=lambda line: print(line, flush=True),
        )
    except distill.CheckpointMismatch as err:
        parser.error(f"--resume: {err}")
    save_eagle(head, args.out)
    # evaluate what was saved: the weights rounded to the file's bfloat16
    head.load_state_dict(load_file(args.out / EAGLE_WEIGHTS))
    print(f"head saved to {args.out} (serve it with --speculative-method eagle --draft-model {args.out})", flush=True)
    if args.eval:
        held = [item.tokens for item in held_out]
        found = eagle_train.acceptance(head, module, held, temperature=0.7, batch=args.batch)
        result = {"k": found["k"], "starts": found["starts"], "T=0": found["greedy"], "T=0.7": found["stochastic"]}
        result |= {"seed": args.seed, "seconds": time.perf_counter() - began}
        (args.out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        for name in ("T=0", "T=0.7"):
            by_position = " ".join(f"{a:.3f}" for a in result[name]["per_position"])
            mean = " ".join(f"{a:.2f}" for a in result[name]["mean_accepted"])
            print(f"{name}: acceptance by position {by_position}; mean accepted drafts at K = 1..6: {mean}")
    print(f"{time.perf_counter() - began:.0f} s in all")
    return 0


class DataMismatch(ValueError):
    """DIR/data.pt was made with other data flags."""


def _data(args, target, tokenizer):
    """(training Targets, held-out Targets): read from DIR/data.pt when it was made with these
    flags, else generated and saved there."""
    import torch

    from models import distill

    path = args.out / "data.pt"
    made_with = {
        "target_model": str(args.target_model),
        "tokens": args.tokens,
        "max_new_tokens": args.max_new_tokens,
        "gen_batch": args.gen_batch,
        "top_k": args.top_k,
        "seed": args.seed,
        "data": None if args.data is None else hashlib.sha256(args.data.read_bytes()).hexdigest(),
    }
    if path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved["made_with"] != made_with:
            raise DataMismatch(f"{path} was made with other data flags ({saved['made_with']}); use another --out")
        return [distill.Targets(*item) for item in saved["train"]], [distill.Targets(*item) for item in saved["held"]]
    print(f"generating {args.tokens} tokens with the target...", flush=True)
    started = time.perf_counter()
    samples = distill.generate_samples(
        target,
        tokenizer,
        tokens=args.tokens,
        max_new_tokens=args.max_new_tokens,
        batch=args.gen_batch,
        seed=args.seed,
    )
    seconds = time.perf_counter() - started
    made = sum(len(s) for s in samples)
    print(f"generated {len(samples)} sequences ({made} tokens with prompts) in {seconds:.0f} s", flush=True)
    held_count = max(1, len(samples) // HELD_OUT_FRACTION)
    generated, held_seqs = samples[:-held_count], samples[-held_count:]
    if args.data is not None:
        generated += distill.text_samples(
            tokenizer,
            args.data.read_text(),
            max_length=max(len(s) for s in samples),
            bos=target.config.bos_token_id,
        )
    print("computing the target's distributions...", flush=True)
    started = time.perf_counter()
    train_items = distill.target_distributions(target.module, generated, top_k=args.top_k, batch=args.batch)
    held_out = distill.target_distributions(target.module, held_seqs, top_k=args.top_k, batch=args.batch)
    print(f"target distributions in {time.perf_counter() - started:.0f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "made_with": made_with,
            "train": [(t.tokens, t.ids, t.probs) for t in train_items],
            "held": [(t.tokens, t.ids, t.probs) for t in held_out],
        },
        path,
    )
    return train_items, held_out


def _table(trained: dict, baseline: dict) -> str:
    """Acceptance rate per draft position, trained draft against the layer-skip start."""
    temperature = f"T={trained['temperature']}"
    lines = [
        f"acceptance on held-out target generations (K = {trained['k']}, {trained['starts']} starts)",
        f"{'':>8}  {'trained':>17}  {'layer-skip start':>17}",
        f"{'position':>8}  {'greedy':>8} {temperature:>8}  {'greedy':>8} {temperature:>8}",
    ]
    rows = [
        (str(position), *values)
        for position, values in enumerate(
            zip(
                trained["greedy"]["per_position"],
                trained["stochastic"]["per_position"],
                baseline["greedy"]["per_position"],
                baseline["stochastic"]["per_position"],
                strict=True,
            )
        )
    ]
    rows.append(
        (
            "E[acc]",
            *(result[kind]["expected_accepted"] for result in (trained, baseline) for kind in ("greedy", "stochastic")),
        )
    )
    for name, g, s, base_g, base_s in rows:
        lines.append(f"{name:>8}  {g:>8.3f} {s:>8.3f}  {base_g:>8.3f} {base_s:>8.3f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
