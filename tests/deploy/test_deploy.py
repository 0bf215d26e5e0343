"""The deployment files agree with the code: compose validates, the dashboard and alert
rules only use metrics a running node exports, Prometheus scrapes the nodes' ports, and
every image installs pdspec with the same script CI runs."""

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from decode_node.__main__ import build_parser as decode_parser
from decode_node.__main__ import parse_args as decode_args
from pdspec import healthcheck
from pdspec.local import GPU_SHARES
from prefill_node.__main__ import build_parser as prefill_parser
from prefill_node.__main__ import parse_args as prefill_args
from tests.nodes.conftest import cluster

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda", "Dockerfile.rocm"]


def compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose not found: CI must validate the compose files (see .ci/run)")
        # Outside CI only (CI fails above): a developer machine without docker-compose.
        pytest.skip("docker-compose is not installed on this machine")
    return path


def volume(entry: str | dict) -> tuple[str, str, bool]:
    """(source, target, read-only) of a compose volume: docker-compose 1.x prints the short
    syntax (`src:dst:ro`), 2.x the long one (a mapping)."""
    if isinstance(entry, str):
        source, target, *mode = entry.split(":")
        return source, target, mode == ["ro"]
    return entry["source"], entry["target"], bool(entry.get("read_only"))


@pytest.mark.parametrize(
    "override", [None, "docker-compose.gpu.yml", "docker-compose.rocm.yml", "docker-compose.two-gpu.yml"]
)
def test_compose_files_validate(override):
    files = ["-f", str(DEPLOY / "docker-compose.yml")] + (["-f", str(DEPLOY / override)] if override else [])
    result = subprocess.run([compose(), *files, "config"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert set(config["services"]) == {"peer-token", "decode", "prefill", "prometheus", "grafana"}
    for name in ("decode", "prefill"):  # one token file, written before either node starts
        service = config["services"][name]
        assert service["environment"][f"PDSPEC_{name.upper()}_PEER_TOKEN_FILE"] == "/run/pdspec/peer-token"
        assert {volume(v) for v in service["volumes"]} >= {("peer-token", "/run/pdspec", True)}
    assert config["services"]["decode"]["depends_on"]["peer-token"]["condition"] == "service_completed_successfully"
    prefill = config["services"]["prefill"]
    assert prefill["environment"]["PDSPEC_PREFILL_DECODE_ADDR"] == "dns:///decode:50052"
    assert prefill["depends_on"]["decode"]["condition"] == "service_healthy"
    for name in ("decode", "prefill"):  # the fastest exact default (BENCHMARKS.md), the same on both nodes
        assert config["services"][name]["environment"][f"PDSPEC_{name.upper()}_SPECULATIVE_METHOD"] == "prompt-lookup"
    if override == "docker-compose.gpu.yml":
        devices = config["services"]["decode"]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    if override == "docker-compose.two-gpu.yml":  # one GPU per node, not the same one
        gpus = [
            config["services"][name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for name in ("prefill", "decode")
        ]
        assert gpus == [["0"], ["1"]]
    if override == "docker-compose.rocm.yml":
        decode = config["services"]["decode"]
        assert {"/dev/kfd", "/dev/dri"} <= {d.split(":")[0] for d in decode["devices"]}
        assert decode["group_add"] == ["video"]
    if override:
        # device and dtype enter the model contract: both nodes must agree or never serve
        env = {name: config["services"][name]["environment"] for name in ("decode", "prefill")}
        role = {"decode": "DECODE", "prefill": "PREFILL"}
        for key in ("DEVICE", "DTYPE"):
            assert env["decode"][f"PDSPEC_DECODE_{key}"] == env["prefill"][f"PDSPEC_PREFILL_{key}"], key
        shares = {name: float(env[name][f"PDSPEC_{role[name]}_GPU_MEMORY_UTILIZATION"]) for name in env}
        if override == "docker-compose.two-gpu.yml":
            assert shares == {"decode": 0.9, "prefill": 0.9}  # a GPU each
        else:  # both on one GPU: the split `pdspec serve --device cuda` makes
            assert shares == GPU_SHARES
        for name, parser in (("decode", decode_args), ("prefill", prefill_args)):
            for variable in env[name]:
                if variable.startswith(f"PDSPEC_{role[name]}_"):
                    assert variable in flag_env_names(_parser_of(parser)), variable


def test_compose_tls_variant_validates():
    files = ["-f", str(DEPLOY / "docker-compose.yml"), "-f", str(DEPLOY / "docker-compose.tls.yml")]
    result = subprocess.run([compose(), *files, "config"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    decode, prefill = services["decode"]["environment"], services["prefill"]["environment"]
    assert decode["PDSPEC_DECODE_TLS_CA"] == "/certs/ca.pem"  # mTLS
    assert prefill["PDSPEC_PREFILL_DECODE_TLS_CERT"] == "/certs/client.pem"
    assert prefill["PDSPEC_PREFILL_DECODE_ADDR"] == "dns:///decode:50052"  # the base file's, kept
    for name in ("decode", "prefill"):
        targets = [v["target"] if isinstance(v, dict) else v.split(":")[1] for v in services[name]["volumes"]]
        assert "/certs" in targets, name


def test_compose_peer_token_service_writes_one_private_token(tmp_path, monkeypatch):
    """Without docker-compose too: the peer-token service's script, run as compose would run it
    (with /run/pdspec here a temporary directory), writes a token both nodes accept, mode 0600,
    and leaves an existing one alone (restarts keep the token the running nodes hold)."""
    from pdspec.config import read_peer_token

    services = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())["services"]
    service = services["peer-token"]
    assert service["entrypoint"] == ["sh", "-c"] and service["restart"] == "no"
    assert service["volumes"] == ["peer-token:/run/pdspec"] and service["healthcheck"] == {"disable": True}
    (script,) = service["command"]
    script = script.replace("$$", "$").replace("/run/pdspec", str(tmp_path))  # compose's escaping undone
    subprocess.run(["sh", "-c", script], check=True)
    token_file = tmp_path / "peer-token"
    token = read_peer_token(token_file)
    assert len(token) == 64 and int(token, 16) >= 0
    assert token_file.stat().st_mode & 0o777 == 0o600
    subprocess.run(["sh", "-c", script], check=True)
    assert read_peer_token(token_file) == token and sorted(p.name for p in tmp_path.iterdir()) == ["peer-token"]
    known = {"decode": flag_env_names(decode_parser()), "prefill": flag_env_names(prefill_parser())}
    for name in ("decode", "prefill"):
        env = services[name]["environment"]
        assert env[f"PDSPEC_{name.upper()}_PEER_TOKEN_FILE"] == "/run/pdspec/peer-token"
        assert f"PDSPEC_{name.upper()}_PEER_TOKEN_FILE" in known[name]
        assert "peer-token:/run/pdspec:ro" in services[name]["volumes"]
        monkeypatch.setenv(f"PDSPEC_{name.upper()}_PEER_TOKEN_FILE", str(token_file))
    assert decode_args([]).peer_token == prefill_args([]).peer_token == token
    # the API key from the environment, never on a command line
    assert services["prefill"]["environment"]["PDSPEC_PREFILL_API_KEY"] == "${PDSPEC_API_KEY:-}"
    for name in DOCKERFILES:  # the directory the volume takes its owner and mode from
        assert "install -d -o pdspec -g pdspec -m 0700 /run/pdspec" in (DEPLOY / name).read_text(), name


def test_make_peer_token_script(tmp_path):
    from pdspec.config import read_peer_token

    out = tmp_path / "secrets" / "peer-token"
    subprocess.run(["sh", str(DEPLOY / "make-peer-token.sh"), str(out)], check=True, capture_output=True)
    first = read_peer_token(out)
    assert len(first) == 64 and out.stat().st_mode & 0o777 == 0o600
    subprocess.run(["sh", str(DEPLOY / "make-peer-token.sh"), str(out)], check=True, capture_output=True)
    assert read_peer_token(out) != first  # rotation: a new token each run


def _parser_of(parse_args):
    module = __import__(parse_args.__module__, fromlist=["build_parser"])
    return module.build_parser()


def test_dockerfile_python_snippets_import():
    """Every `RUN python -c "from M import N; ..."` in the Dockerfiles names something that exists."""
    import importlib

    for name in DOCKERFILES:
        for module, names in re.findall(r'python -c "from ([\w.]+) import ([\w, ]+);', (DEPLOY / name).read_text()):
            imported = importlib.import_module(module)
            for symbol in names.split(","):
                assert hasattr(imported, symbol.strip()), f"{name}: {module}.{symbol.strip()}"


def flag_env_names(parser) -> set[str]:
    return {parser.env_name(a.option_strings[-1]) for a in parser._actions if a.option_strings}


def test_compose_tls_variant_sets_only_real_flags():
    """Every PDSPEC_* variable of the TLS override is a flag of the process that reads it
    (without docker-compose: the file itself), and the certificate paths are the ones
    deploy/make-certs.sh writes."""
    override = yaml.safe_load((DEPLOY / "docker-compose.tls.yml").read_text())["services"]
    known = {
        "decode": flag_env_names(decode_parser()) | flag_env_names(healthcheck.build_parser()),
        "prefill": flag_env_names(prefill_parser()) | flag_env_names(healthcheck.build_parser()),
    }
    script = (DEPLOY / "make-certs.sh").read_text()
    for name, service in override.items():
        env = service["environment"]
        assert set(env) <= known[name], set(env) - known[name]
        for value in env.values():
            if str(value).startswith("/certs/"):
                assert Path(value).name.replace("-key", "").removesuffix(".pem") in script, value
    assert {"PDSPEC_DECODE_TLS_CERT", "PDSPEC_DECODE_TLS_KEY", "PDSPEC_DECODE_TLS_CA"} <= set(
        override["decode"]["environment"]
    )
    assert {"PDSPEC_PREFILL_TLS_CERT", "PDSPEC_PREFILL_DECODE_TLS_CA", "PDSPEC_HEALTH_TLS_CA"} <= set(
        override["prefill"]["environment"]
    )


def test_compose_shm_variant_shares_dev_shm_and_turns_both_flags_on(monkeypatch, tmp_path):
    """Both containers in one IPC namespace (one /dev/shm), and the nodes that the merged
    environment configures really hand the KV over in shared memory."""
    files = ["-f", str(DEPLOY / "docker-compose.yml"), "-f", str(DEPLOY / "docker-compose.shm.yml")]
    result = subprocess.run([compose(), *files, "config"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    services = yaml.safe_load(result.stdout)["services"]
    assert services["decode"]["ipc"] == "shareable" and services["prefill"]["ipc"] == "service:decode"
    for name in ("decode", "prefill"):
        for variable, value in services[name]["environment"].items():
            if variable.startswith("PDSPEC_") and variable != "PDSPEC_HEALTH_ADDR":
                if variable.endswith("_PEER_TOKEN_FILE"):  # the volume's file, stood in for here
                    value = tmp_path / "peer-token"
                    value.write_text("0123456789abcdef" * 4)
                monkeypatch.setenv(variable, str(value))
    assert decode_args([]).accept_shm_kv
    assert prefill_args([]).engine.kv_transport.value == "shm"


def test_make_certs_script_writes_a_chain_that_verifies(tmp_path):
    if shutil.which("openssl") is None:
        if os.environ.get("CI"):
            pytest.fail("openssl not found: CI must check deploy/make-certs.sh")
        # Outside CI only (CI fails above): a developer machine without openssl.
        pytest.skip("openssl is not installed")
    subprocess.run(["sh", str(DEPLOY / "make-certs.sh"), str(tmp_path)], check=True, capture_output=True)
    ca = str(tmp_path / "ca.pem")
    for name, purpose in (("decode", "sslserver"), ("prefill", "sslserver"), ("client", "sslclient")):
        result = subprocess.run(
            ["openssl", "verify", "-CAfile", ca, "-purpose", purpose, str(tmp_path / f"{name}.pem")],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stdout + result.stderr
    sans = subprocess.run(
        ["openssl", "x509", "-in", str(tmp_path / "decode.pem"), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
    ).stdout
    assert "DNS:decode" in sans and "DNS:localhost" in sans


def referenced_metrics() -> set[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pdspec.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    exprs += [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    return {name for expr in exprs for name in re.findall(r"\bpdspec_[a-z_]+", expr)}


def exported(port: int) -> set[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_dashboard_and_alerts_use_only_exported_metrics(pair):
    with cluster(pair) as (client, prefill, decode):
        client.generate("import ", seed=1, max_new_tokens=20)
        names = exported(prefill.metrics_port) | exported(decode.metrics_port)
    referenced = referenced_metrics()
    assert len(referenced) >= 10
    assert referenced <= names, referenced - names
    for fixed in (
        "pdspec_spec_verify_steps_total",
        "pdspec_spec_draft_tokens_total",
        "pdspec_spec_accepted_tokens_total",
        "pdspec_spec_emitted_tokens_total",
        "pdspec_spec_accepted_tokens_per_position_total",
        "pdspec_spec_accept_length_bucket",
    ):
        assert fixed in names


def test_prometheus_scrapes_the_nodes_metrics_ports():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["pdspec-prefill"]["static_configs"][0]["targets"] == [f"prefill:{prefill_args([]).metrics_port}"]
    decode_sd = jobs["pdspec-decode"]["dns_sd_configs"][0]
    assert decode_sd["names"] == ["decode"] and decode_sd["port"] == decode_args([]).metrics_port == 9402
    assert prefill_args([]).metrics_port == 9401


def test_images_install_with_the_script_ci_runs():
    makefile = (ROOT / "Makefile").read_text()
    assert "deploy/install.sh $(PY)" in makefile
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    for name in DOCKERFILES:
        text = (DEPLOY / name).read_text()
        assert "deploy/install.sh /opt/pdspec/bin/python" in text, name
        assert text.count("\nFROM ") + text.startswith("FROM ") >= 2, f"{name}: multi-stage"
        assert "grpc_tools.protoc" in text, f"{name}: protos generated in the build"
        assert re.search(r"^USER pdspec$", text, re.M), f"{name}: non-root user"
        assert "HEALTHCHECK" in text and "pdspec.healthcheck" in text, name


def test_env_variables_configure_the_nodes(monkeypatch):
    monkeypatch.setenv("PDSPEC_DECODE_PORT", "6000")
    monkeypatch.setenv("PDSPEC_DECODE_DRAFT_SAMPLING", "stochastic")
    monkeypatch.setenv("PDSPEC_PREFILL_DECODE_ADDR", "dns:///decode:50052")
    monkeypatch.setenv("PDSPEC_PREFILL_COMPACT_ENCODINGS", "true")
    decode = decode_args([])
    assert decode.port == 6000 and decode.engine.spec.draft_law.value == "stochastic"
    assert decode_args(["--port", "7000"]).port == 7000  # the command line wins
    prefill = prefill_args([])
    assert prefill.decode_addr == "dns:///decode:50052" and prefill.engine.compact_encodings


def test_healthcheck_command(pair):
    with cluster(pair) as (_, prefill, decode):
        assert healthcheck.main(["--addr", f"127.0.0.1:{decode.port}"]) == 0
        assert healthcheck.main(["--addr", f"127.0.0.1:{prefill.port}", "--service", "pdspec.v1.PrefillService"]) == 0
    assert healthcheck.main(["--addr", "127.0.0.1:1", "--timeout", "0.5"]) == 1


def test_license_is_the_apache_2_text_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert 'license = "Apache-2.0"' in (ROOT / "pyproject.toml").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    for n, section in enumerate(
        [
            "Definitions",
            "Grant of Copyright License",
            "Grant of Patent License",
            "Redistribution",
            "Submission of Contributions",
            "Trademarks",
            "Disclaimer of Warranty",
            "Limitation of Liability",
            "Accepting Warranty or Additional Liability",
        ],
        start=1,
    ):
        assert f"   {n}. {section}." in text, section
    assert "END OF TERMS AND CONDITIONS" in text and "APPENDIX: How to apply the Apache License" in text
    assert "Copyright 2026 The pdspec authors" in text and "[yyyy]" not in text
    assert len(text.split()) > 1500  # the whole text, not a summary
