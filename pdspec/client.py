"""A small Python client of the prefill node (used by the CLI and the tests)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdspec.tls import ClientTls, channel
from protos import pdspec_pb2, pdspec_pb2_grpc


@dataclass
class Generation:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stats: pdspec_pb2.RequestStats = field(default_factory=pdspec_pb2.RequestStats)


class Client:
    """`tls_ca` (or a client certificate) turns TLS on: `tls_ca` verifies the node (None with a
    client certificate: the system's roots), `tls_cert`/`tls_key` are the client's own for an
    mTLS node, `tls_server_name` the name to check the node's certificate against; `api_key`
    is sent as `authorization: Bearer <key>` on every call."""

    def __init__(
        self,
        prefill_addr: str = "localhost:50051",
        max_message_bytes: int = 64 << 20,
        *,
        tls_ca: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        tls_server_name: str | None = None,
        api_key: str | None = None,
    ) -> None:
        options = [("grpc.max_receive_message_length", max_message_bytes)]
        tls = ClientTls.from_args(tls_ca, tls_cert, tls_key, tls_server_name)
        self.channel = channel(prefill_addr, tls, options, api_key)
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
        stop: Sequence[str] = (),
        num_speculative_tokens: int | None = None,
        draft_candidates: int | None = None,
        request_id: str | None = None,
        timeout: float | None = 60.0,
        structured_output: pdspec_pb2.StructuredOutput | None = None,
    ) -> Iterator[pdspec_pb2.GenerateResponse]:
        """The raw response stream; cancel it by closing the iterator.

        num_speculative_tokens / draft_candidates None: the server's default K / candidates
        per draft node (> 1: multi-draft trees). timeout None: no deadline. structured_output:
        a constraint on the text (e.g. StructuredOutput(json_schema=json.dumps(schema)))."""
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
            stop=list(stop),
        )
        if num_speculative_tokens is not None:
            request.num_speculative_tokens = num_speculative_tokens
        if draft_candidates is not None:
            request.draft_candidates = draft_candidates
        if structured_output is not None:
            request.structured_output.CopyFrom(structured_output)
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


def decode_info(
    decode_addr: str, timeout: float = 5.0, tls: ClientTls | None = None, peer_token: str | None = None
) -> pdspec_pb2.NodeInfo:
    """The decode node's GetInfo (`peer_token`: the token of a node with --peer-token-file)."""
    with channel(decode_addr, tls, api_key=peer_token) as ch:
        return pdspec_pb2_grpc.DecodeServiceStub(ch).GetInfo(pdspec_pb2.InfoRequest(), timeout=timeout)
