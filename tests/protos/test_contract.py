import dataclasses

import torch

from protos.contract import Contract, max_message_bytes
from protos.kv_layout import SEQ, KvTensorSpec
from tests.protos.factory import CONTRACT


def test_fingerprint_is_stable():
    # A literal: changing how the fingerprint is computed breaks every deployed peer.
    contract = Contract(4, 2, (3, 0), "t", "d", (KvTensorSpec(torch.float16, (2, SEQ, 8)),))
    assert contract.fingerprint() == "sha256:51092dd6929c17f6efd03c7d29cee33b06d0353b18022e22703c9d5c0334db4b"


def test_every_component_changes_the_fingerprint():
    base = CONTRACT.fingerprint()
    changes = [
        {"protocol_version": 2},
        {"target_vocab_size": 13},
        {"draft_vocab_size": 9},
        {"d2t": (11, 0, 3, 3, 5, 7, 2, 1)},
        {"target_model": "other"},
        {"draft_model": "other"},
        {"kv_layout": (KvTensorSpec(torch.float32, (2, SEQ, 4)),) * 2},
        {"kv_layout": ()},
        {"grammar_engine": "xgrammar/0"},
    ]
    prints = {dataclasses.replace(CONTRACT, **change).fingerprint() for change in changes}
    assert base not in prints and len(prints) == len(changes)


def test_message_limit_covers_dense_at_151936_k8():
    contract = Contract(151936, 151936, tuple(range(151936)), "t", "d")
    limit = max_message_bytes(contract, max_proposal_rows=8, max_prompt_tokens=4096)
    assert limit > 8 * 151936 * 4 > 4 * 1024 * 1024  # 4.9 MB proposal, above gRPC's default
    kv = Contract(10, 10, tuple(range(10)), "t", "d", (KvTensorSpec(torch.bfloat16, (4, SEQ, 64)),))
    assert kv.kv_bytes(100) == 4 * 100 * 64 * 2
