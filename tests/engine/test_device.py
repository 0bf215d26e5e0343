"""Every entry into a node's device work runs under its device (engine/device.py): CUDA's
current device is per thread, and the gRPC and engine threads that run steps start on
device 0, so a node pinned to cuda:1 must switch before it launches anything."""

from __future__ import annotations

import contextlib

import pytest
import torch

from decode_node import engine as decode_engine
from engine.device import on_device, serve_attention_without_cudnn
from models.loader import load_pair
from prefill_node import engine as prefill_engine
from protos import pdspec_pb2
from protos.validation import Receiver, validate_decode_request


def test_on_device_names_the_gpu_and_is_a_no_op_elsewhere():
    scope = on_device("cuda:1")
    assert isinstance(scope, torch.cuda.device) and scope.idx == 1
    assert isinstance(on_device("cpu"), contextlib.nullcontext)


def test_serving_attention_on_a_gpu_leaves_cudnn_out_and_elsewhere_changes_nothing():
    """cuDNN's SDPA JIT-compiles kernels and builds a graph per shape at first use (prompt
    lengths that stall a fresh node); a GPU's engines go without it, a CPU's leave it as is."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        serve_attention_without_cudnn("cpu")
        assert torch.backends.cuda.cudnn_sdp_enabled()
        serve_attention_without_cudnn("cuda:0")  # a flag: set on a CPU-only build too
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@pytest.fixture
def entered(monkeypatch) -> list[str]:
    """The devices the engines' steps entered, in order (the real scope still runs)."""
    seen: list[str] = []

    def recording(device):
        seen.append(str(device))
        return on_device(device)

    monkeypatch.setattr(decode_engine, "on_device", recording)
    monkeypatch.setattr(prefill_engine, "on_device", recording)
    return seen


def test_prefill_and_decode_steps_run_under_their_device(entered):
    pair = load_pair()  # the n-gram pair: CPU, so the scope itself is a no-op here
    prefill = prefill_engine.PrefillEngine(pair, prefill_engine.PrefillConfig(device="cpu"))
    decode = decode_engine.DecodeEngine(pair, decode_engine.DecodeConfig(device="cpu"))
    request = pdspec_pb2.GenerateRequest(
        prompt_token_ids=list(b"import "), sampling=pdspec_pb2.SamplingParams(do_sample=False, max_new_tokens=6)
    )
    prefilled = prefill.prefill(prefill.check(request))
    # the prefill's engine thread runs its steps (the first token, then the proposal and the
    # export) under the device it entered once, when it started
    assert entered == ["cpu"]
    wire = pdspec_pb2.DecodeRequest.FromString(prefilled.decode_request.SerializeToString())
    handle = decode.submit(validate_decode_request(wire, Receiver.from_contract(pair.contract(), 4)))
    steps = 0
    while decode.load:
        decode.step()
        steps += 1
    assert entered == ["cpu"] * (1 + steps) and steps >= 1
    assert handle.events.qsize() >= 1
