"""One speculative verification step over a batch with mixed sampling parameters.

Glues the target sampler, the per-request RNG and the rejection samplers. `Verifier.verify`
takes a step's proposals as one `VerifyBatch` (sampling/batch.py, built from target-space
`Proposal`s: `DraftToTargetMap.proposal` maps a draft's law first) with the target's logits.
Per row and step the request's stream yields 2*(K+1) uniforms in a fixed order:
K+1 for the target sampler, then K+1 for rejection sampling, so a seeded request gets
the same tokens whatever else is in the batch; the whole batch's are computed on the
device in one go (sampling/rng.py). A candidate tree of N nodes (the tree kernel)
draws 2*(N+1) the same way: its node n tests with rejection uniform n, and the residual
draw after the children of a node are all rejected uses uniform (its last child + 1) —
for a chain exactly the chain's rule, and in a breadth-first layout never a uniform the
walk has used (every node the walk tests precedes that index, every later one is untested).

Coupled rows (`VerifyBatch.positions`): a sampled row whose proposal is a point mass may be
verified by coupling instead. Its target tokens are drawn with the uniforms of their sequence
positions (`RequestRng.at`), and a draft is accepted iff it equals the target token drawn
there — the greedy rule applied to sampled tokens. A draft d is then accepted with probability
q(d), as by the rejection test, and at the first mismatch the token emitted is the target's own
draw, distributed as q given that it is not d, which is the residual: the output law is q's.
Every token such a row emits is the one a K = 0 step at its position would draw, so a seeded
request's tokens do not depend on K, nor on whether a step drafted at all. The row draws
nothing from its stream. Only a point-mass proposal may be coupled: a stochastic draft law is
not what the greedy rule tests.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.transfer import device_tensor, indexed, shared_tensor, to_device
from sampling.batch import VerifyBatch
from sampling.filtering import restrict
from sampling.params import SamplingParams, SamplingTensors
from sampling.rejection import Backend, RejectionSampler
from sampling.rng import RequestRng, position_uniforms, stream_uniforms
from sampling.target_sampler import sample_target
from sampling.tree import TreeResult, tree_rejection_sample


@dataclass(frozen=True)
class StepStats:
    """Per-row counts for metrics. accepted_tokens counts accepted DRAFT tokens only."""

    do_sample: torch.Tensor  # [B] bool, effective mode (False on greedy rows)
    draft_tokens: torch.Tensor  # [B] int64, K for every row
    accepted_tokens: torch.Tensor  # [B] int64, 0..K
    accepted_per_position: torch.Tensor  # [B, K] bool


@dataclass(frozen=True)
class VerifyResult:
    output_token_ids: torch.Tensor  # [B, K+1] int32, -1 after the last emitted token
    accepted_token_num: torch.Tensor  # [B] int32, emitted tokens per row (1..K+1)
    stats: StepStats
    accepted_nodes: torch.Tensor | None = None  # trees: [B, N] int32 node of each accepted token, -1 after

    def host(self) -> tuple[list[list[int]], list[list[int]] | None]:
        """(every row's emitted tokens, every tree row's accepted nodes or None): the step's
        one device -> host transfer."""
        parts = [self.output_token_ids, self.accepted_token_num[:, None]]
        if self.accepted_nodes is not None:
            parts.append(self.accepted_nodes)
        packed = torch.cat([p.to(torch.int64) for p in parts], 1).cpu().tolist()  # [B, K+2 (+N)]
        width = self.output_token_ids.shape[1]
        emitted = [row[: row[width]] for row in packed]
        if self.accepted_nodes is None:
            return emitted, None
        return emitted, [row[width + 1 : width + row[width]] for row in packed]

    def emitted(self, row: int) -> list[int]:
        """The tokens row `row` emits this step, in order."""
        return self.output_token_ids[row, : int(self.accepted_token_num[row])].tolist()


class Verifier:
    """Verifies K drafts per row against the target's K+1 logit rows."""

    def __init__(
        self,
        backend: Backend = "auto",
        device: torch.device | str = "cpu",
        sampler: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
        tree_sampler: Callable[..., TreeResult] | None = None,
        *,
        check_values: bool = True,
    ):
        """check_values=False: callers whose draft ids were validated at their boundary skip
        the samplers' value checks, each a host wait per step (ids and uniforms in range;
        the kernels clamp ids either way, so no memory is touched out of bounds)."""
        self.device = torch.device(device)
        # `sampler` / `tree_sampler` replace the chain / tree rejection samplers (the tests
        # plug in deliberately biased ones).
        chain = RejectionSampler(backend, self.device)
        self.backend = chain.backend if sampler is None else "custom"  # what GetInfo reports
        self.sampler = sampler or functools.partial(chain, check_values=check_values)
        self.tree_sampler = tree_sampler or functools.partial(
            tree_rejection_sample, backend=chain.backend, check_values=check_values
        )

    def verify(
        self,
        batch: VerifyBatch,
        target_logits: torch.Tensor | Sequence[torch.Tensor],
        params: Sequence[SamplingParams],
        rngs: Sequence[RequestRng],
    ) -> VerifyResult:
        """One step: row b's proposal in `batch` (sampling/batch.py) against the target's logits
        after its last emitted token and after each node, target_logits [B, N+1, Vt] (any float
        dtype), or B tensors [N_b+1, Vt] (stacked; where N_b differ, padded with copies of each
        row's last logits, which nothing reads). params and rngs:
        one per row. Chains (`batch.chain`) take the chain kernel, anything else the tree
        kernel (sampling/proposal.py's layout), one launch for the batch either way.

        batch.positions[b]: the sequence position of row b's first target token, for a row
        verified by coupling (its proposal must be a point mass); a coupled tree row's context
        at depth d draws with the uniform of position positions[b] + d (siblings share it: only
        one of them is ever emitted). batch.bitmask (structured outputs) restricts every
        context's logits to the grammar's tokens there, so q is the masked law both where the
        target draws and where the drafts are tested: a forbidden draft has q = 0."""
        batch.check()
        rows = batch.rows
        if len(params) != rows or len(rngs) != rows:
            raise ValueError(f"params/rngs: expected {rows} entries each, got {len(params)} and {len(rngs)}")
        if isinstance(target_logits, torch.Tensor):
            logits = target_logits
        elif batch.chain and not batch.ragged:
            logits = torch.stack(list(target_logits))
        else:
            logits = padded(list(target_logits))
        logits = logits.to(self.device) if batch.chain else logits.to(self.device, torch.float32)
        if logits.dim() != 3 or tuple(logits.shape[:2]) != (rows, batch.nodes + 1):
            raise ValueError(f"target_logits: expected shape [{rows}, {batch.nodes + 1}, Vt], got {list(logits.shape)}")
        if batch.bitmask is not None:  # structured outputs: q is the law of the allowed tokens
            logits = restrict(logits, to_device(batch.bitmask, self.device))
        coupled = _coupled(params, batch.positions, rows)
        if batch.chain:
            return self._verify_chain(batch, logits, params, rngs, coupled)
        return self._verify_tree(batch, logits, params, rngs, coupled)

    def _verify_chain(
        self,
        batch: VerifyBatch,
        target_logits: torch.Tensor,  # [B, K+1, Vt] on the device
        params: Sequence[SamplingParams],
        rngs: Sequence[RequestRng],
        coupled: list[bool],
    ) -> VerifyResult:
        rows, k = batch.rows, batch.nodes
        tensors = SamplingTensors.from_params(params, self.device)
        # [B, 2(K+1)]: a sampled row its stream's next 2(K+1); a coupled row the uniforms of its
        # K+1 positions, then 0; a greedy row 0 (argmaxes read none).
        counts = [k + 1 if c else 0 if p.is_greedy else 2 * (k + 1) for p, c in zip(params, coupled, strict=True)]
        at, shift = None, None
        if any(coupled):
            at = [position if c else None for position, c in zip(batch.positions, coupled, strict=True)]
            shift = batch.position_shift
        uniforms = stream_uniforms(rngs, counts, self.device, 2 * (k + 1), at, shift)
        target = sample_target(target_logits, tensors, uniforms[:, : k + 1])
        output, emitted = self.sampler(
            _on_device(batch.draft_token_ids, self.device),
            None if batch.draft_probs is None else batch.draft_probs.to(self.device),
            target.probs,
            target.token_ids,
            uniforms[:, k + 1 :].contiguous(),
            _tested(tensors, coupled, self.device) if k else tensors.do_sample,  # K = 0 tests nothing: no copy
        )
        if batch.ragged:  # point masses padded to the widest row: each emits at most its own drafts + 1
            draft_tokens = device_tensor(batch.num_nodes, torch.int64, self.device)
            emitted = torch.minimum(emitted, (draft_tokens + 1).to(emitted.dtype))
        else:
            draft_tokens = torch.full((rows,), k, dtype=torch.int64, device=self.device)
        accepted = emitted.long() - 1
        stats = StepStats(
            do_sample=tensors.do_sample,
            draft_tokens=draft_tokens,
            accepted_tokens=accepted,
            accepted_per_position=torch.arange(k, device=self.device) < accepted[:, None],
        )
        return VerifyResult(output, emitted, stats)

    def _verify_tree(
        self,
        batch: VerifyBatch,
        target_logits: torch.Tensor,  # [B, N+1, Vt] float32 on the device
        params: Sequence[SamplingParams],
        rngs: Sequence[RequestRng],
        coupled: list[bool],
    ) -> VerifyResult:
        rows, n = batch.rows, batch.nodes
        num_nodes, parents = batch.node_counts(), batch.parents
        tensors = SamplingTensors.from_params(params, self.device)
        node_counts = device_tensor(num_nodes, torch.int64, self.device)  # [B]
        # [B, 2(N+1)]: row b's first N_b+1 uniforms for the target sampler (columns 0..N_b),
        # its next N_b+1 for the rejection test (columns N+1..N+1+N_b), 0 elsewhere. Argmaxes read
        # no uniform: a greedy row draws none (all 0), nor does a coupled row from its stream.
        sampled = [0 if p.is_greedy or c else 2 * (m + 1) for p, c, m in zip(params, coupled, num_nodes, strict=True)]
        drawn = stream_uniforms(rngs, sampled, self.device, 2 * (n + 1))  # row b's draws first, then 0
        context = torch.arange(n + 1, device=self.device)
        in_row = context[None, :] <= node_counts[:, None]  # [B, N+1]: the root, then after each node
        uniforms = torch.cat(
            [torch.where(in_row, drawn[:, : n + 1], 0.0), drawn.gather(1, node_counts[:, None] + 1 + context)], dim=1
        )
        if any(coupled):  # each context's target token with the uniform of its depth's position
            at = [b for b, c in enumerate(coupled) if c]
            first = torch.tensor([batch.positions[b] for b in at])[:, None]  # [C, 1]
            positions = first + context_depths(parents.cpu()[at])  # [C, N+1]; past a row: masked below
            rows_at = shared_tensor(at, torch.int64, self.device)
            drawn_at = position_uniforms([rngs[b] for b in at], positions, self.device)
            uniforms[rows_at, : n + 1] = torch.where(in_row[rows_at], drawn_at, 0.0)
        # The residual uniform of each context: rejection uniform (its last child + 1).
        node = torch.arange(n)
        real = node[None, :] < torch.tensor(num_nodes)[:, None]  # [B, N]
        recover_index = torch.zeros(rows, n + 1, dtype=torch.int64).scatter_reduce(
            1, (parents.cpu().long() + 1).clamp(min=0) * real, (node[None, :] + 1) * real, "amax"
        )
        rejection = uniforms[:, n + 1 :]  # [B, N+1]
        target = sample_target(target_logits, tensors, uniforms[:, : n + 1].contiguous())
        result = self.tree_sampler(
            to_device(batch.draft_token_ids, self.device),
            to_device(parents, self.device),
            node_counts,
            None if batch.draft_probs is None else batch.draft_probs.to(self.device),
            target.probs,
            target.token_ids,
            rejection[:, :n].contiguous(),
            rejection.gather(1, to_device(recover_index, self.device)),
            _tested(tensors, coupled, self.device),
        )
        emitted = result.accepted_token_num
        accepted = emitted.long() - 1
        stats = StepStats(
            do_sample=tensors.do_sample,
            draft_tokens=node_counts,
            accepted_tokens=accepted,
            accepted_per_position=torch.arange(n, device=self.device) < accepted[:, None],
        )
        return VerifyResult(result.output_token_ids, emitted, stats, result.accepted_nodes)


def padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """B tensors [n_b, V] (n_b >= 1) -> [B, max n_b, V]: row b's n_b rows, then copies of its last
    one (never read: past a row nothing is emitted). One concatenation and one gather (the index
    is kept while the rows' lengths repeat), where padding row by row is a copy launch per row."""
    lengths = [len(row) for row in rows]
    if min(lengths, default=0) < 1:
        raise ValueError(f"target_logits: expected at least one row of logits per batch row, got lengths {lengths}")
    width = max(lengths)
    flat = torch.cat(rows)  # [sum n_b, V]
    index = _padded_index(tuple(lengths), width, indexed(flat.device))
    return flat.index_select(0, index).view(len(rows), width, flat.shape[-1])


@functools.lru_cache(maxsize=64)
def _padded_index(lengths: tuple[int, ...], width: int, device: torch.device) -> torch.Tensor:
    """[B * width] int64 on `device`, never written: the flat row of (b, j), b's row min(j, n_b - 1)."""
    out, start = [], 0
    for n in lengths:
        out.extend(start + min(j, n - 1) for j in range(width))
        start += n
    return device_tensor(out, torch.int64, device)


def _on_device(draft_token_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The draft ids on the device; a K = 0 step's [B, 0] are allocated there, not copied."""
    if draft_token_ids.shape[-1] == 0:
        return torch.empty(draft_token_ids.shape, dtype=draft_token_ids.dtype, device=device)
    return to_device(draft_token_ids, device)


def context_depths(parents: torch.Tensor) -> torch.Tensor:
    """parents [R, N] int (host; -1 = the root, a parent before its child) -> [R, N+1] int64:
    the depth of each context, the root's 0 then each node's, its parent's + 1. One op per
    node position for all rows, not a Python loop per row: this runs on every tree step."""
    rows, n = parents.shape
    depths = torch.zeros(rows, n + 1, dtype=torch.int64)
    above = parents.long() + 1  # [R, N]: each node's parent's context
    for j in range(n):
        depths[:, j + 1] = depths.gather(1, above[:, j : j + 1]).squeeze(1) + 1
    return depths


def _coupled(params: Sequence[SamplingParams], positions: Sequence[int | None] | None, batch: int) -> list[bool]:
    """Which rows are verified by coupling: sampled rows given a position (checked: one per row)."""
    if positions is None:
        return [False] * batch
    return [not p.is_greedy and at is not None for p, at in zip(params, positions, strict=True)]


def _tested(rows: SamplingTensors, coupled: list[bool], device: torch.device) -> torch.Tensor:
    """[B] bool: the rows the rejection test decides (do_sample but not coupled); a coupled row
    takes the greedy rule."""
    if not any(coupled):
        return rows.do_sample
    return rows.do_sample & ~shared_tensor(coupled, torch.bool, device)
