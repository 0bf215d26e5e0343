"""The committed generated code matches pdspec.proto, and the fixed fields keep their numbers."""

import subprocess
import sys
from pathlib import Path

from protos import pdspec_pb2, pdspec_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date(tmp_path):
    (tmp_path / "protos").mkdir()
    (tmp_path / "protos" / "pdspec.proto").write_bytes((ROOT / "protos" / "pdspec.proto").read_bytes())
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(tmp_path),
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            "protos/pdspec.proto",
        ],
        check=True,
        cwd=tmp_path,
    )
    for name in ("pdspec_pb2.py", "pdspec_pb2.pyi", "pdspec_pb2_grpc.py"):
        fresh = (tmp_path / "protos" / name).read_text()
        assert fresh == (ROOT / "protos" / name).read_text(), f"protos/{name} is stale: run `make proto`"


FIXED = {
    "TensorPB": {"data_type": 1, "shape": 2, "data": 3},
    "SamplingParams": {
        "do_sample": 1,
        "temperature": 2,
        "top_k": 3,
        "top_p": 4,
        "seed": 5,
        "max_new_tokens": 6,
        "stop_token_ids": 7,
    },
    "Proposal": {"encoding": 1, "token_ids": 2, "probs": 3, "sparse_ids": 4, "sparse_probs": 5},
    "GenerateRequest": {
        "request_id": 1,
        "prompt": 2,
        "prompt_token_ids": 3,
        "sampling": 4,
        "num_speculative_tokens": 5,
    },
    "GenerateResponse": {"request_id": 1, "token_ids": 2, "text": 3, "finished": 4, "finish_reason": 5, "stats": 6},
    "RequestStats": {"verify_steps": 1, "draft_tokens": 2, "accepted_tokens": 3, "accepted_per_position": 4},
    "DecodeRequest": {
        "request_id": 1,
        "protocol_version": 2,
        "contract_fingerprint": 3,
        "prompt_token_ids": 4,
        "first_token_id": 5,
        "sampling": 6,
        "num_speculative_tokens": 7,
        "proposal": 8,
        "kv_cache": 9,
    },
    "NodeInfo": {
        "role": 1,
        "protocol_version": 2,
        "contract_fingerprint": 3,
        "target_vocab_size": 4,
        "draft_vocab_size": 5,
        "draft_to_target": 6,
        "max_speculative_tokens": 7,
        "sampler_backend": 8,
        "device": 9,
        "target_model": 10,
        "draft_model": 11,
    },
}


# Fields added after the fixed contract: new numbers only, never a renumbered fixed one.
ADDED = {
    "DecodeChunk": {"request": 1, "kv_manifest": 2, "kv": 3, "proposal_follows": 4},
    "KvChunk": {"tensor_index": 1, "offset": 2, "data": 3},
    "SamplingParams": {"logprobs": 8},
    "GenerateRequest": {"stop": 6, "draft_candidates": 7, "structured_output": 8},
    "StructuredOutput": {"json_schema": 1, "json_object": 2, "regex": 3, "choice": 4, "grammar": 5},
    "ChoiceList": {"values": 1},
    "Proposal": {"parents": 6, "partial": 7},
    "RequestStats": {
        "accepted_per_rank": 5,
        "chosen_k": 6,
        "speculative_method": 7,
        "prompt_lookup_tokens": 8,
        "jump_forward_tokens": 9,
        "grammar_rejected_drafts": 10,
    },
    "DecodeRequest": {"draft_candidates": 10, "structured_output": 11, "kv_shm": 20},
    "GenerateResponse": {"logprobs": 7},
    "TokenLogprob": {"logprob": 1, "top_token_ids": 2, "top_logprobs": 3},
    "NodeInfo": {
        "draft_law": 12,
        "proposal_encoding": 13,
        "version": 14,
        "max_new_tokens_limit": 15,
        "max_prompt_tokens": 16,
        "dtype": 17,
        "backends": 18,
        "max_draft_candidates": 19,
        "max_tree_nodes": 20,
        "accepts_shm_kv": 30,
        "speculative_method": 31,
        "prompt_lookup_min": 32,
        "prompt_lookup_max": 33,
        "adaptive_k": 34,
        "kv_pool_bytes": 35,
    },
    "SharedKv": {"name": 1, "size": 2, "manifest": 3, "offsets": 4, "lengths": 5},
}


def test_fixed_field_numbers():
    assert pdspec_pb2.DESCRIPTOR.package == "pdspec.v1"
    for message in FIXED.keys() | ADDED.keys():
        descriptor = pdspec_pb2.DESCRIPTOR.message_types_by_name[message]
        assert {f.name: f.number for f in descriptor.fields} == FIXED.get(message, {}) | ADDED.get(message, {}), message


def test_optional_num_speculative_tokens_is_wire_compatible():
    """`optional` only adds presence: 0 set explicitly is distinguishable from unset, and
    the bytes of a set field are those of the old plain int32."""
    unset = pdspec_pb2.GenerateRequest(prompt="x")
    assert not unset.HasField("num_speculative_tokens") and unset.num_speculative_tokens == 0
    zero = pdspec_pb2.GenerateRequest(prompt="x", num_speculative_tokens=0)
    assert zero.HasField("num_speculative_tokens")
    assert pdspec_pb2.GenerateRequest.FromString(zero.SerializeToString()).HasField("num_speculative_tokens")
    assert pdspec_pb2.GenerateRequest(num_speculative_tokens=3).SerializeToString() == bytes([5 << 3, 3])


def test_fixed_enums_and_services():
    assert dict(pdspec_pb2.TensorPB.DataType.items()) == {
        "DATA_TYPE_UNSPECIFIED": 0,
        "FP32": 1,
        "FP16": 2,
        "BF16": 3,
        "INT32": 4,
        "INT64": 5,
    }
    assert dict(pdspec_pb2.Proposal.Encoding.items()) == {
        "ENCODING_UNSPECIFIED": 0,
        "DENSE": 1,
        "POINT_MASS": 2,
        "SPARSE": 3,
    }
    services = pdspec_pb2.DESCRIPTOR.services_by_name
    assert {m.name for m in services["PrefillService"].methods} == {"Generate", "GetInfo"}
    assert {m.name for m in services["DecodeService"].methods} == {"Decode", "DecodeStream", "GetInfo"}
    assert services["DecodeService"].methods_by_name["Decode"].server_streaming
    assert hasattr(pdspec_pb2_grpc, "DecodeServiceStub") and hasattr(pdspec_pb2_grpc, "PrefillServiceServicer")
