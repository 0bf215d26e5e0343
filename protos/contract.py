"""What prefill and decode must agree on, and its fingerprint.

contract_fingerprint = "sha256:" + hex sha256 of the canonical JSON (sorted keys, no
spaces) of:
    {"protocol_version": int, "target_vocab_size": int, "draft_vocab_size": int,
     "d2t_sha256": hex sha256 of d2t as little-endian int64 bytes,
     "target_model": str, "draft_model": str,
     "kv_layout": [[dtype name, [dim, ...]], ...],   # dims are ints or "seq"
     "grammar_engine": str}                           # structured outputs, e.g. "llguidance/1"
Anything that changes how one side's bytes are read by the other changes the hash: a decode
node that would ignore DecodeRequest.structured_output, or whose grammar engine could allow
other tokens than the prefill node's, has another fingerprint.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass

import torch

from protos.constraint import GRAMMAR_ENGINE
from protos.kv_layout import KvTensorSpec, kv_bytes

PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class Contract:
    target_vocab_size: int
    draft_vocab_size: int
    d2t: tuple[int, ...]  # absolute target id of each draft id
    target_model: str
    draft_model: str
    kv_layout: tuple[KvTensorSpec, ...] = ()
    protocol_version: int = PROTOCOL_VERSION
    grammar_engine: str = GRAMMAR_ENGINE

    def fingerprint(self) -> str:
        return _fingerprint(self)

    def kv_bytes(self, seq_len: int) -> int:
        return kv_bytes(self.kv_layout, seq_len)


@functools.lru_cache(maxsize=64)  # contracts are immutable; validation asks on every request
def _fingerprint(contract: Contract) -> str:
    d2t_bytes = torch.tensor(contract.d2t, dtype=torch.int64).numpy().astype("<i8").tobytes()
    canonical = {
        "protocol_version": contract.protocol_version,
        "target_vocab_size": contract.target_vocab_size,
        "draft_vocab_size": contract.draft_vocab_size,
        "d2t_sha256": hashlib.sha256(d2t_bytes).hexdigest(),
        "target_model": contract.target_model,
        "draft_model": contract.draft_model,
        "kv_layout": [[str(spec.dtype).removeprefix("torch."), list(spec.shape)] for spec in contract.kv_layout],
        "grammar_engine": contract.grammar_engine,
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def max_message_bytes(contract: Contract, max_proposal_rows: int, max_prompt_tokens: int, slack: int = 1 << 20) -> int:
    """gRPC message limit for a DecodeRequest: the largest DENSE proposal (K drafts, or the
    nodes of the largest tree), the KV of the longest prompt, the prompt ids and a slack
    for everything else (protobuf framing, ids, sampling parameters). DENSE at V = 151936,
    K = 8 alone is 4.9 MB, above gRPC's 4 MiB default, so both sides must configure this."""
    proposal = max_proposal_rows * contract.draft_vocab_size * 4
    prompt_ids = max_prompt_tokens * 5  # varint-packed int32, at most 5 bytes each
    return proposal + contract.kv_bytes(max_prompt_tokens) + prompt_ids + slack
