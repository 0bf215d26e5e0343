"""The prefill engine: prompt -> first token + K proposals + KV state -> DecodeRequest.

No gRPC inside. The first token is drawn from the target's filtered distribution with the
request's own generator (stream "prefill"; the decode node draws from stream "decode" of
the same seed, so the two never replay each other's uniforms). The draft then proposes
K tokens from history + first token in the configured law, and records the exact
distribution of each (DENSE / POINT_MASS / SPARSE on the wire).
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field

import torch

from engine.proposer import draft_tokens
from models.pair import ModelPair
from pdspec.stopping import finish_reason
from protos import pdspec_pb2
from protos.proposal import ProposalEncoding, choose_encoding, encode_proposal
from protos.validation import (
    RequestLimits,
    Violation,
    check_ids,
    check_prompt_length,
    check_request_id,
    check_sampling,
)
from protos.wire import WireDecodeRequest
from sampling import RequestRng, SamplingParams, SamplingTensors, sample_target
from sampling.logprobs import TokenLogprob, token_logprobs
from sampling.proposal import DraftLaw


@dataclass(frozen=True)
class PrefillConfig:
    draft_law: DraftLaw = DraftLaw.POINT_MASS
    # None: the exact default for the law (POINT_MASS for a point mass, DENSE otherwise)
    proposal_encoding: ProposalEncoding | None = None
    compact_encodings: bool = False  # pick POINT_MASS / SPARSE automatically (smallest exact)
    # KV over the DecodeStream RPC in slices of kv_chunk_bytes: always, or when it is larger
    # than kv_stream_threshold_bytes (else in the one Decode message)
    kv_streaming: bool = False
    kv_stream_threshold_bytes: int = 64 << 20
    kv_chunk_bytes: int = 4 << 20
    max_speculative_tokens: int = 8  # lowered to the decode peer's when it reports less
    num_speculative_tokens: int = 4  # K of a request that does not say (clamped to the maximum)
    default_max_new_tokens: int = 64
    limits: RequestLimits = field(default_factory=RequestLimits)
    device: str = "cpu"  # where sampling runs: the models' device

    @property
    def encoding(self) -> ProposalEncoding:
        """The encoding this node ships (reported in GetInfo)."""
        return choose_encoding(self.proposal_encoding, self.draft_law, self.compact_encodings)

    def __post_init__(self) -> None:
        if self.proposal_encoding is ProposalEncoding.POINT_MASS and self.draft_law is not DraftLaw.POINT_MASS:
            raise ValueError(
                "proposal_encoding: expected dense or sparse for a stochastic draft law "
                "(POINT_MASS is exact only for point masses), got point-mass"
            )


@dataclass(frozen=True)
class Checked:
    """A GenerateRequest that passed `check`, with every default resolved."""

    request_id: str  # the client's, or a generated one when it sent none
    ids: list[int]  # the prompt, tokenized
    k: int
    max_new_tokens: int
    params: SamplingParams
    sampling: pdspec_pb2.SamplingParams  # as it travels on to the decode node


@dataclass(frozen=True)
class Prefilled:
    first_token: int
    first_logprob: TokenLogprob | None  # when the request asked for logprobs
    finish_reason: str  # "" while the request goes on to the decode node
    wire: WireDecodeRequest | None  # header + payload views; its kv_cache entries are the KV's
    encoding: ProposalEncoding | None
    kv: list[torch.Tensor] = field(default_factory=list)  # the exported KV (the wire's payloads view it)

    @property
    def decode_request(self) -> pdspec_pb2.DecodeRequest | None:
        """The whole standard message (payloads copied in): tests and tools."""
        return None if self.wire is None else self.wire.to_message()

    @property
    def kv_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv)


class PrefillEngine:
    def __init__(self, pair: ModelPair, config: PrefillConfig) -> None:
        self.pair = pair
        self.config = config
        self.contract = pair.contract()
        self.fingerprint = self.contract.fingerprint()
        self.max_speculative_tokens = config.max_speculative_tokens
        self.d2t = pair.d2t.to(config.device)
        self._lock = threading.Lock()  # model calls are serialized (models need not be thread-safe)

    def check(self, request: pdspec_pb2.GenerateRequest) -> Checked | list[Violation]:
        """GenerateRequest semantics and server limits, before any model work."""
        found: list[Violation] = []
        limits = self.config.limits
        check_request_id(request.request_id, limits, found)
        has_text, has_ids = bool(request.prompt), bool(request.prompt_token_ids)
        if has_text == has_ids:
            found.append(
                Violation("prompt", "exactly one of prompt / prompt_token_ids", "both" if has_text else "neither")
            )
        vocab = self.pair.target.vocab_size
        ids = list(request.prompt_token_ids)
        if has_text and not has_ids:
            # Text is bounded by the message limit; the ids it becomes are checked like ids.
            ids = self.pair.tokenizer.encode(request.prompt)
            if not ids:
                found.append(Violation("prompt", "text of at least 1 token", "0 tokens"))
        if check_prompt_length(len(ids), limits, found):
            check_ids("prompt_token_ids", ids, vocab, found)
        params = check_sampling(request.sampling, vocab, found, limits)
        if request.HasField("num_speculative_tokens"):
            k = request.num_speculative_tokens
        else:
            k = min(self.config.num_speculative_tokens, self.max_speculative_tokens)
        if not 0 <= k <= self.max_speculative_tokens:
            found.append(Violation("num_speculative_tokens", f"0..{self.max_speculative_tokens}", str(k)))
        if found:
            return found
        sampling = pdspec_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_new_tokens = request.sampling.max_new_tokens or self.config.default_max_new_tokens
        return Checked(request.request_id or uuid.uuid4().hex, ids, k, sampling.max_new_tokens, params, sampling)

    def prefill(self, checked: Checked) -> Prefilled:
        """Run a checked request up to the DecodeRequest (or to its end)."""
        pair = self.pair
        ids, k, sampling = checked.ids, checked.k, checked.sampling
        rng = RequestRng(checked.params.seed, stream="prefill")
        device = self.config.device
        rows = SamplingTensors.from_params([checked.params], device)
        with self._lock:
            logits, target_state = pair.target.prefill(ids)
            logits = logits.to(device)
            try:
                uniform = rng.uniforms(1).to(device).view(1, 1)
                first = int(sample_target(logits.view(1, 1, -1), rows, uniform).token_ids[0, 0])
                first_logprob = (
                    token_logprobs(logits.view(1, -1), torch.tensor([first]), sampling.logprobs)[0]
                    if sampling.logprobs
                    else None
                )
                reason = finish_reason(
                    first, pair.target.eos_token_ids, sampling.stop_token_ids, 1, checked.max_new_tokens
                )
                if reason:
                    return Prefilled(first, first_logprob, reason, None, None)
                draft_ids, draft_probs = self._propose(ids, first, k, rows, rng)
                kv = pair.target.export_state(target_state)
            finally:
                pair.target.release(target_state)  # the KV lives on in `kv` (and then on the wire)
        header = pdspec_pb2.DecodeRequest(
            request_id=checked.request_id,
            protocol_version=self.contract.protocol_version,
            contract_fingerprint=self.fingerprint,
            prompt_token_ids=ids,
            first_token_id=first,
            num_speculative_tokens=k,
            sampling=sampling,
        )
        wire = WireDecodeRequest(header)
        encoding = self.config.encoding
        encode_proposal(
            pair.d2t.map_tokens(draft_ids),
            draft_ids,
            draft_probs,
            pair.draft.vocab_size,
            encoding,
            out=header.proposal,
            set_tensor=lambda name, tensor: wire.set_tensor(f"proposal.{name}", tensor),
        )
        if not self.streams(kv):
            for i, tensor in enumerate(kv):
                wire.set_tensor(f"kv_cache[{i}]", tensor)  # a view: no copy until the one join
        return Prefilled(first, first_logprob, "", wire, encoding, kv)

    def streams(self, kv: list[torch.Tensor]) -> bool:
        """Whether this KV goes over DecodeStream (see PrefillConfig.kv_streaming)."""
        size = sum(t.numel() * t.element_size() for t in kv)
        return self.config.kv_streaming or size > self.config.kv_stream_threshold_bytes

    def _propose(
        self, ids: list[int], first: int, k: int, rows: SamplingTensors, rng: RequestRng
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K draft-space tokens and, for a stochastic law, their distributions [K, Vd]."""
        uniforms = rng.uniforms(k).to(self.config.device).view(1, k)  # drawn for either law
        if not k:
            return torch.zeros(0, dtype=torch.int64), None
        draft = self.pair.draft
        _, state = draft.prefill(ids)
        try:
            draft.reserve(state, len(ids) + k)
            (drafted,) = draft_tokens(
                draft, self.pair.d2t, self.config.draft_law, [state], [[first]], [k], rows, uniforms
            )
        finally:
            draft.release(state)
        return torch.tensor(drafted.draft_ids, dtype=torch.int64), drafted.probs
