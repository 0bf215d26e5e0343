"""Both nodes on one GPU as a user starts them (`make test-gpu`): `pdspec serve --device cuda`
with its default memory split, the GPU compose file's environment run as the two processes its
containers would be, and a share that does not fit refused with one line, not a traceback."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import yaml

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from pdspec.client import Client, decode_info
from pdspec.local import GPU_SHARES, peer_token_file, wait_serving
from tests.models.hf_fixtures import WORDS, make_family_checkpoint, make_tokenizer

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
START_S = 300
STOP_S = 30
NODE_ENV = {**os.environ, "PYTHONFAULTHANDLER": "1"}


@pytest.fixture(autouse=True)
def no_cached_memory():
    """This test process's own cached GPU memory (earlier tests') must not count against the nodes."""
    torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = make_family_checkpoint(tmp_path_factory.mktemp("serve-llama"), "llama", seed=5, layers=3)
    make_tokenizer(path, WORDS)
    return path


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def stop(process: subprocess.Popen) -> int | str:
    """The exit status after SIGTERM; a process still running after STOP_S is made to dump
    its threads' stacks (PYTHONFAULTHANDLER, see `NODE_ENV`) into its log and killed."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            process.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            process.kill()
        return f"{process.args[:3]} did not stop within {STOP_S} s of SIGTERM"


def generate_both_ways(grpc_port: int, http_port: int) -> None:
    """A greedy generation over gRPC, and the same prompt through the official OpenAI client."""
    with Client(f"127.0.0.1:{grpc_port}") as client:
        out = client.generate("the cat sat on the mat", greedy=True, max_new_tokens=16)
        assert len(out.token_ids) > 0
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="-", max_retries=0, timeout=60)
    model = api.models.list().data[0].id
    completion = api.completions.create(model=model, prompt="the cat sat on the mat", max_tokens=8)
    assert completion.choices[0].text is not None and completion.usage.completion_tokens > 0


def pool_bytes(port: int, role: str, peer_token: str) -> int:
    """A node's KV pool size from its GetInfo (the decode node's needs the launcher's peer token)."""
    if role == "decode":
        return decode_info(f"127.0.0.1:{port}", peer_token=peer_token).kv_pool_bytes
    with Client(f"127.0.0.1:{port}") as client:
        return client.info().kv_pool_bytes


@pytest.fixture
def peer_token() -> Iterator[Path]:
    """A peer token file as the launcher writes it (the compose file's peer-token volume holds one)."""
    with peer_token_file() as path:
        yield path


def test_serve_on_one_gpu_with_default_flags(checkpoint, tmp_path):
    """The launcher splits the GPU (GPU_SHARES): both nodes start, report their pools, serve
    gRPC and the OpenAI API, and stop with the launcher's SIGTERM."""
    prefill, decode, prefill_metrics, decode_metrics, http = free_ports(5)
    log = open(tmp_path / "serve.log", "w+")  # noqa: SIM115 (read after the process ends)
    scratch = tmp_path / "tmp"  # the launcher's TMPDIR: where it writes the nodes' peer token
    scratch.mkdir()
    launcher = subprocess.Popen(
        [
            *(sys.executable, "-m", "pdspec.local", "--device", "cuda"),
            *("--target-model", str(checkpoint), "--draft-layers", "1"),
            *("--prefill-port", str(prefill), "--decode-port", str(decode), "--http-port", str(http)),
            *("--prefill-metrics-port", str(prefill_metrics), "--decode-metrics-port", str(decode_metrics)),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**NODE_ENV, "TMPDIR": str(scratch)},
    )
    try:
        wait_serving(f"127.0.0.1:{prefill}", START_S, [launcher])
        generate_both_ways(prefill, http)
        total = torch.cuda.mem_get_info()[1]
        (token,) = scratch.glob("pdspec-peer-token-*")
        for port, role in ((decode, "decode"), (prefill, "prefill")):
            assert 0 < pool_bytes(port, role, token.read_text().strip()) < GPU_SHARES[role] * total, role
    finally:
        code = stop(launcher)
        log.seek(0)
        text = log.read()
    assert code == 0, text
    assert text.count("KV pools: target") == 2 and "Traceback" not in text, text


def compose_environment(role: str, overrides: dict[str, str]) -> dict[str, str]:
    """A service's environment as docker-compose.yml + docker-compose.gpu.yml give it, with
    `${VAR:-default}` at its default, then `overrides` (ports and model: this test's)."""
    env: dict[str, str] = {}
    for name in ("docker-compose.yml", "docker-compose.gpu.yml"):
        service = yaml.safe_load((ROOT / "deploy" / name).read_text())["services"][role]
        env.update({k: re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(v)) for k, v in service["environment"].items()})
    return {**env, **overrides}


def test_the_gpu_compose_command_lines_share_one_gpu(checkpoint, tmp_path, peer_token):
    """The two containers of the GPU compose file, as processes on one GPU: their entrypoint
    (`python -m <node>`) with their environment; the decode node first, as `depends_on` orders."""
    ports = dict(zip(("decode", "decode_metrics", "prefill", "prefill_metrics", "http"), free_ports(5), strict=True))
    model = {
        "TARGET_MODEL": str(checkpoint),
        "DRAFT_LAYERS": "1",
        "HOST": "127.0.0.1",
        "PEER_TOKEN_FILE": str(peer_token),
    }
    decode_env = compose_environment(
        "decode",
        {
            "PDSPEC_DECODE_PORT": str(ports["decode"]),
            "PDSPEC_DECODE_METRICS_PORT": str(ports["decode_metrics"]),
            **{f"PDSPEC_DECODE_{k}": v for k, v in model.items()},
        },
    )
    prefill_env = compose_environment(
        "prefill",
        {
            "PDSPEC_PREFILL_DECODE_ADDR": f"127.0.0.1:{ports['decode']}",
            "PDSPEC_PREFILL_PORT": str(ports["prefill"]),
            "PDSPEC_PREFILL_METRICS_PORT": str(ports["prefill_metrics"]),
            "PDSPEC_PREFILL_HTTP_PORT": str(ports["http"]),
            **{f"PDSPEC_PREFILL_{k}": v for k, v in model.items()},
        },
    )
    assert decode_env["PDSPEC_DECODE_GPU_MEMORY_UTILIZATION"] == str(GPU_SHARES["decode"])
    assert prefill_env["PDSPEC_PREFILL_GPU_MEMORY_UTILIZATION"] == str(GPU_SHARES["prefill"])
    processes = []
    try:
        for role, env in (("decode", decode_env), ("prefill", prefill_env)):
            log = open(tmp_path / f"{role}.log", "w")  # noqa: SIM115 (closed with the process)
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", f"{role}_node"],
                    env={**NODE_ENV, **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                )
            )
            wait_serving(f"127.0.0.1:{ports[role]}", START_S, processes)
        generate_both_ways(ports["prefill"], ports["http"])
    finally:
        codes = [stop(p) for p in reversed(processes)]
    assert codes == [0, 0], (codes, *((tmp_path / f"{r}.log").read_text()[-6000:] for r in ("prefill", "decode")))


def test_a_share_that_does_not_fit_is_one_line_and_the_launcher_stops_the_other_node(checkpoint, tmp_path):
    """With half of the GPU held by this process, the decode node's default 0.9 cannot fit:
    it exits 1 with one line naming the flag, the free memory and the remedy. Under the
    launcher (decode 0.55 of a half-free GPU) the prefill node is stopped and the launcher
    exits non-zero."""
    free, total = torch.cuda.mem_get_info()
    hold = torch.empty(max(0, int(free - total / 2)), dtype=torch.uint8, device="cuda")  # at most half free
    port, metrics = free_ports(2)
    node = subprocess.run(
        [
            *(sys.executable, "-m", "decode_node", "--device", "cuda", "--host", "127.0.0.1"),
            *("--target-model", str(checkpoint), "--draft-layers", "1"),
            *("--port", str(port), "--metrics-port", str(metrics)),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=START_S,
    )
    assert node.returncode == 1 and "Traceback" not in node.stderr, node.stderr
    last = node.stderr.strip().splitlines()[-1]
    assert last.startswith("pdspec decode node: error: --gpu-memory-utilization 0.9:"), last
    assert "free" in last and "--kv-cache-bytes" in last, last

    prefill, decode, prefill_metrics, decode_metrics, http = free_ports(5)
    launcher = subprocess.run(
        [
            *(sys.executable, "-m", "pdspec.local", "--device", "cuda"),
            *("--target-model", str(checkpoint), "--draft-layers", "1"),
            *("--prefill-port", str(prefill), "--decode-port", str(decode), "--http-port", str(http)),
            *("--prefill-metrics-port", str(prefill_metrics), "--decode-metrics-port", str(decode_metrics)),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=START_S,
    )
    out = launcher.stdout + launcher.stderr
    assert launcher.returncode != 0, out
    assert "pdspec decode node: error: --gpu-memory-utilization 0.55:" in out, out
    assert "decode_node exited during start-up" in out and "Traceback" not in out, out
    with socket.socket() as probe:  # the prefill node was stopped: its port is free again
        probe.bind(("127.0.0.1", prefill))
    del hold
