"""The alert rules and Prometheus config pass promtool, the rules' unit tests pass (and
fail on the old error rule), and a real Prometheus server scrapes two running nodes on
loopback: both targets up, request counts as sent, every dashboard query and alert rule
evaluates, and the dashboard's legends name labels its queries return."""

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml

from tests.nodes.conftest import cluster

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ALERTS = DEPLOY / "alerts.yml"
ALERT_TESTS = Path(__file__).with_name("alerts_test.yml")
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "pdspec.json"


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} not found: CI must check the Prometheus files (.ci/run installs Debian's prometheus)")
        # Outside CI only (CI fails above): a developer machine without Debian's prometheus package.
        pytest.skip(f"{name} is not installed on this machine (apt-get install prometheus)")
    return path


def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, timeout=60)


def test_promtool_checks_the_alert_rules():
    result = run(tool("promtool"), "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_promtool_checks_the_prometheus_config(tmp_path):
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    # compose mounts alerts.yml at /etc/prometheus/alerts.yml; point the copy at the repository file
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    config["rule_files"] = [str(ALERTS)]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = run(tool("promtool"), "check", "config", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout and f"{ALERTS}" in result.stdout


def alert_unit_tests() -> dict:
    return yaml.safe_load(ALERT_TESTS.read_text())


def test_alert_unit_tests_pass_and_cover_every_alert():
    result = run(tool("promtool"), "test", "rules", str(ALERT_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    alerts = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
    tested = alert_unit_tests()["tests"]
    fired = {t["alertname"] for case in tested for t in case["alert_rule_test"] if t["exp_alerts"]}
    silent = {t["alertname"] for case in tested for t in case["alert_rule_test"] if not t["exp_alerts"]}
    assert fired == alerts, alerts - fired  # every alert is shown to fire...
    assert {"PdspecServerFaults", "PdspecAcceptanceRateLow"} <= silent  # ...and these shown not to
    assert (ROOT / alert_unit_tests()["rule_files"][0].replace("../../", "")).resolve() == ALERTS.resolve()


@pytest.mark.parametrize(
    "old_expr",
    [
        # the rule this replaced: any non-OK code, so client cancels and deadlines paged someone
        'sum by (node) (rate(pdspec_requests_total{code!="OK"}[5m])) > 0.1',
        # faults over faults: no ratio at all
        'sum by (node) (rate(pdspec_requests_total{code=~"INTERNAL|UNKNOWN|UNAVAILABLE"}[5m])) > 0',
    ],
)
def test_alert_unit_tests_reject_a_wrong_fault_rule(tmp_path, old_expr):
    """The unit tests can fail: with a wrong server-fault expression they do."""
    rules = yaml.safe_load(ALERTS.read_text())
    for rule in rules["groups"][0]["rules"]:
        if rule["alert"] == "PdspecServerFaults":
            rule["expr"] = old_expr
    (tmp_path / "deploy").mkdir()
    (tmp_path / "deploy" / "alerts.yml").write_text(yaml.safe_dump(rules))
    tests_dir = tmp_path / "tests" / "deploy"
    tests_dir.mkdir(parents=True)
    shutil.copy(ALERT_TESTS, tests_dir / "alerts_test.yml")
    result = run(tool("promtool"), "test", "rules", str(tests_dir / "alerts_test.yml"))
    assert result.returncode != 0, result.stdout
    assert "PdspecServerFaults" in result.stdout + result.stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    def __init__(self, base: str) -> None:
        self.base = base

    def api(self, path: str, **params) -> dict:
        url = f"{self.base}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def wait(self, predicate, what: str, timeout: float = 15.0):
        end = time.monotonic() + timeout
        last = None
        while time.monotonic() < end:
            try:
                last = predicate()
                if last:
                    return last
            except OSError as err:  # not listening yet
                last = err
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}: {last}")


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(panel title, expr, legend) with the template variables as Grafana expands them."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$job", ".*").replace("$instance", ".*")
            out.append((panel["title"], expr.replace("$__rate_interval", "10s"), target["legendFormat"]))
    return out


def test_real_prometheus_scrapes_the_nodes(pair, tmp_path):
    prometheus = tool("prometheus")
    with cluster(pair) as (client, prefill, decode):
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {"job_name": "pdspec-prefill", "static_configs": [{"targets": [f"127.0.0.1:{prefill.metrics_port}"]}]},
                {"job_name": "pdspec-decode", "static_configs": [{"targets": [f"127.0.0.1:{decode.metrics_port}"]}]},
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        log = (tmp_path / "prometheus.log").open("w")
        process = subprocess.Popen(
            [
                prometheus,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--web.console.templates={tmp_path}",
                f"--web.console.libraries={tmp_path}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            server = PrometheusServer(f"http://127.0.0.1:{port}")

            def both_up():
                targets = server.api("targets", state="active")["activeTargets"]
                health = {t["labels"]["job"]: t["health"] for t in targets}
                return health if health == {"pdspec-prefill": "up", "pdspec-decode": "up"} else None

            server.wait(both_up, "both targets up")

            sent = 3
            for seed in range(sent):
                client.generate("import ", seed=seed, max_new_tokens=8, greedy=seed == 0)
            with pytest.raises(grpc.RpcError) as err:
                client.generate("x", temperature=-1.0)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT

            def counts():
                rows = server.query('pdspec_requests_total{code=~"OK|INVALID_ARGUMENT"}')
                got = {(r["metric"]["job"], r["metric"]["node"], r["metric"]["code"]): r["value"][1] for r in rows}
                want = {
                    ("pdspec-prefill", "prefill", "OK"): str(sent),
                    ("pdspec-decode", "decode", "OK"): str(sent),
                    ("pdspec-prefill", "prefill", "INVALID_ARGUMENT"): "1",
                    ("pdspec-decode", "decode", "INVALID_ARGUMENT"): "0",  # prefill rejected it, decode never saw it
                }
                return got if got == want else None

            server.wait(counts, "request counts scraped")
            # all ten codes of each node are exported from the start (0 until one happens)
            codes = {(r["metric"]["node"], r["metric"]["code"]) for r in server.query("pdspec_requests_total")}
            assert len(codes) == 20, codes
            tokens = server.query('pdspec_generated_tokens_total{node="prefill"}')
            assert float(tokens[0]["value"][1]) == 8 * sent

            # a few more scrapes, so rates over 10s have samples before and after the requests
            time.sleep(2.5)
            for title, expr, legend in dashboard_queries():
                result = server.query(expr)  # raises on a PromQL error
                wanted = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
                for row in result:
                    assert wanted <= set(row["metric"]), (title, legend, row["metric"])
            per_position = next(e for t, e, _ in dashboard_queries() if "per draft position" in t)
            series = {(r["metric"]["position"], r["metric"]["do_sample"]) for r in server.query(per_position)}
            k = 8  # --max-speculative-tokens default: positions 0..7 for both do_sample values
            assert series == {(str(p), d) for p in range(k) for d in ("false", "true")}

            def rules_evaluated():
                rules = [r for g in server.api("rules", type="alert")["groups"] for r in g["rules"]]
                done = all(r["health"] == "ok" and not r["lastEvaluation"].startswith("0001") for r in rules)
                return rules if rules and done else None

            rules = server.wait(rules_evaluated, "alert rules evaluated")
            expected = {r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]}
            assert {r["name"] for r in rules} == expected
            state = {r["name"]: r["state"] for r in rules}
            # all requests OK or a client's mistake: no fault, no rejection at decode, both targets up
            for name in ("PdspecServerFaults", "PdspecValidationRejections", "PdspecTargetDown"):
                assert state[name] == "inactive", state
            # acceptance depends on the model pair: the alert is pending exactly for the do_sample values
            # whose ratio over the last 5m (as the rule computes it) is below 0.2
            acceptance = next(r for r in rules if r["name"] == "PdspecAcceptanceRateLow")
            low = {r["metric"]["do_sample"] for r in server.query(acceptance["query"])}
            pending = {a["labels"]["do_sample"] for a in acceptance["alerts"]}
            print("acceptance alert pending for do_sample in", sorted(pending))
            assert pending == low
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            log.close()
    assert process.returncode is not None
