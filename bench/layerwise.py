"""The KV sent layer by layer while the prefill runs (--kv-layerwise) against DecodeStream after it.

    python bench/layerwise.py [--device cuda] [--shape llama3-8b] [--prompts 1024,4096] [--repeat 3]

Both nodes in this process (loopback gRPC), a random-weight checkpoint of `--shape` (default:
a small shape whose prefill and KV handoff take comparable time on a CPU), K = 0 greedy, the
KV always over DecodeStream in 4 MiB chunks. Per prompt length and path: TTFT (the prefill
node's first token, which does not wait for the KV) and TT2T, the time to the second token:
the first the decode node makes, after the prefill, the KV handoff, admission and one decode
step. Layer by layer, the handoff overlaps the rest of the target's forward and the draft's
prefill; the difference in TT2T is what that overlap buys. Medians of --repeat requests.
Writes bench/results/layerwise-*.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import environment, markdown_table, random_model, random_pair, read, report, serving_nodes
from engine.paged_lm import bytes_per_token


def first_two(client, prompt: list[int]) -> tuple[float, float]:
    """(TTFT, time to the second token) of one greedy request."""
    call = client.stream(prompt_token_ids=prompt, max_new_tokens=2, greedy=True, num_speculative_tokens=0)
    first, second = read(call).checked().token_times()
    return first, second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="kv-heavy")
    parser.add_argument("--prompts", default="1024,4096")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    device = args.device
    target = random_model(args.shape, device)
    pair = random_pair(target)
    prompts = [int(p) for p in args.prompts.split(",")]
    per_token = bytes_per_token(target) * 9 // 8  # + the draft's
    kv_bytes = 2 * (max(prompts) + 64) * per_token
    rows, table = [], []
    for layerwise in (False, True):
        options = {"kv_streaming": True, "kv_layerwise": layerwise}
        with serving_nodes(pair, device, kv_bytes, max_batch=4, prefill_options=options) as (client, _, _):
            first_two(client, list(range(1, 33)))  # warm-up
            for length in prompts:
                prompt = [1 + (7 * i) % (target.vocab_size - 2) for i in range(length)]
                runs = [first_two(client, prompt) for _ in range(args.repeat)]
                ttft, tt2t = (statistics.median(r[i] for r in runs) for i in (0, 1))
                kv_mib = pair.contract().kv_bytes(length) / 2**20
                path = "layer by layer" if layerwise else "after the prefill"
                rows.append(
                    {"prompt": length, "layerwise": layerwise, "kv_mib": kv_mib, "ttft_s": ttft, "tt2t_s": tt2t}
                )
                table.append([length, f"{kv_mib:.0f}", path, f"{ttft * 1e3:.0f}", f"{tt2t * 1e3:.0f}"])
                print(table[-1], flush=True)
    header = ["prompt tokens", "KV MiB", "KV sent", "TTFT ms", "time to 2nd token ms"]
    text = markdown_table(header, sorted(table, key=lambda r: (r[0], r[2])))
    report("layerwise", environment() | {"shape": args.shape}, rows, text)


if __name__ == "__main__":
    main()
