"""A small receiver and valid DecodeRequests for the protocol tests."""

from __future__ import annotations

import torch

from protos import pdspec_pb2
from protos.codec import encode_tensor
from protos.contract import Contract
from protos.kv_layout import SEQ, KvTensorSpec
from protos.proposal import ProposalEncoding, encode_proposal
from protos.validation import Receiver

VT, VD, K_MAX = 12, 8, 4
D2T = (11, 0, 3, 3, 5, 7, 1, 2)  # non-identity, many-to-one (draft 2 and 3 -> target 3)
KV_LAYOUT = (KvTensorSpec(torch.float16, (2, SEQ, 4)), KvTensorSpec(torch.bfloat16, (2, SEQ, 4)))
CONTRACT = Contract(VT, VD, D2T, "test-target", "test-draft", KV_LAYOUT)
RECEIVER = Receiver.from_contract(CONTRACT, K_MAX)


def draft_law(k: int, seed: int, stochastic: bool = True):
    """K draft ids (draft space) and the law they came from (None = point mass)."""
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(2 * torch.randn(k, VD, generator=gen), -1)
    probs[:, 4] = 0  # some zero entries, as after top-k/top-p
    probs /= probs.sum(-1, keepdim=True)
    if not stochastic:
        return probs.argmax(-1), None
    return torch.multinomial(probs, 1, generator=gen).view(k) if k else torch.zeros(0, dtype=torch.int64), probs


def valid_request(
    encoding: ProposalEncoding = ProposalEncoding.DENSE, k: int = 3, seed: int = 0, prompt_len: int = 5
) -> pdspec_pb2.DecodeRequest:
    stochastic = encoding is not ProposalEncoding.POINT_MASS
    draft_ids, probs = draft_law(k, seed, stochastic)
    target_ids = torch.tensor(D2T)[draft_ids]
    proposal = encode_proposal(target_ids, draft_ids, probs, VD, encoding)
    kv = [encode_tensor(torch.randn(spec.shape_for(prompt_len)).to(spec.dtype)) for spec in KV_LAYOUT]
    return pdspec_pb2.DecodeRequest(
        request_id=f"req-{seed}",
        protocol_version=CONTRACT.protocol_version,
        contract_fingerprint=CONTRACT.fingerprint(),
        prompt_token_ids=list(range(prompt_len)),
        first_token_id=7,
        sampling=pdspec_pb2.SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=seed, max_new_tokens=16),
        num_speculative_tokens=k,
        proposal=proposal,
        kv_cache=kv,
    )
