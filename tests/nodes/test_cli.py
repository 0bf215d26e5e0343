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


def test_serve_gives_both_nodes_prompt_lookup_by_default(capsys):
    """`pdspec serve` / `make run`: the fastest exact method (bench/speedup.py) on both nodes
    unless asked otherwise; the draft layers stay loaded for draft and hybrid; the built-in pair
    keeps its own draft; an unknown method is the launcher's error naming the flag."""
    from pdspec import local

    flags = local.model_flags(local.parse_args([]))
    assert flags[flags.index("--speculative-method") + 1] == "prompt-lookup"
    assert flags[flags.index("--draft-layers") + 1] == "8"
    hybrid = local.model_flags(local.parse_args(["--speculative-method", "hybrid"]))
    assert hybrid[hybrid.index("--speculative-method") + 1] == "hybrid"
    assert "--speculative-method" not in local.model_flags(local.parse_args(["--builtin"]))
    with pytest.raises(SystemExit):
        local.parse_args(["--speculative-method", "guess"])
    assert "--speculative-method" in capsys.readouterr().err
