"""Model backends on the CPU: one verify pass over K+1 positions vs K+1 single steps.

    python bench/models.py

Speculation pays when scoring K+1 positions in one `extend` costs far less than K+1
one-token extends. For each backend (the built-in n-gram target, and a small random-weight
HF Llama when transformers is installed) and K in {1, 4, 8}: the time of extend with 1
position, with K+1 positions in one call, and of K+1 one-position calls, from the same
state (truncated back after each run). Writes bench/results/models-*.json.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import environment, markdown_table, median_ms, write_results
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

    one_ms = median_ms(lambda: one_call(1), repeat=20)
    for k in KS:
        batch_ms = median_ms(lambda k=k: one_call(k + 1), repeat=20)
        steps_ms = median_ms(lambda k=k: single_steps(k + 1), repeat=20)
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


def main() -> None:
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
    print(text)
    print("wrote", write_results("models", env, rows, text))


if __name__ == "__main__":
    main()
