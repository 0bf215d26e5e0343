"""A small Python client of the prefill node (used by the CLI and the tests)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc

from protos import pdspec_pb2, pdspec_pb2_grpc


@dataclass
class Generation:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stats: pdspec_pb2.RequestStats = field(default_factory=pdspec_pb2.RequestStats)


class Client:
    def __init__(self, prefill_addr: str = "localhost:50051", max_message_bytes: int = 64 << 20) -> None:
        options = [("grpc.max_receive_message_length", max_message_bytes)]
        self.channel = grpc.insecure_channel(prefill_addr, options=options)
        self.stub = pdspec_pb2_grpc.PrefillServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] = (),
        max_new_tokens: int = 0,
        greedy: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop_token_ids: Sequence[int] = (),
        num_speculative_tokens: int = 4,
        request_id: str | None = None,
        timeout: float | None = 60.0,
    ) -> Iterator[pdspec_pb2.GenerateResponse]:
        """The raw response stream; cancel it by closing the iterator."""
        sampling = pdspec_pb2.SamplingParams(
            do_sample=not greedy,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            stop_token_ids=list(stop_token_ids),
        )
        if seed is not None:
            sampling.seed = seed
        request = pdspec_pb2.GenerateRequest(
            request_id=request_id or uuid.uuid4().hex,
            prompt=prompt or "",
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling,
            num_speculative_tokens=num_speculative_tokens,
        )
        return self.stub.Generate(request, timeout=timeout)

    def generate(self, prompt: str | None = None, **kwargs) -> Generation:
        out = Generation()
        for response in self.stream(prompt, **kwargs):
            out.text += response.text
            out.token_ids += response.token_ids
            if response.finished:
                out.finish_reason = response.finish_reason
                out.stats = response.stats
        return out

    def info(self, timeout: float = 5.0) -> pdspec_pb2.NodeInfo:
        return self.stub.GetInfo(pdspec_pb2.InfoRequest(), timeout=timeout)


def decode_info(decode_addr: str, timeout: float = 5.0) -> pdspec_pb2.NodeInfo:
    with grpc.insecure_channel(decode_addr) as channel:
        return pdspec_pb2_grpc.DecodeServiceStub(channel).GetInfo(pdspec_pb2.InfoRequest(), timeout=timeout)
