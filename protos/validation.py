"""Validation of a DecodeRequest at the decode boundary (docs/design.md §3 table).

Pure functions, no gRPC: `validate_decode_request` returns either a `DecodeInput`
(everything the decode engine needs; its proposal a target-space `sampling.Proposal`)
or a list of `Violation`s (field path, expected, actual, status). Sizes are checked
against len(data) with integer arithmetic before any tensor is allocated, so the only
allocations driven by the message are the decoded tensors themselves (bounded by the
message size) and the target-space probabilities (bounded by the node's K_max x V).
The draft -> target vocabulary mapping is sampling's (`DraftToTargetMap.proposal`): the
receiver's map is applied there, never re-implemented here.
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from common.transfer import Buffer
from protos import pdspec_pb2
from protos.codec import TORCH_DTYPES, WIRE_DTYPES, TensorDecodeError, decode_tensor, dtype_name
from protos.constraint import MAX_CHOICES, MAX_CONSTRAINT_BYTES, Constraint
from protos.contract import Contract
from sampling import DraftToTargetMap, Proposal, SamplingParams
from sampling.params import InvalidParameter
from sampling.proposal import PREFILL
from sampling.tree import MAX_TREE_NODES

Encoding = pdspec_pb2.Proposal.Encoding
DataType = pdspec_pb2.TensorPB.DataType
ROW_SUM_TOLERANCE = 1e-3
# A shared-memory KV segment's name (protos/shm_kv.py makes them): only these files in
# /dev/shm are ever opened or unlinked on a request's word.
SHM_NAME = re.compile(r"pdspec-kv-[0-9a-f]{32}")


class Code(enum.Enum):
    """The gRPC status a violation maps to (names match grpc.StatusCode)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"


@dataclass(frozen=True)
class Violation:
    field: str  # path in the request, e.g. "proposal.probs.shape"
    expected: str
    actual: str
    code: Code = Code.INVALID_ARGUMENT

    @property
    def description(self) -> str:
        return f"expected {self.expected}, got {self.actual}"

    def __str__(self) -> str:
        return f"{self.field}: {self.description}"


@dataclass(frozen=True)
class RequestLimits:
    """Server limits both nodes enforce before any model work (INVALID_ARGUMENT naming the
    limit): a request may not hold a slot, a KV reservation or a co-batched neighbour's time
    beyond these."""

    max_new_tokens: int = 4096  # --max-new-tokens-limit
    max_prompt_tokens: int = 8192  # --max-prompt-tokens
    max_stop_token_ids: int = 64
    max_request_id_bytes: int = 256
    max_logprobs: int = 5
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256


@dataclass(frozen=True)
class Receiver:
    """What the decode node accepts: its contract, K limit, the validated d2t map, limits."""

    contract: Contract
    max_speculative_tokens: int
    d2t_map: DraftToTargetMap
    limits: RequestLimits = RequestLimits()
    max_draft_candidates: int = 1  # 1: chains only
    max_tree_nodes: int = MAX_TREE_NODES
    accept_shm_kv: bool = False  # --accept-shm-kv: DecodeRequest.kv_shm is taken (same host only)

    @classmethod
    def from_contract(
        cls,
        contract: Contract,
        max_speculative_tokens: int,
        limits: RequestLimits | None = None,
        *,
        max_draft_candidates: int = 1,
        max_tree_nodes: int = MAX_TREE_NODES,
        accept_shm_kv: bool = False,
    ) -> Receiver:
        d2t = DraftToTargetMap(torch.tensor(contract.d2t, dtype=torch.int64), contract.target_vocab_size)
        return cls(
            contract,
            max_speculative_tokens,
            d2t,
            limits or RequestLimits(),
            max_draft_candidates,
            max_tree_nodes,
            accept_shm_kv,
        )


@dataclass(frozen=True)
class DecodeInput:
    """A validated DecodeRequest, decoded."""

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    params: SamplingParams
    max_new_tokens: int  # the client's total (0 = server default)
    stop_token_ids: list[int]
    # The prefill's proposal in TARGET space (source PREFILL): N target ids (K for a chain), their
    # breadth-first parents (-1 = the first token; a chain's -1, 0, ..., N-2) and the law of each
    # node as [N, Vt] float32 rows, or None for a point mass. No nodes before a proposal that
    # comes last (proposal_follows).
    proposal: Proposal
    kv_cache: list[torch.Tensor] = field(default_factory=list)
    logprobs: int = 0  # top log-probabilities to report per token (0 = none)
    num_speculative_tokens: int = 0  # K: the depth of this request's proposals
    draft_candidates: int = 1  # candidates per node of the trees the decode node drafts
    constraint: Constraint | None = None  # structured outputs (compiled by the decode node's grammar engine)


def validate_decode_request(
    request: pdspec_pb2.DecodeRequest,
    receiver: Receiver,
    payloads: Mapping[str, Buffer] | None = None,
    kv_manifest: Sequence[pdspec_pb2.TensorPB] | None = None,
    *,
    proposal_follows: bool = False,
) -> DecodeInput | list[Violation]:
    """Every row of the §3 table; returns the decoded input or the violations found.

    `proposal_follows` (the first chunk of a DecodeStream that sends its proposal last): the
    request must carry neither first_token_id nor a proposal, and the input has neither
    (first_token_id -1, no draft tokens) until the last chunk's are validated with the rest.

    `payloads`: the tensor bytes by path ("proposal.probs", "kv_cache[3]") when they were
    left out of `request` (protos/wire.py parses them as views of the received buffer);
    a TensorPB with no entry uses its own `data`. `kv_manifest` (DecodeStream): the KV
    arrives later in chunks; its declared tensors (data empty) are checked against the
    contract instead, `request.kv_cache` must be empty, and DecodeInput.kv_cache is [].
    The same holds for a `kv_shm` handle (the KV in a shared-memory segment), which only a
    receiver with `accept_shm_kv` takes.
    """
    payloads = payloads or {}
    contract = receiver.contract
    precondition = _check_contract(request, contract)
    if request.HasField("kv_shm") and not receiver.accept_shm_kv:
        precondition.append(
            Violation(
                "kv_shm",
                "no shared-memory KV (this decode node runs without --accept-shm-kv)",
                f"segment {request.kv_shm.name[:64]!r}",
                Code.FAILED_PRECONDITION,
            )
        )
    if precondition:
        return precondition  # the rest of the message may not even mean what we think
    found: list[Violation] = []
    limits = receiver.limits
    check_request_id(request.request_id, limits, found)
    params = check_sampling(request.sampling, contract.target_vocab_size, found, limits)
    vocab = contract.target_vocab_size
    if not request.prompt_token_ids:
        found.append(Violation("prompt_token_ids", "at least 1 id", "0 ids"))
    if check_prompt_length(len(request.prompt_token_ids), limits, found):
        check_ids("prompt_token_ids", request.prompt_token_ids, vocab, found)
    if proposal_follows:
        if request.first_token_id or request.HasField("proposal"):
            found.append(Violation("proposal", "absent with proposal_follows (it comes last)", "present"))
    else:
        check_ids("first_token_id", [request.first_token_id], vocab, found)
    constraint = check_structured_output(request.structured_output, found)
    k = request.num_speculative_tokens
    if not 0 <= k <= receiver.max_speculative_tokens:
        found.append(Violation("num_speculative_tokens", f"0..{receiver.max_speculative_tokens}", str(k)))
        return found  # K sizes everything below
    candidates = request.draft_candidates or 1
    if not 1 <= candidates <= receiver.max_draft_candidates:
        found.append(
            Violation("draft_candidates", f"0..{receiver.max_draft_candidates}", str(request.draft_candidates))
        )
        return found
    proposal = request.proposal
    nodes = len(proposal.token_ids)
    if not proposal.parents and not proposal_follows and (nodes > k if proposal.partial else nodes != k):
        expected = f"at most {k} ids (a partial proposal)" if proposal.partial else f"{k} ids (num_speculative_tokens)"
        found.append(Violation("proposal.token_ids", expected, f"{nodes} ids"))
    if proposal.parents and not check_tree(proposal.parents, nodes, k, candidates, receiver.max_tree_nodes, found):
        return found  # the node count sizes the distributions below
    check_ids("proposal.token_ids", proposal.token_ids, vocab, found)
    shm = request.kv_shm if request.HasField("kv_shm") else None
    if kv_manifest is None and shm is None:
        kv_cache = _decode_kv(request.kv_cache, contract, len(request.prompt_token_ids), found, payloads)
    else:
        kv_cache = []
        elsewhere = "a kv_manifest (streamed)" if kv_manifest is not None else "kv_shm"
        if len(request.kv_cache):
            found.append(Violation("kv_cache", f"0 tensors with {elsewhere}", f"{len(request.kv_cache)}"))
        if kv_manifest is None:
            check_shared_kv(shm, contract, len(request.prompt_token_ids), found)
        elif shm is not None:
            found.append(Violation("kv_shm", "absent in a DecodeStream (its chunks carry the KV)", "a segment"))
        else:
            check_kv_manifest(kv_manifest, contract, len(request.prompt_token_ids), found)
    law = None if proposal_follows else _decode_proposal(proposal, nodes, receiver, found, payloads)
    if found:
        return found
    probs, sparse_ids = law or (None, None)
    parents = list(proposal.parents) or list(range(-1, nodes - 1))  # a chain
    received = receiver.d2t_map.proposal(proposal.token_ids, parents, probs, sparse_ids, source=PREFILL)
    draft_token_ids = torch.tensor(received.token_ids, dtype=torch.int64)
    if received.probs is not None and nodes:
        _check_support(received.probs, draft_token_ids, found)
    if proposal.parents:
        _check_siblings(received.probs, draft_token_ids, parents, found)
    if found:
        return found
    return DecodeInput(
        request_id=request.request_id,
        prompt_token_ids=list(request.prompt_token_ids),
        first_token_id=-1 if proposal_follows else request.first_token_id,
        params=params,
        max_new_tokens=request.sampling.max_new_tokens,
        stop_token_ids=list(request.sampling.stop_token_ids),
        proposal=received,
        kv_cache=kv_cache,
        logprobs=request.sampling.logprobs,
        num_speculative_tokens=k,
        draft_candidates=candidates,
        constraint=constraint,
    )


def _check_contract(request: pdspec_pb2.DecodeRequest, contract: Contract) -> list[Violation]:
    found = []
    if request.protocol_version != contract.protocol_version:
        found.append(
            Violation(
                "protocol_version",
                str(contract.protocol_version),
                str(request.protocol_version),
                Code.FAILED_PRECONDITION,
            )
        )
    if request.contract_fingerprint != contract.fingerprint():
        found.append(
            Violation(
                "contract_fingerprint",
                contract.fingerprint(),
                request.contract_fingerprint or "''",
                Code.FAILED_PRECONDITION,
            )
        )
    return found


def sampling_params(sampling: pdspec_pb2.SamplingParams) -> SamplingParams:
    """The wire SamplingParams as the sampler's (raises InvalidParameter out of domain)."""
    seed = sampling.seed if sampling.HasField("seed") else None
    return SamplingParams(sampling.do_sample, sampling.temperature, sampling.top_k, sampling.top_p, seed)


def check_sampling(
    sampling: pdspec_pb2.SamplingParams, vocab: int, found: list[Violation], limits: RequestLimits
) -> SamplingParams:
    """Parameter domains, max_new_tokens, stop ids and logprobs (shared by both nodes' checks)."""
    try:
        params = sampling_params(sampling)
    except InvalidParameter as err:
        found.append(Violation(f"sampling.{err.field}", err.expected, err.actual))
        params = SamplingParams()
    if not 0 <= sampling.max_new_tokens <= limits.max_new_tokens:
        found.append(
            Violation(
                "sampling.max_new_tokens",
                f"0..{limits.max_new_tokens} (0 = server default; limit --max-new-tokens-limit)",
                str(sampling.max_new_tokens),
            )
        )
    if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
        found.append(
            Violation(
                "sampling.stop_token_ids",
                f"at most {limits.max_stop_token_ids} ids",
                f"{len(sampling.stop_token_ids)} ids",
            )
        )
    else:
        check_ids("sampling.stop_token_ids", sampling.stop_token_ids, vocab, found)
    if not 0 <= sampling.logprobs <= limits.max_logprobs:
        found.append(Violation("sampling.logprobs", f"0..{limits.max_logprobs}", str(sampling.logprobs)))
    return params


def check_prompt_length(length: int, limits: RequestLimits, found: list[Violation]) -> bool:
    """False (and a violation) when the prompt is over the limit: its ids are not even scanned."""
    if length > limits.max_prompt_tokens:
        found.append(
            Violation(
                "prompt_token_ids",
                f"at most {limits.max_prompt_tokens} tokens (limit --max-prompt-tokens)",
                f"{length} tokens",
            )
        )
        return False
    return True


def check_request_id(request_id: str, limits: RequestLimits, found: list[Violation]) -> None:
    size = len(request_id.encode())
    if size > limits.max_request_id_bytes:
        found.append(Violation("request_id", f"at most {limits.max_request_id_bytes} bytes", f"{size} bytes"))


def check_ids(name: str, ids, vocab: int, found: list[Violation]) -> None:
    bad = next((i for i in ids if not 0 <= i < vocab), None)
    if bad is not None:
        found.append(Violation(name, f"ids in [0, {vocab})", str(bad)))


def _decode_checked(
    name: str,
    pb: pdspec_pb2.TensorPB,
    dtype: int,
    rank: int,
    shape: list[int] | None,
    found: list[Violation],
    payloads: Mapping[str, Buffer],
) -> torch.Tensor | None:
    """Declared dtype/rank/shape and byte length first (no allocation), then decode."""
    if not _check_declared(name, pb, dtype, rank, shape, found):
        return None
    try:
        return decode_tensor(pb, data=payloads.get(name))  # checks the byte length against the shape first
    except TensorDecodeError as err:
        found.append(Violation(f"{name}.{err.field}", err.expected, err.actual))
        return None


def _check_declared(
    name: str, pb: pdspec_pb2.TensorPB, dtype: int, rank: int, shape: list[int] | None, found: list[Violation]
) -> bool:
    if pb.data_type != dtype:
        found.append(Violation(f"{name}.data_type", DataType.Name(dtype), dtype_name(pb.data_type)))
        return False
    if len(pb.shape) != rank:
        found.append(Violation(f"{name}.shape", f"rank {rank}", f"rank {len(pb.shape)} {list(pb.shape)}"))
        return False
    if shape is not None and list(pb.shape) != shape:
        found.append(Violation(f"{name}.shape", str(shape), str(list(pb.shape))))
        return False
    return True


def _decode_proposal(
    proposal: pdspec_pb2.Proposal, k: int, receiver: Receiver, found: list[Violation], payloads: Mapping[str, Buffer]
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The law in DRAFT space, checked: (probs [K, Vd], None) for DENSE, (probs [K, M], draft
    ids [K, M]) for SPARSE, None for POINT_MASS (or a violation)."""
    vd = receiver.contract.draft_vocab_size
    has = {name: proposal.HasField(name) for name in ("probs", "sparse_ids", "sparse_probs")}
    encoding = proposal.encoding
    allowed = {Encoding.DENSE: {"probs"}, Encoding.POINT_MASS: set(), Encoding.SPARSE: {"sparse_ids", "sparse_probs"}}
    if encoding not in allowed:
        name = Encoding.Name(encoding) if encoding in Encoding.values() else str(encoding)
        found.append(Violation("proposal.encoding", "DENSE, POINT_MASS or SPARSE", name))
        return None
    for name, present in has.items():
        if present and name not in allowed[encoding]:
            found.append(Violation(f"proposal.{name}", f"absent with {Encoding.Name(encoding)}", "present"))
        if not present and name in allowed[encoding]:
            found.append(Violation(f"proposal.{name}", f"present with {Encoding.Name(encoding)}", "absent"))
    if found or encoding == Encoding.POINT_MASS:
        return None
    if encoding == Encoding.DENSE:
        probs = _decode_checked("proposal.probs", proposal.probs, DataType.FP32, 2, [k, vd], found, payloads)
        if probs is None or not _check_distribution("proposal.probs", probs, found):
            return None
        return probs, None
    ids = _decode_checked("proposal.sparse_ids", proposal.sparse_ids, DataType.INT32, 2, None, found, payloads)
    values = _decode_checked("proposal.sparse_probs", proposal.sparse_probs, DataType.FP32, 2, None, found, payloads)
    if ids is None or values is None:
        return None
    if ids.shape[0] != k or values.shape != ids.shape:
        found.append(
            Violation(
                "proposal.sparse_probs.shape",
                f"[{k}, M] matching sparse_ids {list(ids.shape)}",
                str(list(values.shape)),
            )
        )
        return None
    if ids.numel() and not bool(((ids >= 0) & (ids < vd)).all()):
        bad = int(ids[(ids < 0) | (ids >= vd)][0])
        found.append(Violation("proposal.sparse_ids", f"draft ids in [0, {vd})", str(bad)))
        return None
    if not _check_distribution("proposal.sparse_probs", values, found):
        return None
    return values, ids


def _check_distribution(name: str, probs: torch.Tensor, found: list[Violation]) -> bool:
    """Finite, non-negative rows that sum to 1 within ROW_SUM_TOLERANCE."""
    if probs.shape[0] == 0:
        return True
    if not bool(torch.isfinite(probs).all()):
        found.append(Violation(name, "finite probabilities", "NaN or Inf"))
        return False
    if bool((probs < 0).any()):
        found.append(Violation(name, "probabilities >= 0", f"{float(probs.min())}"))
        return False
    sums = probs.double().sum(-1)
    off = (sums - 1).abs()
    worst = int(off.argmax())
    if float(off[worst]) > ROW_SUM_TOLERANCE:
        found.append(
            Violation(
                name, f"each row summing to 1 +- {ROW_SUM_TOLERANCE}", f"row {worst} sums to {float(sums[worst]):.6g}"
            )
        )
        return False
    return True


def _check_support(draft_probs: torch.Tensor, draft_token_ids: torch.Tensor, found: list[Violation]) -> None:
    """Each draft token must have p > 0 in its own (mapped) proposal distribution."""
    p = draft_probs.gather(1, draft_token_ids[:, None]).squeeze(1)
    outside = torch.nonzero(p <= 0).flatten()
    if outside.numel():
        i = int(outside[0])
        found.append(
            Violation(
                f"proposal.token_ids[{i}]",
                "a token with p > 0 in its proposal",
                f"{int(draft_token_ids[i])} with p = 0",
            )
        )


def check_tree(
    parents: Sequence[int], nodes: int, depth: int, candidates: int, max_nodes: int, found: list[Violation]
) -> bool:
    """A breadth-first candidate tree of at most `max_nodes` nodes, `depth` levels and
    `candidates` children per node (engine/proposer.py's layout)."""
    if len(parents) != nodes:
        found.append(Violation("proposal.parents", f"{nodes} entries (one per token id)", f"{len(parents)}"))
        return False
    if nodes > max_nodes:
        found.append(Violation("proposal.token_ids", f"at most {max_nodes} tree nodes (--max-tree-nodes)", str(nodes)))
        return False
    levels: list[int] = []
    fanout: dict[int, int] = {}
    for n, parent in enumerate(parents):
        if not -1 <= parent < n or (n and parent < parents[n - 1]):
            expected = f"{max(-1, parents[n - 1]) if n else -1}..{n - 1} (breadth-first, parents never decrease)"
            found.append(Violation(f"proposal.parents[{n}]", expected, str(parent)))
            return False
        levels.append(1 if parent < 0 else levels[parent] + 1)
        fanout[parent] = fanout.get(parent, 0) + 1
        if levels[n] > depth:
            found.append(
                Violation(
                    f"proposal.parents[{n}]",
                    f"a node at depth <= {depth} (num_speculative_tokens)",
                    f"depth {levels[n]}",
                )
            )
            return False
        if fanout[parent] > candidates:
            found.append(
                Violation(
                    f"proposal.parents[{n}]",
                    f"at most {candidates} children per node (draft_candidates)",
                    f"{fanout[parent]}",
                )
            )
            return False
    return True


def _check_siblings(
    draft_probs: torch.Tensor | None, draft_token_ids: torch.Tensor, parents: list[int], found: list[Violation]
) -> None:
    """Siblings are drawn without replacement: distinct, and each later one's law gives the
    earlier ones no mass (a necessary condition of the law the verifier assumes)."""
    first: dict[int, int] = {}
    for n, parent in enumerate(parents):
        start = first.setdefault(parent, n)
        earlier = draft_token_ids[start:n]
        if not earlier.numel():
            continue
        if bool((earlier == draft_token_ids[n]).any()):
            found.append(
                Violation(
                    f"proposal.token_ids[{n}]",
                    "a candidate distinct from its earlier siblings",
                    f"{int(draft_token_ids[n])} again",
                )
            )
            return
        if draft_probs is not None and bool((draft_probs[n, earlier] > 0).any()):
            found.append(
                Violation(
                    f"proposal.probs[{n}]", "no mass on the earlier siblings (drawn without replacement)", "p > 0"
                )
            )
            return


def _decode_kv(
    tensors, contract: Contract, prompt_len: int, found: list[Violation], payloads: Mapping[str, Buffer]
) -> list[torch.Tensor]:
    specs = contract.kv_layout
    if len(tensors) != len(specs):
        found.append(Violation("kv_cache", f"{len(specs)} tensors", f"{len(tensors)} tensors"))
        return []
    out = []
    for i, (pb, spec) in enumerate(zip(tensors, specs, strict=True)):
        tensor = _decode_checked(
            f"kv_cache[{i}]",
            pb,
            WIRE_DTYPES[spec.dtype],
            len(spec.shape),
            list(spec.shape_for(prompt_len)),
            found,
            payloads,
        )
        if tensor is not None:
            out.append(tensor)
    return out


def check_kv_manifest(
    manifest: Sequence[pdspec_pb2.TensorPB],
    contract: Contract,
    prompt_len: int,
    found: list[Violation],
    name: str = "kv_manifest",
) -> bool:
    """The streamed KV's declared tensors against the contract (nothing allocated here)."""
    specs = contract.kv_layout
    if len(manifest) != len(specs):
        found.append(Violation(name, f"{len(specs)} tensors", f"{len(manifest)} tensors"))
        return False
    ok = True
    for i, (pb, spec) in enumerate(zip(manifest, specs, strict=True)):
        shape = list(spec.shape_for(prompt_len))
        ok &= _check_declared(f"{name}[{i}]", pb, WIRE_DTYPES[spec.dtype], len(spec.shape), shape, found)
    return ok


def declared_bytes(pb: pdspec_pb2.TensorPB) -> int:
    """The byte size of a declared (checked) tensor."""
    return math.prod(pb.shape) * TORCH_DTYPES[pb.data_type].itemsize


def check_shared_kv(shm: pdspec_pb2.SharedKv, contract: Contract, prompt_len: int, found: list[Violation]) -> None:
    """A shared-memory KV handle: its name, its manifest against the contract, and each
    tensor's range against its declared size and the declared segment size (the segment
    itself is checked against `size` when it is opened, protos/shm_kv.py)."""
    if not SHM_NAME.fullmatch(shm.name):
        found.append(Violation("kv_shm.name", "'pdspec-kv-' and 32 lowercase hex digits", repr(shm.name[:64])))
    if not check_kv_manifest(shm.manifest, contract, prompt_len, found, "kv_shm.manifest"):
        return
    for name in ("offsets", "lengths"):
        if len(getattr(shm, name)) != len(shm.manifest):
            found.append(
                Violation(f"kv_shm.{name}", f"{len(shm.manifest)} (one per tensor)", f"{len(getattr(shm, name))}")
            )
            return
    for i, (pb, offset, length) in enumerate(zip(shm.manifest, shm.offsets, shm.lengths, strict=True)):
        size = declared_bytes(pb)
        if length != size:
            found.append(Violation(f"kv_shm.lengths[{i}]", f"{size} bytes (kv_shm.manifest[{i}])", f"{length}"))
        elif offset + length > shm.size:
            where = f"[{offset}, {offset + length})"
            found.append(Violation(f"kv_shm.offsets[{i}]", f"a range inside kv_shm.size = {shm.size} bytes", where))


def check_structured_output(message: pdspec_pb2.StructuredOutput, found: list[Violation]) -> Constraint | None:
    """A request's constraint, checked as far as no tokenizer is needed (both nodes); None when
    no kind is set (free text) or when it is wrong (a violation naming the kind's field)."""
    kind = message.WhichOneof("kind")
    if kind is None:
        return None
    path = f"structured_output.{kind}"
    problem: tuple[str, str] | None = None
    value = ""
    if kind == "json_object":
        if not message.json_object:
            problem = "true (false: leave structured_output unset)", "false"
    elif kind == "choice":
        values = list(message.choice.values)
        size = sum(len(v.encode()) for v in values)
        if not 1 <= len(values) <= MAX_CHOICES:
            problem = f"1..{MAX_CHOICES} strings", f"{len(values)}"
        elif any(not v for v in values) or len(set(values)) != len(values):
            problem = "distinct non-empty strings", json.dumps(values)[:120]
        elif size > MAX_CONSTRAINT_BYTES:
            problem = f"at most {MAX_CONSTRAINT_BYTES} bytes", f"{size} bytes"
        value = json.dumps(values)
    else:
        value = getattr(message, kind)
        size = len(value.encode())
        if not value:
            problem = "a non-empty string", "an empty one"
        elif size > MAX_CONSTRAINT_BYTES:
            problem = f"at most {MAX_CONSTRAINT_BYTES} bytes", f"{size} bytes"
        elif kind == "json_schema":
            try:
                schema = json.loads(value)
            except ValueError as err:
                schema, problem = None, ("a JSON Schema as JSON text", f"invalid JSON ({err})")
            if problem is None and not isinstance(schema, dict):
                problem = "a JSON Schema object", type(schema).__name__
            if problem is None:
                # one cache entry per schema text; the key order stays (the grammar emits properties in it)
                value = json.dumps(schema, separators=(",", ":"))
    if problem is not None:
        found.append(Violation(path, *problem))
        return None
    return Constraint(kind, value)
