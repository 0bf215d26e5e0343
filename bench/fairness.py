"""Fairness when long streams fill the decode batch (decode_node/fairness.py): CPU, built-in
pair, both nodes in one process on loopback, the default --max-batch 32.

    python bench/fairness.py [--streams 32] [--canaries 7] [--deadline 5] [--idle 16]

1. Long streams: `--streams` clients each ask for 4096 new tokens (the default cap) and read
   them; once they hold every decode slot, `--canaries` short requests (16 new tokens, a
   `--deadline` s deadline) arrive one after another. Per canary: the time to its first token
   (the prefill node's), to its second (the decode node's first: when it got a slot), to its
   end, and its status; for each --preempt-after-steps of `--after` (0: off).
2. Readers that stop, behind the prefill node: `--idle` clients ask for 4096 new tokens, read
   their first message and stop: over gRPC (pdspec.client.Client, gRPC's default windows) and
   over the OpenAI HTTP streaming API (`"stream": true` on /v1/completions, a socket with the
   OS's default buffers); and over gRPC from a channel with a fixed 1 KiB receive window
   (`grpc-1k`: no BDP probing). The tokens the decode node generated for them once the count stops
   growing (or after 60 s), with --pause-backlog 64 (the default) and 0 (off).

    python bench/fairness.py --parts idle   # part 2 only

Writes bench/results/fairness-cpu-<date>-<commit>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import json
import socket

import grpc

from bench.harness import Reader, environment, markdown_table, nodes, wait_until, write_results
from decode_node.engine import DecodeConfig
from models.loader import load_pair
from protos import pdspec_pb2, pdspec_pb2_grpc

LONG = 4096
PROMPT = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"


def long_streams(pair, streams: int, canaries: int, deadline: float, after_steps: int) -> dict:
    config = DecodeConfig(preempt_after_steps=after_steps)
    with nodes(pair, decode=config) as (client, _, decode):
        longs = [
            Reader(client.stream(PROMPT, max_new_tokens=LONG, seed=s, num_speculative_tokens=0, timeout=None))
            for s in range(streams)
        ]
        wait_until(lambda: decode.engine.running == config.max_batch, timeout=60, what="the streams to fill the batch")
        rows = []
        for c in range(canaries):
            started = time.monotonic()
            times: list[float] = []
            code, tokens = "OK", 0
            try:
                for response in client.stream(
                    PROMPT, max_new_tokens=16, seed=1000 + c, num_speculative_tokens=0, timeout=deadline
                ):
                    tokens += len(response.token_ids)
                    times += [time.monotonic() - started] * len(response.token_ids)
            except Exception as err:  # grpc.RpcError: the deadline
                code = getattr(err, "code", lambda: "ERROR")().name
            rows.append(
                {
                    "canary": c,
                    "code": code,
                    "tokens": tokens,
                    "first_token_s": round(times[0], 3) if times else None,
                    "first_decode_token_s": round(times[1], 3) if len(times) > 1 else None,
                    "done_s": round(time.monotonic() - started, 3) if code == "OK" else None,
                }
            )
        generated = sum(len(r.stream.tokens) for r in longs)
        for reader in longs:
            reader.cancel()
        for reader in longs:
            reader.thread.join(10)
        return {
            "preempt_after_steps": after_steps,
            "canaries": rows,
            "preemptions": decode.engine.fairness.preemptions,
            "long_stream_tokens_read": generated,
        }


def _http_stream(port: int, model: str, seed: int) -> socket.socket:
    """A streamed completion whose client reads its first bytes and then nothing."""
    body = json.dumps(
        {
            "model": model,
            "prompt": PROMPT,
            "max_tokens": LONG,
            "seed": seed,
            "temperature": 1.0,
            "num_speculative_tokens": 0,
            "stream": True,
        }
    ).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    sock.recv(256)
    return sock


def idle_readers(pair, idle: int, backlog: int, transport: str, seconds: float = 60.0) -> dict:
    config = DecodeConfig(pause_backlog=backlog)
    with nodes(pair, decode=config, prefill_node={"http_port": 0}) as (client, prefill, decode):
        if transport == "grpc":
            calls = [
                client.stream(PROMPT, max_new_tokens=LONG, seed=s, num_speculative_tokens=0, timeout=None)
                for s in range(idle)
            ]
        elif transport == "grpc-1k":  # a client channel with a fixed 1 KiB receive window
            options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
            channel = grpc.insecure_channel(f"127.0.0.1:{prefill.port}", options=options)
            stub = pdspec_pb2_grpc.PrefillServiceStub(channel)
            sampling = pdspec_pb2.SamplingParams(do_sample=True, seed=0, max_new_tokens=LONG)
            calls = [
                stub.Generate(pdspec_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling, num_speculative_tokens=0))
                for _ in range(idle)
            ]
        else:
            sockets = [_http_stream(prefill.http_port, prefill.http.api.model, s) for s in range(idle)]
        if transport != "http":
            for call in calls:
                next(call)
        wait_until(lambda: decode.engine.load == idle, timeout=60, what="the idle streams to start")
        started, counts = time.monotonic(), []
        while time.monotonic() - started < seconds:  # until the count stops growing for 3 s
            time.sleep(1.0)
            with decode.engine._lock:
                held = list(decode.engine._active) + list(decode.engine._pending)
            finished = idle - len(held)
            counts.append(sum(r.seq.generated for r in held) + finished * LONG)
            if len(counts) > 3 and counts[-1] == counts[-4]:
                break
        paused = sum(map(decode.engine.fairness.paused, held))
        generated = counts[-1]
        if transport != "http":
            for call in calls:
                call.cancel()
        else:
            for sock in sockets:
                sock.close()
        return {
            "transport": transport,
            "pause_backlog": backlog,
            "streams": idle,
            "seconds": seconds,
            "tokens_generated": generated,
            "tokens_per_stream": round(generated / idle),
            "seconds_run": len(counts),
            "paused_at_end": paused,
            "finished": finished,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--canaries", type=int, default=7)
    parser.add_argument("--deadline", type=float, default=5.0)
    parser.add_argument("--idle", type=int, default=16)
    parser.add_argument("--after", default="64,256,0", help="--preempt-after-steps values to run")
    parser.add_argument("--parts", default="long,idle", help="which parts to run: long, idle")
    args = parser.parse_args()
    parts = args.parts.split(",")
    pair = load_pair()
    runs = [
        long_streams(pair, args.streams, args.canaries, args.deadline, after)
        for after in (map(int, args.after.split(",")) if "long" in parts else [])
    ]
    idles = [
        idle_readers(pair, args.idle, backlog, transport)
        for transport in (("grpc", "grpc-1k", "http") if "idle" in parts else ())
        for backlog in (64, 0)
    ]
    table_rows = []
    for run in runs:
        done = [c for c in run["canaries"] if c["code"] == "OK"]
        slot = [c["first_decode_token_s"] for c in done if c["first_decode_token_s"] is not None]
        table_rows.append(
            [
                run["preempt_after_steps"] or "off",
                f"{len(done)}/{len(run['canaries'])}",
                max((c["first_token_s"] for c in run["canaries"] if c["first_token_s"] is not None), default="-"),
                round(statistics.median(slot), 3) if slot else "-",
                max(slot, default="-"),
                max((c["done_s"] for c in done), default="-"),
                run["preemptions"],
            ]
        )
    table = markdown_table(
        [
            "--preempt-after-steps",
            "canaries done",
            "max TTFT s",
            "median 2nd token s",
            "max 2nd token s",
            "max done s",
            "preemptions",
        ],
        table_rows,
    )
    table += "\n\n" + markdown_table(
        [
            "client",
            "--pause-backlog",
            "idle streams",
            "tokens generated",
            "per stream",
            "after s",
            "paused at the end",
            "finished",
        ],
        [
            [
                i["transport"],
                i["pause_backlog"] or "off",
                i["streams"],
                i["tokens_generated"],
                i["tokens_per_stream"],
                i["seconds_run"],
                i["paused_at_end"],
                i["finished"],
            ]
            for i in idles
        ],
    )
    path = write_results("fairness", environment(), {"long_streams": runs, "idle_readers": idles}, table)
    print(table)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
