"""What speculation buys at a KNOWN acceptance rate, whatever the draft model.

    python bench/acceptance.py [--device cuda] [--shape llama3-8b] [--alphas 0.5,0.7,0.8,0.9] [--ks 4]
                               [--batches 1,16] [--prompt-tokens 128] [--new-tokens 256] [--repeat 3]
                               [--seed 0] [--json PATH] [--smoke]

A draft model's speed-up mixes how often its drafts are accepted with what a speculating step
costs. Here an oracle drafts (`OracleProposer`): it knows the target's greedy continuation of
each prompt, and at each of its K positions proposes the target's own next token with
probability α and another token otherwise, as a point mass. Each draft is then accepted with
probability α, independently, so a verify step accepts α + α² + … + α^K drafts on average
(draft i is accepted with drafts 1..i-1 only). The oracle costs a table lookup: the figures are
what verification alone costs and yields, the ceiling that a real draft's forwards come off.

Greedy (T = 0) only: the continuation is the K = 0 greedy one, run first for each prompt.
Exactness makes every speculative run emit it token for token, which every run checks (a
verify pass that rounds differently from the K = 0 step, bf16 on a GPU, could flip a near tie;
after such a flip the oracle's "right" drafts are wrong, which the acceptance bound shows too).
A random model's EOS is an arbitrary id: it is switched off, so every request runs its budget.
Random weights give near-flat logits whose argmax bf16 rounding flips: `chained_logits` makes
the greedy continuation a permutation chain with a wide margin instead (same shapes, same bytes).

The random-weight Llama of a real shape (bench/harness.py's SHAPES: bf16 on a GPU) in the real prefill
and decode engines, in process (no gRPC). Per batch size the requests are prefilled once, at
K = 0 (the prefill node's drafts would be its draft model's, not the oracle's), and every run
decodes them anew with the K it asks for, adaptive K off. Each K runs once untimed first (its
CUDA graphs captured; the K = 0 continuation run does it for K = 0); then per repeat K = 0 and
every (α, K), one after the other, the same seeded work each repeat. A run is timed from the
end of its first engine step (which imports the KV) to its last. Per (batch, α, K): tokens/s
and its ratio to the same batch's K = 0 (medians over repeats); accepted drafts per verify
step against α + … + α^K; the per-draft acceptance (accepted / reached: drafts verified after
every draft before them was accepted) and whether it is within 4.5 binomial sigmas of α; the
mean engine step and its ratio to K = 0's (with async scheduling, on a GPU, a K = 0 run's last
step only reads the one before it: one step of ~--new-tokens counted too many); whether every
output equals the K = 0 continuation. Writes bench/results/acceptance-*.json (not with --smoke).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import dtype_for, environment, markdown_table, random_model, random_pair, report, sync
from decode_node.engine import DecodeConfig, DecodeEngine
from engine.paged_lm import bytes_per_token, paged_pair, pool_bytes_for
from engine.proposer import Plan, Proposer, Row
from engine.sequence import Stats
from engine.spec_config import SpeculativeConfig
from models.pair import ModelPair
from prefill_node.engine import PrefillConfig, PrefillEngine
from protos import pdspec_pb2
from protos.validation import DecodeInput, Receiver, validate_decode_request
from sampling.proposal import DRAFT, NO_PROPOSAL, Proposal
from sampling.tree import MAX_TREE_NODES

SIGMAS = 4.5  # how far the per-draft acceptance may be from α, in binomial standard deviations


class OracleProposer:
    """Draft i of a row: with probability α the token its K = 0 greedy continuation has after
    the row's history and drafts 1..i-1 (the target's own next token), else another one. Point
    masses (law None), chains. Rows are found by their prompt (`continuations`: prompt -> every
    token generated after it, the prefill node's first included; prompts of one length). The
    coin flips come from one generator seeded per run: a run is reproducible. Greedy rows only.
    A benchmark's tool (the `Proposer` protocol): no serving option selects it."""

    method, trees, max_tree_nodes, uses_draft, match_driven = "oracle", False, MAX_TREE_NODES, False, False
    sources = (DRAFT,)

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], alpha: float, vocab_size: int, seed: int):
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha: expected 0..1, got {alpha}")
        lengths = {len(prompt) for prompt in continuations}
        if len(lengths) != 1:
            raise ValueError(f"continuations: expected prompts of one length, got lengths {sorted(lengths)}")
        (self.prompt_tokens,) = lengths
        self.continuations = continuations
        self.alpha, self.vocab_size = alpha, vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    def start(self, rows: Sequence[Row], kv_needs: Sequence[int]) -> None:
        pass  # no draft model: no per-request state, no draft KV

    def stop(self, row: Row) -> None:
        pass

    def plan(self, rows: Sequence[Row], caps: Sequence[int]) -> list[Plan]:
        return [Plan(DRAFT, cap) for cap in caps]

    def max_nodes(self, depth: int, candidates: int) -> int:
        return depth  # a chain

    def propose(self, rows: Sequence[Row], plans: Sequence[Plan], depths: Sequence[int]) -> list[Proposal]:
        shape = (len(rows), max(depths, default=0))
        right = (torch.rand(shape, generator=self.generator) < self.alpha).tolist()  # [R, K]
        # another token: the right one + 1 + offset (mod V), offset < V - 1, is never the right one
        offsets = torch.randint(self.vocab_size - 1, shape, generator=self.generator).tolist()  # [R, K]
        out = []
        for row, depth, hits, offset in zip(rows, depths, right, offsets, strict=True):
            if depth <= 0:
                out.append(NO_PROPOSAL)
                continue
            if not row.params.is_greedy:  # a sampled row's next token is not its greedy continuation's
                raise ValueError("OracleProposer: expected greedy rows, got a sampled one")
            continuation = self.continuations[tuple(row.history[: self.prompt_tokens])]
            done = len(row.history) - self.prompt_tokens  # the continuation's tokens emitted so far
            ids = [
                token if hit else (token + 1 + o) % self.vocab_size
                for token, hit, o in zip(continuation[done : done + depth], hits[:depth], offset[:depth], strict=True)
            ]
            out.append(Proposal(ids, list(range(-1, depth - 1)), None, DRAFT))
        return out


def chained_logits(module, seed: int) -> None:
    """Give the random model a greedy continuation that rounding cannot flip. With std-0.02
    weights everywhere the logits are nearly flat, and a K+1-query verify pass, whose matmuls
    round differently in bf16 from a 1-query step's, flips their argmax within a few tokens
    (on an H200 the speculative outputs left K = 0's at once and the oracle's drafts were
    then 2% right). Here the embeddings have std 32, so the residual stream is mostly the
    current token's embedding (each random layer of the 8B shape adds ~2 per element, 32 of
    them ~12), and the head's rows
    are those embeddings permuted: the argmax is the permutation's image of the current token,
    by a margin of ~sqrt(hidden) standard deviations. Same shapes and bytes, so the same
    step times."""
    generator = torch.Generator(device=module.lm_head.weight.device).manual_seed(seed)
    embed = module.model.embed_tokens.weight
    with torch.no_grad():
        embed.normal_(0.0, 32.0, generator=generator)
        if module.lm_head.weight is embed:  # a tied head: untie it, as an untied checkpoint would be
            module.lm_head.weight = torch.nn.Parameter(embed.detach().clone(), requires_grad=False)
        order = torch.randperm(embed.shape[0], generator=generator, device=embed.device)
        module.lm_head.weight.copy_(embed[order])  # logit v is <h, e[order[v]]>: largest where order[v] = token


def expected_accepted(alpha: float, k: int) -> float:
    """Accepted drafts per verify step: draft i is accepted when drafts 1..i all are, α^i."""
    return sum(alpha**i for i in range(1, k + 1))


def within_bound(accepted: int, reached: int, alpha: float) -> bool:
    """Whether `accepted` of `reached` drafts is within SIGMAS binomial sigmas of α (exact at 0 and 1)."""
    if not reached:
        return True
    return abs(accepted / reached - alpha) <= SIGMAS * math.sqrt(alpha * (1 - alpha) / reached)


@dataclass(frozen=True)
class Run:
    outputs: list[list[int]]  # per request, every token the decode engine emitted
    seconds: float  # from the end of the first engine step to the end of the last
    steps: int  # engine steps in that time
    tokens: int  # tokens emitted in that time
    stats: list[Stats]  # per request


def decode(
    pair: ModelPair,
    config: DecodeConfig,
    inputs: list[DecodeInput],
    k: int,
    budget: int,
    proposer: Proposer | None,
) -> Run:
    """The requests through a fresh decode engine (`proposer`: None, the config's), each with K = k
    and `budget` tokens in all (the prefill node's first included)."""
    engine = DecodeEngine(pair, config, proposer=proposer)
    handles = [engine.submit(replace(x, num_speculative_tokens=k, max_new_tokens=budget)) for x in inputs]
    engine.step()  # admits them: their KV imported, one token each (what they received is no proposal)
    sync(config.device)
    start = time.perf_counter()
    steps = 0
    while engine.load:
        engine.step()
        steps += 1
    sync(config.device)
    seconds = time.perf_counter() - start
    outputs, stats = [], []
    for handle in handles:
        tokens = []
        while not handle.events.empty():
            event = handle.events.get()
            if event.error:
                raise RuntimeError(f"decode: {event.error}")
            tokens += event.tokens
            if event.finished:
                stats.append(event.stats)
        outputs.append(tokens)
    return Run(outputs, seconds, steps, sum(map(len, outputs)) - len(inputs), stats)


def counts(stats: list[Stats], k: int) -> dict[str, int]:
    """Verify steps, drafts, accepted drafts and drafts reached (verified after every draft before
    them was accepted: the first of each step, draft i + 1 where draft i was accepted)."""
    reached = sum(s.verify_steps + sum(s.accepted_per_position[: k - 1]) for s in stats)
    return {
        "verify_steps": sum(s.verify_steps for s in stats),
        "draft_tokens": sum(s.draft_tokens for s in stats),
        "accepted_drafts": sum(s.accepted_tokens for s in stats),
        "reached_drafts": reached,
    }


def prefilled(pair: ModelPair, device: str, batch: int, prompt_tokens: int, seed: int) -> list[DecodeInput]:
    """`batch` random greedy prompts through the prefill engine at K = 0, validated as the decode
    node does."""
    prefill = PrefillEngine(pair, PrefillConfig(device=device))
    receiver = Receiver.from_contract(pair.contract(), 1)
    generator = torch.Generator().manual_seed(seed)
    requests = [
        pdspec_pb2.GenerateRequest(
            prompt_token_ids=torch.randint(pair.target.vocab_size, (prompt_tokens,), generator=generator).tolist(),
            num_speculative_tokens=0,
            sampling=pdspec_pb2.SamplingParams(do_sample=False),
        )
        for _ in range(batch)
    ]
    inputs = []
    for done in prefill.prefill_many([prefill.check(r) for r in requests]):
        wire = pdspec_pb2.DecodeRequest.FromString(done.decode_request.SerializeToString())
        inputs.append(validate_decode_request(wire, receiver))
    return inputs


def measure(pair: ModelPair, args: argparse.Namespace, batch: int, rows: list[dict], table: list[list]) -> None:
    """Every (α, K) and K = 0 at one batch size: a row each in `rows` and `table`."""
    config = DecodeConfig(
        spec=SpeculativeConfig(max_speculative_tokens=max(args.ks), adaptive_k="off"),
        device=args.device,
        max_batch=batch,
    )
    inputs = prefilled(pair, args.device, batch, args.prompt_tokens, args.seed)
    # The last steps' drafts reach up to K - 1 tokens past the budget: the continuation covers them.
    reference = decode(pair, config, inputs, 0, args.new_tokens + max(args.ks), None)
    continuations = {
        tuple(x.prompt_token_ids): [x.first_token_id, *out] for x, out in zip(inputs, reference.outputs, strict=True)
    }
    if len(continuations) != batch:
        raise RuntimeError("prompts: expected distinct random prompts, got a repeat (the oracle finds rows by prompt)")
    expected = [out[: args.new_tokens - 1] for out in reference.outputs]  # the decode node's part of the budget
    vocab = pair.target.vocab_size

    def run(k: int, alpha: float) -> Run:
        oracle = OracleProposer(continuations, alpha, vocab, args.seed) if k else None
        return decode(pair, config, inputs, k, args.new_tokens, oracle)

    for k in args.ks:
        run(k, args.alphas[0])  # untimed: the CUDA graphs of its verify width captured
    configs = [(0, 0.0), *((k, alpha) for alpha in args.alphas for k in args.ks)]
    runs: dict[tuple[int, float], list[Run]] = {c: [] for c in configs}
    for _ in range(args.repeat):
        for c in configs:
            runs[c].append(run(*c))
    base_tps = statistics.median(r.tokens / r.seconds for r in runs[0, 0.0])
    base_step = statistics.median(r.seconds / r.steps for r in runs[0, 0.0])
    for k, alpha in configs:
        timed = runs[k, alpha]
        tps = statistics.median(r.tokens / r.seconds for r in timed)
        step = statistics.median(r.seconds / r.steps for r in timed)
        equal = sum(all(r.outputs[i] == expected[i] for r in timed) for i in range(batch))
        row = {
            "batch": batch,
            "alpha": alpha if k else None,
            "k": k,
            "tokens_per_s": tps,
            "speedup": tps / base_tps,
            "step_ms": step * 1e3,
            "step_ratio": step / base_step,
            "requests_equal_to_k0": equal,
            "outputs_equal_k0": equal == batch,
        }
        cells = ["-"] * 5
        if k:
            found = counts(timed[0].stats, k)  # every repeat ran the same seeded work
            measured = found["accepted_drafts"] / found["verify_steps"]
            per_draft = found["accepted_drafts"] / found["reached_drafts"]
            bound = within_bound(found["accepted_drafts"], found["reached_drafts"], alpha)
            row |= found | {
                "accepted_per_step": measured,
                "expected_accepted_per_step": expected_accepted(alpha, k),
                "per_draft_acceptance": per_draft,
                "acceptance_within_bound": bound,
            }
            cells = [
                f"{measured:.2f}",
                f"{expected_accepted(alpha, k):.2f}",
                f"{per_draft:.3f}",
                f"{found['reached_drafts']}",
                "yes" if bound else "NO",
            ]
        rows.append(row)
        table.append(
            [
                batch,
                alpha if k else "-",
                k,
                f"{tps:.0f}",
                f"{tps / base_tps:.2f}x",
                *cells,
                f"{step * 1e3:.2f}",
                f"{step / base_step:.2f}x",
                "yes" if equal == batch else f"NO ({equal}/{batch})",
            ]
        )
        print(table[-1], flush=True)


HEADER = [
    "batch",
    "α",
    "K",
    "tokens/s",
    "vs K = 0",
    "accepted / verify step",
    "α + … + α^K",
    "per-draft acceptance",
    "drafts reached",
    f"within {SIGMAS} σ of α",
    "step ms",
    "step / K = 0 step",
    "outputs = K = 0",
]


# Sized to take well under 4 minutes on one H200 with the default alphas, K and batches (an
# estimate: per batch size 17 runs of 256 tokens, ~1 s each on the 8B shape, after start-up).
SIZES = {"prompt_tokens": 128, "new_tokens": 256, "repeat": 3}
SMOKE_SIZES = {"prompt_tokens": 16, "new_tokens": 32, "repeat": 1}


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", default="llama3-8b", help="a shape of bench/harness.py's SHAPES")
    parser.add_argument("--alphas", type=floats, default=[0.5, 0.7, 0.8, 0.9], help="acceptance rates, 0..1")
    parser.add_argument("--ks", type=ints, default=[4], help="drafts per step (K = 0 always runs too)")
    parser.add_argument("--batches", type=ints, default=[1, 16])
    parser.add_argument("--prompt-tokens", type=int, help=f"default {SIZES['prompt_tokens']} (--smoke: 16)")
    parser.add_argument("--new-tokens", type=int, help=f"per request, default {SIZES['new_tokens']} (--smoke: 32)")
    parser.add_argument("--repeat", type=int, help=f"timed runs each, default {SIZES['repeat']} (--smoke: 1)")
    parser.add_argument("--seed", type=int, default=0, help="weights, prompts and the oracle's coin flips")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape, short runs (the CPU is fine)")
    args = parser.parse_args()
    for name, value in (SMOKE_SIZES if args.smoke else SIZES).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.smoke:
        args.shape = "smoke"
    if args.prompt_tokens < 1 or args.repeat < 1:
        parser.error(f"--prompt-tokens, --repeat: expected >= 1, got {args.prompt_tokens}, {args.repeat}")
    if not all(0.0 <= a <= 1.0 for a in args.alphas):
        parser.error(f"--alphas: expected values in 0..1, got {args.alphas}")
    if not all(k >= 1 for k in args.ks):
        parser.error(f"--ks: expected K >= 1 (K = 0 always runs), got {args.ks}")
    if args.new_tokens < 3:  # the prefill node's token, the admitting step's, then at least one timed
        parser.error(f"--new-tokens: expected >= 3, got {args.new_tokens}")
    device = args.device
    dtype = dtype_for(device)
    torch.manual_seed(args.seed)
    target = random_model(args.shape, device, dtype)
    chained_logits(target.module, args.seed)
    target.eos_token_ids = ()  # random weights: EOS is an arbitrary id, and every run should do the same work
    # The pair's draft is never run (the oracle drafts, K = 0 runs draft nothing): one layer, a small pool.
    raw = random_pair(target)
    longest = args.prompt_tokens + args.new_tokens + max(args.ks) + 1  # a request's KV
    tokens = pool_bytes_for(raw.target, max(args.batches), longest) // bytes_per_token(raw.target)
    pair = paged_pair(raw, tokens * (bytes_per_token(raw.target) + bytes_per_token(raw.draft)))
    env = environment()
    env |= {
        "shape": args.shape,
        "dtype": str(dtype).removeprefix("torch."),
        "prompt_tokens": str(args.prompt_tokens),
        "new_tokens": str(args.new_tokens),
        "repeat": str(args.repeat),
        "seed": str(args.seed),
    }
    rows: list[dict] = []
    table: list[list] = []
    for batch in args.batches:
        measure(pair, args, batch, rows, table)
    title = (
        f"### Acceptance-controlled speed-up ({args.shape}, {env['dtype']}, greedy, {args.prompt_tokens} prompt"
        f" + {args.new_tokens} new tokens, median of {args.repeat})"
    )
    text = f"{title}\n\n{markdown_table(HEADER, table)}"
    report("acceptance", env, rows, text, keep=not args.smoke, json_path=args.json)


if __name__ == "__main__":
    main()
