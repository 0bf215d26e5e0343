"""Host cost per row of a decode step's bookkeeping outside the forward, on the CPU.

    python bench/host_work.py [--baseline DIR] [--repeat 7]

Per-row costs of every speculating step on the engine thread, each timed alone (median of
`--repeat` runs, one torch thread), for this checkout and, with `--baseline`, another one (a
baseline commit in a worktree: its modules loaded beside this checkout's, the two timed
alternately in one process, since a VM's speed drifts between processes):
* prompt lookup: a row's context grows by 3 tokens (its step emitted them), then two matches
  with drafts after the context (what a row drafting ahead asks: the guess, then its drafts),
  on a 300-token context of 50 distinct tokens;
* prompt lookup, no match: a row's context grows by 1 token, then one match (what the policy
  asks of every drafting row after every step, `SpecPolicy.advanced`), on a 300-token context of
  distinct tokens, which never matches;
* the speculation policy, no match: 16 prompt-lookup rows (K = 4, 256-token prompts of distinct
  tokens, async scheduling) step after step: the batch's `hold`, then per row `ran_plain`, its
  token appended and `advanced` (its next match looked for and priced), per row;
* the speculation policy, held: the same rows on contexts that repeat a 7-token phrase (every row
  has a match), each step held at K = 0 by the batch gate (which measured a speculating step at
  100x a K = 0 one, so no acceptance pays for it): the batch's `hold` and per row `ran_plain`, its
  token appended and `advanced`, per row;
* metrics: one verified row recorded on a node's Prometheus series (verify step, source, chosen
  K), 4 drafts of which 2 accepted, published every 16 rows (a batch-16 step's end) where the tree
  has `NodeMetrics.flush`.
Writes bench/results/host_work-*.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import timeit
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
ROWS = 2000  # row-steps per run


def lookup_us(context_index) -> float:
    rng = random.Random(0)
    tokens = [rng.randrange(50) for _ in range(300)]
    index = context_index(tokens, 2, 5)
    index.match(4)
    emitted = [[rng.randrange(50) for _ in range(3)] for _ in range(ROWS)]

    def steps() -> None:
        for new in emitted:
            tokens.extend(new)
            index.match(4, [1, 2, 3, 4])
            index.match(4, [1, 2, 3, 4, 5])

    return timeit.timeit(steps, number=1) / ROWS * 1e6


def lookup_plain_us(context_index) -> float:
    tokens = list(range(1, 301))
    index = context_index(tokens, 2, 5)
    index.match(4)
    emitted = range(1000, 1000 + ROWS)

    def steps() -> None:
        for new in emitted:
            tokens.append(new)
            index.match(4)

    return timeit.timeit(steps, number=1) / ROWS * 1e6


def metrics_us(node_metrics) -> float:
    metrics = node_metrics("decode", 4, methods=["prompt-lookup"], sources=["prompt-lookup"])
    chosen = getattr(metrics, "record_chosen", None) or (lambda m, d: metrics.chosen_k.labels(m).observe(d))
    flush = getattr(metrics, "flush", None) or (lambda: None)  # a tree that publishes as it records

    def rows() -> None:
        for row in range(ROWS):
            metrics.record_step(False, 4, 2, 3)
            metrics.record_source("prompt-lookup", 4, 2)
            chosen("prompt-lookup", 4)
            if row % 16 == 15:  # a batch-16 step ends
                flush()

    return timeit.timeit(rows, number=1) / ROWS * 1e6


def policy_us(modules: dict, held: bool = False) -> float:
    spec_config, proposers, adaptive, sequence, sampling, spec_policy = (
        modules[name] for name in ("spec_config", "proposers", "adaptive", "sequence", "sampling", "spec_policy")
    )
    spec = spec_config.SpeculativeConfig(max_speculative_tokens=4, method="prompt-lookup")
    proposer = proposers.PromptLookupProposer((2, 5), False)
    costs = adaptive.StepCosts((1.0, 1.3, 1.4, 1.5, 1.6), 0.0, 1.2)
    policy = spec_policy.SpecPolicy(spec, proposer, costs, pipelined=True)
    if held:  # a gate that measured speculating steps 100x a K = 0 one: it holds every step
        for speculated, seconds in ((True, 100.0), (True, 100.0), (False, 1.0), (False, 1.0)):
            policy.gate.record(16, speculated, seconds)
    batch, steps = 16, ROWS // 16
    phrase = [7, 3, 9, 1, 4, 8, 2]
    seqs = []
    for r in range(batch):
        seq = sequence.Sequence(
            prompt=[1000 * r + phrase[j % 7] for j in range(256)]
            if held
            else list(range(1000 * r + 1, 1000 * r + 257)),
            params=sampling.SamplingParams(),
            budget=1 << 20,
            eos_token_ids=(0,),
            stop_token_ids=(),
            rng=sampling.RequestRng(None, stream="decode"),
            k=4,
        )
        proposer.start([seq], [0])
        policy.admit(seq)
        seqs.append(seq)
    unread = set(seqs)

    def run() -> None:
        for step in range(steps):
            policy.hold(seqs, unread)
            for r, seq in enumerate(seqs):
                policy.ran_plain(seq)
                seq.append([1000 * r + phrase[step % 7] if held else 100_000 + batch * step + r])
                policy.advanced(seq)

    return timeit.timeit(run, number=1) / (steps * batch) * 1e6


PACKAGES = ("common", "decode_node", "engine", "models", "pdspec", "prefill_node", "protos", "sampling")


def project(root: Path) -> dict:
    """The policy's modules as the tree at `root` has them: the project's packages are dropped
    from sys.modules first, so each tree's modules import their own."""
    for name in [n for n in sys.modules if n.split(".")[0] in PACKAGES]:
        del sys.modules[name]
    sys.path.insert(0, str(root))
    try:
        names = ("spec_config", "proposers", "adaptive", "sequence", "spec_policy")
        return {name: importlib.import_module(f"engine.{name}") for name in names} | {
            "sampling": importlib.import_module("sampling")
        }
    finally:
        sys.path.remove(str(root))


def load(root: Path, relative: str, name: str):
    """The module at `root`/`relative`, under its own `name` (its imports resolve here)."""
    spec = importlib.util.spec_from_file_location(name, root / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    import torch

    from bench.harness import environment, markdown_table, report

    torch.set_num_threads(1)
    trees = {"this": HERE} | ({"baseline": args.baseline.resolve()} if args.baseline else {})
    modules = {
        tree: (load(root, "engine/prompt_lookup.py", f"lookup_{t}"), load(root, "pdspec/metrics.py", f"metrics_{t}"))
        for t, (tree, root) in enumerate(trees.items())
    }
    policies = {tree: project(root) for tree, root in trees.items()}
    costs = ("prompt_lookup_us", "prompt_lookup_no_match_us", "policy_no_match_us", "policy_held_us", "metrics_us")
    found: dict[str, dict[str, list[float]]] = {tree: {name: [] for name in costs} for tree in trees}
    for _ in range(args.repeat):
        for tree, (lookup, metrics) in modules.items():
            found[tree]["prompt_lookup_us"].append(lookup_us(lookup.ContextIndex))
            found[tree]["prompt_lookup_no_match_us"].append(lookup_plain_us(lookup.ContextIndex))
            found[tree]["policy_no_match_us"].append(policy_us(policies[tree]))
            found[tree]["policy_held_us"].append(policy_us(policies[tree], held=True))
            found[tree]["metrics_us"].append(metrics_us(metrics.NodeMetrics))
    rows = {tree: {name: statistics.median(times) for name, times in by.items()} for tree, by in found.items()}
    table = []
    for name in costs:
        line = [name.removesuffix("_us"), f"{rows['this'][name]:.1f}"]
        if "baseline" in rows:
            line += [f"{rows['baseline'][name]:.1f}", f"{rows['baseline'][name] / rows['this'][name]:.2f}x"]
        table.append(line)
    header = ["per row and step", "µs (median)"] + (["baseline µs", "speed-up"] if "baseline" in rows else [])
    env = environment()
    env["baseline"] = str(args.baseline or "")
    report("host_work", env, rows, markdown_table(header, table))


if __name__ == "__main__":
    main()
