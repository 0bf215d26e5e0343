"""The KV handoff section of bench/wire.py: real gRPC on loopback against a raw socket.

The decode side runs in its own process: the real DecodeServicer (validation, DecodeStream
reassembly) registered with protos.rpc on a real grpc.server, over a stub engine whose
`submit` is the moment the decode tensors are ready (the first decode step could start):
it answers with that time (CLOCK_MONOTONIC, shared by the processes) and the peak RSS
beyond the KV since the last GetInfo (which resets the sampler). The same process runs a
raw TCP receiver (recv_into one preallocated buffer). Both sides sample their RSS every 5 ms.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import multiprocessing
import os
import socket
import statistics
import struct
import threading
import time
from concurrent import futures

import grpc
import torch

from bench.common import markdown_table

LAYERS, HEADS, DIM = 32, 8, 128  # Llama-3-8B: 32 layers, 8 KV heads of 128
DTYPE = torch.bfloat16
LIMIT = 2**31 - 1  # gRPC's ceiling for one message
PAGE = os.sysconf("SC_PAGE_SIZE")


def contract():
    from protos.contract import SEQ, Contract, KvTensorSpec

    layout = tuple(KvTensorSpec(DTYPE, (HEADS, SEQ, DIM)) for _ in range(2 * LAYERS))
    return Contract(32, 32, tuple(range(32)), "bench-llama-3-8b-shape", "bench-draft", layout)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class RssSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.baseline = self.peak = _rss()

    def reset(self) -> None:
        _trim()
        self.baseline = self.peak = _rss()

    def run(self) -> None:
        while True:
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)


def _serve(conn) -> None:
    """The decode process: gRPC DecodeService + a raw receiver; ports sent back on `conn`."""
    from decode_node.engine import Event, Request
    from decode_node.server import VALIDATED_FIELDS, DecodeServicer
    from pdspec.metrics import NodeMetrics
    from protos import pdspec_pb2
    from protos.rpc import add_decode_servicer
    from protos.validation import Receiver, RequestLimits

    sampler = RssSampler()
    sampler.start()

    class Engine:
        def submit(self, decode_input):
            ready = time.monotonic()
            kv = sum(t.numel() * t.element_size() for t in decode_input.kv_cache)
            info = {"ready": ready, "extra": sampler.peak - sampler.baseline - kv, "kv": kv}
            request = Request(decode_input)
            request.events.put(Event([], finished=True, finish_reason=json.dumps(info)))
            return request

        def cancel(self, request) -> None:
            pass

    class Servicer(DecodeServicer):
        def GetInfo(self, request, context):
            sampler.reset()
            return self.info

    receiver = Receiver.from_contract(contract(), 8, RequestLimits(max_prompt_tokens=1 << 16))
    metrics = NodeMetrics("decode", 8, VALIDATED_FIELDS)
    servicer = Servicer(Engine(), receiver, metrics, pdspec_pb2.NodeInfo(role="decode"))
    options = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
    server = grpc.server(futures.ThreadPoolExecutor(4), options=options)
    add_decode_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listener = socket.create_server(("127.0.0.1", 0))

    def raw() -> None:
        while True:
            sock, _ = listener.accept()
            with sock:
                (total,) = struct.unpack("<Q", sock.recv(8, socket.MSG_WAITALL))
                buf = bytearray(total)  # the KV itself
                view, got = memoryview(buf), 0
                while got < total:
                    n = sock.recv_into(view[got:], min(total - got, 1 << 22))
                    if not n:
                        break
                    got += n
                info = {"ready": time.monotonic(), "extra": sampler.peak - sampler.baseline - total, "kv": got}
                sock.sendall(json.dumps(info).encode() + b"\n")
                del view, buf

    threading.Thread(target=raw, daemon=True).start()
    conn.send((port, listener.getsockname()[1]))
    conn.recv()  # until the bench is done
    server.stop(0)


def _header(seq: int):
    from protos import pdspec_pb2
    from protos.contract import PROTOCOL_VERSION

    return pdspec_pb2.DecodeRequest(
        request_id=f"kv-{seq}",
        protocol_version=PROTOCOL_VERSION,
        contract_fingerprint=contract().fingerprint(),
        prompt_token_ids=[1] * seq,
        first_token_id=1,
        num_speculative_tokens=0,
        proposal=pdspec_pb2.Proposal(encoding=pdspec_pb2.Proposal.POINT_MASS),
        sampling=pdspec_pb2.SamplingParams(max_new_tokens=2),
    )


def kv_handoff(tokens: list[int], chunk_bytes: int, repeat: int) -> tuple[list[dict], str]:
    from protos import pdspec_pb2, wire
    from protos.rpc import DecodeStub

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child,), daemon=True)
    proc.start()
    grpc_port, raw_port = parent.recv()
    options = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options)
    stub = DecodeStub(channel)
    stub.GetInfo(pdspec_pb2.InfoRequest(), timeout=30)
    sampler = RssSampler()
    sampler.start()

    def run_raw(kv, _header_msg) -> dict:
        total = sum(t.numel() * t.element_size() for t in kv)
        with socket.create_connection(("127.0.0.1", raw_port)) as sock:
            sock.sendall(struct.pack("<Q", total))
            for t in kv:
                sock.sendall(wire.host_bytes(t))
            return json.loads(sock.makefile().readline())

    def run_decode(kv, header) -> dict:
        out = wire.WireDecodeRequest(header)
        for i, t in enumerate(kv):
            out.set_tensor(f"kv_cache[{i}]", t)
        return json.loads(list(stub.Decode(out, timeout=300))[-1].finish_reason)

    def run_stream(kv, header) -> dict:
        chunks = wire.stream_chunks(wire.WireDecodeRequest(header), kv, chunk_bytes)
        return json.loads(list(stub.DecodeStream(chunks, timeout=300))[-1].finish_reason)

    modes = {"raw socket": run_raw, "Decode (one message)": run_decode, "DecodeStream": run_stream}
    rows, table = [], []
    try:
        for seq in tokens:
            kv = [
                torch.randint(-(2**15), 2**15, (HEADS, seq, DIM), dtype=torch.int16).view(DTYPE)
                for _ in range(2 * LAYERS)
            ]
            total = sum(t.numel() * t.element_size() for t in kv)
            results = {}
            for mode, fn in modes.items():
                if mode.startswith("Decode (") and total + (1 << 20) > LIMIT:
                    results[mode] = None  # over gRPC's 2 GiB message ceiling: cannot be sent at all
                    continue
                runs = []
                for _ in range(repeat):
                    header = _header(seq)
                    stub.GetInfo(pdspec_pb2.InfoRequest(), timeout=30)  # resets the decode side's sampler
                    sampler.reset()
                    start = time.monotonic()
                    info = fn(kv, header)
                    assert info["kv"] == total, (mode, info)
                    runs.append(
                        {
                            "seconds": info["ready"] - start,
                            "prefill_extra": sampler.peak - sampler.baseline,
                            "decode_extra": info["extra"],
                        }
                    )
                seconds = statistics.median(r["seconds"] for r in runs)
                results[mode] = {
                    "seconds": seconds,
                    "gbps": total / seconds / 1e9,
                    "prefill_extra_bytes": max(r["prefill_extra"] for r in runs),
                    "decode_extra_bytes": max(r["decode_extra"] for r in runs),
                    "runs": runs,
                }
                print(seq, mode, f"{seconds * 1e3:.0f} ms", f"{total / seconds / 1e9:.2f} GB/s", flush=True)
            raw = results["raw socket"]
            for mode, r in results.items():
                rows.append({"tokens": seq, "kv_bytes": total, "mode": mode, "chunk_bytes": chunk_bytes} | (r or {}))
                if r is None:
                    table.append([seq, f"{total / 2**20:.0f}", mode, "n/a: over the 2 GiB message ceiling"] + [""] * 5)
                    continue
                table.append(
                    [
                        seq,
                        f"{total / 2**20:.0f}",
                        mode,
                        f"{r['seconds'] * 1e3:.0f}",
                        f"{r['gbps']:.2f}",
                        f"{raw['seconds'] / r['seconds']:.0%}",
                        f"{r['prefill_extra_bytes'] / 2**20:.1f}",
                        f"{r['decode_extra_bytes'] / 2**20:.1f}",
                        f"{max(r['prefill_extra_bytes'], r['decode_extra_bytes']) / chunk_bytes:.2f}",
                    ]
                )
            del kv
            _trim()
    finally:
        parent.send("stop")
        proc.join(10)
        channel.close()
    header = [
        "prompt tokens",
        "KV MiB",
        "path",
        "export → decode tensors ready, ms",
        "GB/s",
        "vs raw socket",
        "prefill extra MiB",
        "decode extra MiB",
        "max extra / chunk",
    ]
    return rows, markdown_table(header, table)
