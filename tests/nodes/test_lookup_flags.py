"""--speculative-method, --prompt-lookup-min/-max (both nodes), --adaptive-k and --speculate-ahead (decode): the
values reach the engines' configs, bad values are parser errors that name the flag."""

import os

import pytest

from decode_node.__main__ import parse_args as decode_args
from prefill_node.__main__ import parse_args as prefill_args

NODES = {"decode": decode_args, "prefill": prefill_args}
LOOKUP = ["--speculative-method", "prompt-lookup", "--prompt-lookup-min", "3", "--prompt-lookup-max", "6"]


@pytest.fixture(autouse=True)
def no_flag_environment(monkeypatch):
    """Flags read PDSPEC_<ROLE>_<FLAG> defaults: none from the caller's environment."""
    for name in list(os.environ):
        if name.startswith(("PDSPEC_DECODE_", "PDSPEC_PREFILL_")):
            monkeypatch.delenv(name)


def parser_error(parse_args, argv, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        parse_args(argv)
    assert done.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("node", NODES)
def test_the_lookup_flags_reach_the_engine_config(node):
    engine = NODES[node](LOOKUP).engine
    assert (engine.spec.method, engine.spec.prompt_lookup_min, engine.spec.prompt_lookup_max) == ("prompt-lookup", 3, 6)


@pytest.mark.parametrize("node", NODES)
@pytest.mark.parametrize("method", ["draft", "prompt-lookup", "hybrid"])
def test_every_method_is_accepted(node, method):
    assert NODES[node](["--speculative-method", method]).engine.spec.method == method


@pytest.mark.parametrize("node", NODES)
def test_the_defaults(node):
    engine = NODES[node]([]).engine
    assert (engine.spec.method, engine.spec.prompt_lookup_min, engine.spec.prompt_lookup_max) == ("draft", 2, 5)


def test_adaptive_k_reaches_the_decode_config():
    assert decode_args([]).engine.spec.adaptive_k == "auto"
    assert not decode_args([]).engine.spec.adaptive  # auto, with the draft model: off
    assert decode_args(LOOKUP).engine.spec.adaptive  # auto, with prompt lookup: on
    for value, adaptive in (("on", True), ("off", False)):
        engine = decode_args([*LOOKUP, "--adaptive-k", value]).engine
        assert engine.spec.adaptive_k == value and engine.spec.adaptive is adaptive
    assert decode_args(["--adaptive-k", "on"]).engine.spec.adaptive  # on with the draft model too


def test_speculate_ahead_reaches_the_decode_config(capsys):
    assert decode_args([]).engine.speculate_ahead == "off"
    assert decode_args(["--speculate-ahead", "on"]).engine.speculate_ahead == "on"
    assert "--speculate-ahead" in parser_error(decode_args, ["--speculate-ahead", "yes"], capsys)


def test_the_environment_sets_the_defaults(monkeypatch):
    monkeypatch.setenv("PDSPEC_DECODE_SPECULATIVE_METHOD", "hybrid")
    monkeypatch.setenv("PDSPEC_DECODE_PROMPT_LOOKUP_MAX", "7")
    monkeypatch.setenv("PDSPEC_DECODE_ADAPTIVE_K", "off")
    engine = decode_args([]).engine
    assert (engine.spec.method, engine.spec.prompt_lookup_max, engine.spec.adaptive_k) == ("hybrid", 7, "off")
    assert decode_args(["--speculative-method", "draft"]).engine.spec.method == "draft"  # the flag wins


@pytest.mark.parametrize("node", NODES)
@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--prompt-lookup-min", "0"], "--prompt-lookup-min"),
        (["--prompt-lookup-min", "-2", "--prompt-lookup-max", "-1"], "--prompt-lookup-min"),
        (["--prompt-lookup-min", "2", "--prompt-lookup-max", "1"], "--prompt-lookup-max"),
        (["--prompt-lookup-max", "1"], "--prompt-lookup-max"),  # below the default min (2)
        (["--speculative-method", "bogus"], "--speculative-method"),
        (["--prompt-lookup-min", "two"], "--prompt-lookup-min"),
    ],
)
def test_bad_values_are_parser_errors_naming_the_flag(node, argv, flag, capsys):
    err = parser_error(NODES[node], argv, capsys)
    assert flag in err, err
    assert "error:" in err


def test_the_min_max_error_says_what_it_expected(capsys):
    err = parser_error(decode_args, ["--prompt-lookup-min", "4", "--prompt-lookup-max", "3"], capsys)
    assert "--prompt-lookup-max: expected >= --prompt-lookup-min (4), got 3" in err
    err = parser_error(prefill_args, ["--prompt-lookup-min", "0"], capsys)
    assert "--prompt-lookup-min: expected >= 1, got 0" in err


def test_a_bad_adaptive_k_is_a_parser_error(capsys):
    err = parser_error(decode_args, ["--adaptive-k", "maybe"], capsys)
    assert "--adaptive-k" in err and "maybe" in err


def test_adaptive_k_is_a_decode_flag_only(capsys):
    err = parser_error(prefill_args, ["--adaptive-k", "on"], capsys)
    assert "--adaptive-k" in err
