"""The KV handoff section of bench/wire.py: real gRPC on loopback and shared memory against a raw socket.

    python -m bench.wire_kv [--kv-tokens 1024,4096,16384] [--kv-chunk-bytes 4194304] [--repeat 3]

The decode side runs in its own process: the real DecodeServicer (validation, DecodeStream
and shared-memory import) on a real grpc.server with the decode node's settings, over the
real DecodeEngine's reservation and import (submit, _claim, import_chunk, imported) into a
paged pool of the Llama-3-8B KV shape, without the decode loop: a request's KV complete in the
pool is the moment its first decode step could start. It answers with that moment
(CLOCK_MONOTONIC, shared by the processes) and its peak private RSS beyond the pool since the
last GetInfo (which resets the sampler), then frees the blocks. The same process runs a raw TCP
receiver (recv_into one preallocated buffer: the transport alone, nothing imported). Both sides
sample their private RSS (resident minus shared pages) and glibc's heap in use (what is
allocated and not freed, which RSS overstates by what the allocator keeps) every 5 ms. The shared-memory path's
segment is the KV itself (the prefill node exports into it; here the random KV is copied into it
before the clock starts, as the other paths' export is made before it), mapped shared by both
processes, so neither counts it as extra.
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
from types import SimpleNamespace

import grpc
import torch

from bench.harness import environment, heap_in_use, markdown_table, report

LAYERS, HEADS, DIM = 32, 8, 128  # Llama-3-8B: 32 layers, 8 KV heads of 128
DTYPE = torch.bfloat16
LIMIT = 2**31 - 1  # gRPC's ceiling for one message
PAGE = os.sysconf("SC_PAGE_SIZE")
BUDGET = 2 + 8 + 1  # positions a request reserves beyond its prompt: max_new_tokens 2, K_max 8, + 1
MEMORY = ("prefill_extra", "prefill_heap", "decode_extra", "decode_heap")


def contract():
    from protos.contract import Contract
    from protos.kv_layout import layer_kv_layout

    layout = layer_kv_layout(LAYERS, HEADS, DIM, DTYPE)
    return Contract(32, 32, tuple(range(32)), "bench-llama-3-8b-shape", "bench-draft", layout)


def _private_rss() -> int:
    with open("/proc/self/statm") as f:
        _, resident, shared = f.read().split()[:3]
    return (int(resident) - int(shared)) * PAGE


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class RssSampler(threading.Thread):
    """Peak private RSS and peak heap in use (bench.harness.heap_in_use) since the last reset."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.reset()

    def reset(self) -> None:
        _trim()
        self.baseline = self.peak = _private_rss()
        self.heap_baseline = self.heap_peak = heap_in_use() or 0

    def extra(self) -> tuple[int, int]:
        return self.peak - self.baseline, self.heap_peak - self.heap_baseline

    def run(self) -> None:
        while True:
            self.peak = max(self.peak, _private_rss())
            self.heap_peak = max(self.heap_peak, heap_in_use() or 0)
            time.sleep(0.005)


def _serve(conn, max_tokens: int, device: str = "cpu") -> None:
    """The decode process: gRPC DecodeService + a raw receiver; ports sent back on `conn`."""
    from decode_node.engine import DecodeConfig, DecodeEngine
    from decode_node.request import Event
    from decode_node.server import VALIDATED_FIELDS, DecodeServicer, server_options
    from engine.kv_cache import KvPool
    from engine.paged_lm import PagedLlamaLM
    from models.base import import_tensors
    from models.pair import ModelPair
    from pdspec.metrics import NodeMetrics
    from protos import pdspec_pb2
    from protos.rpc import add_decode_servicer
    from protos.validation import Receiver, RequestLimits
    from sampling import DraftToTargetMap

    spec = contract()
    blocks = 1 + -(-(max_tokens + BUDGET) // 16)
    pool = KvPool(
        layers=LAYERS, kv_heads=HEADS, head_dim=DIM, num_blocks=blocks, block_size=16, dtype=DTYPE, device=device
    )
    # The import touches only the pool and the layout: a stand-in for the weights of the model.
    shape = SimpleNamespace(
        module=None,
        config=SimpleNamespace(num_kv_heads=HEADS, head_dim=DIM),
        num_layers=LAYERS,
        name=spec.target_model,
        vocab_size=32,
        eos_token_ids=(),
        kv_layout=spec.kv_layout,
        dtype=DTYPE,
        device=torch.device(device),
    )
    target = PagedLlamaLM(shape, pool, eager=True)
    sampler = RssSampler()  # after the pool: its pages are the KV itself, not extra
    sampler.start()

    class Engine(DecodeEngine):
        """DecodeEngine's reservation and import without its loop: a request whose KV is in
        the pool is answered with the time and memory figures, and its blocks freed."""

        def submit(self, decode_input, *, streamed=False):
            request = super().submit(decode_input, streamed=streamed)
            if not streamed:  # what admission does with a message's KV: _claim, then _admit's import
                with self._lock:
                    self._claim(request)
                import_tensors(self.pair.target, request.seq.target_state, decode_input.kv_cache)
                self._ready(request)
            return request

        def imported(self, request):
            super().imported(request)
            self._ready(request)

        def _ready(self, request):
            ready = time.monotonic()
            rss, heap = sampler.extra()
            info = {"ready": ready, "extra": rss, "heap": heap, "tokens": len(request.seq.target_state.tokens)}
            self.cancel(request)
            request.events.put(Event([], finished=True, finish_reason=json.dumps(info)))

    class Servicer(DecodeServicer):
        def GetInfo(self, request, context):
            sampler.reset()
            return self.info

    pair = ModelPair(target, target, DraftToTargetMap.identity(32), None)
    engine = Engine(pair, DecodeConfig(max_queue=4), verifier=object())
    receiver = Receiver.from_contract(spec, 8, RequestLimits(max_prompt_tokens=1 << 16), accept_shm_kv=True)
    metrics = NodeMetrics("decode", 8, VALIDATED_FIELDS)
    servicer = Servicer(engine, receiver, metrics, pdspec_pb2.NodeInfo(role="decode"))
    server = grpc.server(futures.ThreadPoolExecutor(4), options=server_options(LIMIT))
    add_decode_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    listener = socket.create_server(("127.0.0.1", 0))

    def raw() -> None:
        while True:
            sock, _ = listener.accept()
            with sock:
                (total,) = struct.unpack("<Q", sock.recv(8, socket.MSG_WAITALL))
                buf = bytearray(total)  # where the bytes land: it stands for the pool, not extra
                view, got = memoryview(buf), 0
                while got < total:
                    n = sock.recv_into(view[got:], min(total - got, 1 << 22))
                    if not n:
                        break
                    got += n
                rss, heap = sampler.extra()
                info = {"ready": time.monotonic(), "extra": rss - total, "heap": heap - total, "bytes": got}
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


def kv_handoff(tokens: list[int], chunk_bytes: int, repeat: int, device: str = "cpu") -> tuple[list[dict], str]:
    from protos import pdspec_pb2, wire
    from protos.rpc import DecodeStub
    from protos.shm_kv import SharedKvSegment

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, max(tokens), device), daemon=True)
    proc.start()
    grpc_port, raw_port = parent.recv()
    options = [("grpc.max_receive_message_length", LIMIT), ("grpc.max_send_message_length", LIMIT)]
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=options)
    stub = DecodeStub(channel)
    stub.GetInfo(pdspec_pb2.InfoRequest(), timeout=60)
    sampler = RssSampler()
    sampler.start()

    def finished(call) -> dict:
        return json.loads(list(call)[-1].finish_reason)

    def run_raw(kv, _header_msg) -> dict:
        total = sum(t.numel() * t.element_size() for t in kv)
        with socket.create_connection(("127.0.0.1", raw_port)) as sock:
            sock.sendall(struct.pack("<Q", total))
            for t in kv:
                sock.sendall(wire.host_bytes(t))
            info = json.loads(sock.makefile().readline())
        assert info["bytes"] == total, info
        return info

    def run_decode(kv, header) -> dict:
        out = wire.WireDecodeRequest(header)
        for i, t in enumerate(kv):
            out.set_tensor(f"kv_cache[{i}]", t)
        return finished(stub.Decode(out, timeout=300))

    def run_stream(kv, header) -> dict:
        chunks = wire.stream_chunks(wire.WireDecodeRequest(header), kv, chunk_bytes)
        return finished(stub.DecodeStream(chunks, timeout=300))

    def run_shm(_kv, header) -> dict:  # the KV is in the segment already: the export wrote it there
        return finished(stub.Decode(wire.WireDecodeRequest(header), timeout=300))

    modes = {"raw socket": run_raw, "Decode (one message)": run_decode, "DecodeStream": run_stream, "shm": run_shm}
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
                    segment = None
                    if mode == "shm":  # the prefill node exports into the segment: untimed, like the others' export
                        segment = SharedKvSegment.create([(t.dtype, t.shape) for t in kv])
                        for view, tensor in zip(segment.tensors, kv, strict=True):
                            view.copy_(tensor)
                        del view
                        segment.close()
                        header.kv_shm.CopyFrom(segment.handle)
                    stub.GetInfo(pdspec_pb2.InfoRequest(), timeout=30)  # resets the decode side's sampler
                    sampler.reset()
                    start = time.monotonic()
                    try:
                        info = fn(kv, header)
                    finally:
                        if segment is not None:
                            segment.unlink()
                    assert info.get("tokens", seq) == seq, (mode, info)
                    rss, heap = sampler.extra()
                    runs.append(
                        {
                            "seconds": info["ready"] - start,
                            "prefill_extra": rss,
                            "prefill_heap": heap,
                            "decode_extra": info["extra"],
                            "decode_heap": info["heap"],
                        }
                    )
                    del segment
                seconds = statistics.median(r["seconds"] for r in runs)
                results[mode] = {
                    "seconds": seconds,
                    "gbps": total / seconds / 1e9,
                    **{f"{key}_bytes": max(r[key] for r in runs) for key in runs[0] if key != "seconds"},
                    "runs": runs,
                }
                print(seq, mode, f"{seconds * 1e3:.0f} ms", f"{total / seconds / 1e9:.2f} GB/s", flush=True)
            raw, single = results["raw socket"], results["Decode (one message)"]
            for mode, r in results.items():
                rows.append({"tokens": seq, "kv_bytes": total, "mode": mode, "chunk_bytes": chunk_bytes} | (r or {}))
                if r is None:
                    table.append([seq, f"{total / 2**20:.0f}", mode, "n/a: over the 2 GiB message ceiling"] + [""] * 8)
                    continue
                table.append(
                    [
                        seq,
                        f"{total / 2**20:.0f}",
                        mode,
                        f"{r['seconds'] * 1e3:.0f}",
                        f"{r['seconds'] / single['seconds']:.2f}" if single and mode != "raw socket" else "",
                        f"{r['gbps']:.2f}",
                        f"{raw['seconds'] / r['seconds']:.0%}",
                        *(f"{r[f'{key}_bytes'] / 2**20:.1f}" for key in MEMORY),
                        f"{max(r[f'{key}_bytes'] for key in MEMORY) / chunk_bytes:.2f}",
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
        "export → KV in the decode pool, ms",
        "vs one message",
        "GB/s",
        "vs raw socket",
        "prefill extra RSS MiB",
        "prefill extra heap MiB",
        "decode extra RSS MiB",
        "decode extra heap MiB",
        "max extra / chunk",
    ]
    return rows, markdown_table(header, table)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-tokens", default="1024,4096,16384")
    parser.add_argument("--kv-chunk-bytes", type=int, default=4 << 20)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="where the decode side's KV pool lives (cuda: H2D import)")
    args = parser.parse_args()
    env = environment()
    print("\n".join(f"{k}: {v}" for k, v in env.items()), flush=True)
    env["pool_device"] = args.device
    rows, table = kv_handoff([int(t) for t in args.kv_tokens.split(",")], args.kv_chunk_bytes, args.repeat, args.device)
    report("wire_kv", env, rows, table)


if __name__ == "__main__":
    main()
