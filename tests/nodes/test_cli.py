"""The `pdspec` command line against real nodes: --version, info as JSON per node, a prompt
from standard input, and a connection error that says what to start."""

import io
import json
import sys

import pytest

from pdspec import cli


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("pdspec ")


def test_info_is_json_per_node(nodes, capsys):
    _, prefill, decode = nodes
    addrs = ["--prefill-addr", f"127.0.0.1:{prefill.port}", "--decode-addr", f"127.0.0.1:{decode.port}"]
    assert cli.main(["info", *addrs]) == 0
    both = json.loads(capsys.readouterr().out)
    assert both["prefill"]["role"] == "prefill" and both["decode"]["role"] == "decode"
    assert both["decode"]["contract_fingerprint"] == both["prefill"]["contract_fingerprint"]
    assert both["decode"]["backends"]["target"] == "builtin-ngram"
    assert cli.main(["info", "--node", "decode", *addrs]) == 0
    assert set(json.loads(capsys.readouterr().out)) == {"decode"}


def test_generate_reads_the_prompt_from_stdin(nodes, capsys, monkeypatch):
    client, prefill, _ = nodes
    monkeypatch.setattr(sys, "stdin", io.StringIO("def main():\n    "))
    args = ["generate", "--prefill-addr", f"127.0.0.1:{prefill.port}", "--greedy", "--max-new-tokens", "12", "-"]
    assert cli.main(args) == 0
    printed = capsys.readouterr().out
    expected = client.generate("def main():\n    ", greedy=True, max_new_tokens=12)
    assert printed.startswith(expected.text) and "[finished: length]" in printed


def test_connection_error_says_what_to_start(capsys):
    assert cli.main(["info", "--node", "prefill", "--prefill-addr", "127.0.0.1:1"]) == 1
    assert "pdspec serve" in capsys.readouterr().err


def test_a_second_node_on_a_port_in_use_fails_at_start(nodes, pair):
    """No silent SO_REUSEPORT double bind: the second server refuses to start."""
    from decode_node.server import DecodeNodeConfig
    from decode_node.server import run_server as run_decode

    _, _, decode = nodes
    with pytest.raises(OSError, match="is another node there"):  # noqa: SIM117 (the context never opens)
        with run_decode(DecodeNodeConfig(host="127.0.0.1", port=decode.port, metrics_port=None), lambda: pair):
            pass


def test_serve_gives_both_nodes_prompt_lookup_without_a_shipped_head(capsys, monkeypatch, tmp_path):
    """`pdspec serve` / `make run` without a head shipped for the target: prompt lookup (the
    fastest exact method without a trained draft, bench/speedup.py) on both nodes unless asked
    otherwise; the draft layers stay loaded for draft and hybrid; the built-in pair keeps its own
    draft; an unknown method is the launcher's error naming the flag."""
    from pdspec import local

    monkeypatch.setattr(local, "SHIPPED_HEADS", {local.DEFAULT_MODEL: tmp_path / "absent"})
    flags = local.model_flags(local.parse_args([]))
    assert flags[flags.index("--speculative-method") + 1] == "prompt-lookup"
    assert flags[flags.index("--draft-layers") + 1] == "8"
    hybrid = local.model_flags(local.parse_args(["--speculative-method", "hybrid"]))
    assert hybrid[hybrid.index("--speculative-method") + 1] == "hybrid"
    assert "--speculative-method" not in local.model_flags(local.parse_args(["--builtin"]))
    with pytest.raises(SystemExit):
        local.parse_args(["--speculative-method", "guess"])
    assert "--speculative-method" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # eagle needs a head: none shipped, none named
        local.parse_args(["--speculative-method", "eagle"])
    assert "eagle" in capsys.readouterr().err


def test_serve_gives_both_nodes_the_shipped_head_as_hybrid(monkeypatch, tmp_path):
    """With a head shipped for the target and no draft named, both nodes serve it as hybrid
    (prompt lookup where the context matches, the head elsewhere), or alone with eagle; a draft
    named (--draft-model, --draft-layers), another target or a method that takes no head keeps
    the flags as given."""
    from pdspec import local

    head = tmp_path / "head"
    head.mkdir()
    (head / "eagle.json").write_text("{}")
    monkeypatch.setattr(local, "SHIPPED_HEADS", {local.DEFAULT_MODEL: head})

    def drafting(*argv: str) -> tuple[str, str | None, str | None]:
        flags = local.model_flags(local.parse_args(list(argv)))
        draft = {flags[i]: flags[i + 1] for i in range(len(flags) - 1) if flags[i].startswith("--draft")}
        return flags[flags.index("--speculative-method") + 1], draft.get("--draft-model"), draft.get("--draft-layers")

    assert drafting() == ("hybrid", str(head), None)
    assert drafting("--speculative-method", "eagle") == ("eagle", str(head), None)
    assert drafting("--speculative-method", "prompt-lookup") == ("prompt-lookup", None, "8")
    assert drafting("--draft-layers", "4") == ("prompt-lookup", None, "4")
    assert drafting("--speculative-method", "hybrid", "--draft-layers", "8") == ("hybrid", None, "8")
    assert drafting("--target-model", "other.gguf") == ("prompt-lookup", None, "8")
    monkeypatch.setenv("PDSPEC_SPECULATIVE_METHOD", "draft")
    assert drafting() == ("draft", None, "8")


def test_serve_splits_one_gpu_between_the_nodes(capsys):
    """On a GPU both nodes get their own share of it (decode the larger: its pool grows with
    concurrency), on the CPU none; shares outside (0, 1] or adding up to more than the device
    are the launcher's error naming the flags."""
    from pdspec import local

    gpu = local.parse_args(["--device", "cuda"])
    assert local.memory_flags(gpu, "decode") == ["--gpu-memory-utilization", "0.55"]
    assert local.memory_flags(gpu, "prefill") == ["--gpu-memory-utilization", "0.3"]
    assert local.memory_flags(local.parse_args([]), "decode") == []
    mine = local.parse_args(["--device", "cuda:1", "--decode-gpu-memory-utilization", "0.6"])
    assert local.memory_flags(mine, "decode") == ["--gpu-memory-utilization", "0.6"]
    for argv, flag in (
        (["--prefill-gpu-memory-utilization", "0"], "--prefill-gpu-memory-utilization: expected a value in (0, 1]"),
        (["--decode-gpu-memory-utilization", "0.8"], "expected at most 1 (both nodes share the GPU), got 1.1"),
    ):
        with pytest.raises(SystemExit):
            local.parse_args(argv)
        assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("free_gib", "held_gib", "fraction", "expected"),
    [
        (100, 0, 0.5, "ok"),  # the check before loading: 50 of 100 free
        (40, 0, 0.5, "only this much is free: 40.0 GiB"),  # another process holds 60
        (60, 40, 0.5, "ok"),  # after loading: 50 - 40 of weights = 10 for the pool
        (60, 55, 0.5, "this node's weights alone take 55.0 GiB"),
        (5, 40, 0.5, "beside its 40.0 GiB only this much is free: 5.0 GiB"),  # the other node came first
    ],
)
def test_the_memory_share_is_this_process_s_own(monkeypatch, free_gib, held_gib, fraction, expected):
    """--gpu-memory-utilization × total is what this process may hold (weights + pool): the
    pool is that less what it holds; a share that does not fit in the free memory is one
    MemoryShareError naming the flag, the value and the remedy. The device's memory figures
    are given here; tests/nodes/test_gpu_serve.py runs the rule on a GPU."""
    import torch

    from pdspec.modelspec import GIB, MemoryShareError, ModelSpec

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free_gib * GIB, 100 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: held_gib * GIB)
    spec = ModelSpec(device="cuda", gpu_memory_utilization=fraction)
    check = spec.check_memory if held_gib == 0 else spec.kv_budget
    if expected == "ok":
        budget = check()
        assert budget is None if held_gib == 0 else budget == (50 - held_gib) * GIB
        return
    with pytest.raises(MemoryShareError) as err:
        check()
    message = str(err.value)
    assert message.startswith(f"--gpu-memory-utilization {fraction}: 50.0 GiB of cuda's 100.0 GiB, but "), message
    assert expected in message and "--kv-cache-bytes" in message and "\n" not in message
    assert ModelSpec(device="cuda", kv_cache_bytes=GIB).kv_budget() == GIB  # an explicit pool is not a share


def test_the_share_counts_only_what_this_node_loaded(monkeypatch):
    """Two nodes in one process (the benchmarks' in-process harness): what the process held
    before this node loaded, the other node's weights and pool, is not this node's."""
    import torch

    from pdspec.modelspec import GIB, MemoryShareError, ModelSpec

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (30 * GIB, 100 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 60 * GIB)
    spec = ModelSpec(device="cuda", gpu_memory_utilization=0.3)
    assert spec.reserved() == 60 * GIB
    assert spec.kv_budget(55 * GIB) == (30 - 5) * GIB  # 5 GiB of its own weights
    with pytest.raises(MemoryShareError, match=r"this node's weights alone take 60\.0 GiB"):
        spec.kv_budget()
    assert ModelSpec(device="cpu").reserved() == 0


def test_generate_with_a_json_schema_file(nodes, capsys, tmp_path):
    _, prefill, _ = nodes
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    args = ["generate", "--prefill-addr", f"127.0.0.1:{prefill.port}", "--greedy", "--max-new-tokens", "64"]
    assert cli.main([*args, "--json-schema", str(path), "x = "]) == 0
    printed = capsys.readouterr().out
    text, _, tail = printed.rpartition("\n[finished: ")
    assert tail.startswith("stop]") and isinstance(json.loads(text)["ok"], bool)
    with pytest.raises(SystemExit):  # two constraints at once
        cli.main([*args, "--json-schema", str(path), "--regex", "a+", "x = "])
    assert "at most one" in capsys.readouterr().err
