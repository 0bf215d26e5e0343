"""The Grafana dashboard imports into any Grafana (a datasource variable, no fixed uid),
filters every query by $job and $instance, uses $__rate_interval, and gives each series a
legend from the labels its query keeps and a unit that fits what it measures."""

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = json.loads((GRAFANA / "dashboards" / "pdspec.json").read_text())
PANELS = DASHBOARD["panels"]
TARGETS = [(panel, target) for panel in PANELS for target in panel["targets"]]
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def variables() -> dict:
    return {v["name"]: v for v in DASHBOARD["templating"]["list"]}


def test_datasource_job_and_instance_variables():
    v = variables()
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"
    for name, query in (
        ("job", "label_values(pdspec_requests_total, job)"),
        ("instance", 'label_values(pdspec_requests_total{job=~"$job"}, instance)'),
    ):
        assert v[name]["type"] == "query" and v[name]["datasource"] == DATASOURCE
        assert v[name]["query"]["query"] == v[name]["definition"] == query
        assert v[name]["includeAll"] and v[name]["multi"] and v[name]["allValue"] == ".*"


def test_every_panel_and_query_uses_the_datasource_variable():
    assert "__inputs" not in DASHBOARD and '"uid": "prometheus"' not in json.dumps(DASHBOARD)
    for panel in PANELS:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]


def test_every_selector_filters_job_and_instance_and_rates_use_rate_interval():
    for panel, target in TARGETS:
        expr = target["expr"]
        selectors = re.findall(r"\b(pdspec_[a-z_]+)(\{[^}]*\})?", expr)
        assert selectors, expr
        for name, matchers in selectors:
            assert 'job=~"$job"' in matchers and 'instance=~"$instance"' in matchers, (panel["title"], name)
        ranges = re.findall(r"\[([^\]]+)\]", expr)
        assert all(r == "$__rate_interval" for r in ranges), (panel["title"], ranges)
        assert ("rate(" in expr) == bool(ranges), panel["title"]


def kept_labels(expr: str) -> set[str]:
    """Labels an aggregation keeps: the union of its `by (...)` clauses, less le."""
    return {label.strip() for clause in re.findall(r"\bby \(([^)]*)\)", expr) for label in clause.split(",")} - {"le"}


def test_legends_name_labels_the_query_keeps_and_tell_series_apart():
    for panel in PANELS:
        legends = [t["legendFormat"] for t in panel["targets"]]
        assert all(legends), panel["title"]
        assert len(set(legends)) == len(legends), panel["title"]  # p50 vs p99, running vs waiting
        for target in panel["targets"]:
            used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target["legendFormat"]))
            assert used == kept_labels(target["expr"]), (panel["title"], target["legendFormat"])
            if "histogram_quantile" in target["expr"]:
                q = float(re.match(r"histogram_quantile\(([\d.]+),", target["expr"]).group(1))
                assert target["legendFormat"].startswith(f"p{round(q * 100)} "), target["legendFormat"]


def test_acceptance_per_position_is_split_by_do_sample():
    panel = next(p for p in PANELS if "per draft position" in p["title"])
    (target,) = panel["targets"]
    assert target["legendFormat"] == "pos {{position}} do_sample={{do_sample}}"
    assert "sum by (do_sample, position) (rate(pdspec_spec_accepted_tokens_per_position_total" in target["expr"]
    # the denominator is the same do_sample's verify steps, matched on do_sample only
    assert "ignoring (position) group_left sum by (do_sample) (rate(pdspec_spec_verify_steps_total" in target["expr"]


def unit_for(expr: str) -> str | None:
    if "histogram_quantile" in expr and "_seconds_bucket" in expr:
        return "s"
    if "_bytes_total" in expr:
        return "Bps"
    if re.search(r"pdspec_(generated|prompt)_tokens_total", expr):
        return "suffix: tokens/s"
    if re.search(r"accepted_tokens\w*_total", expr) or ("pdspec_requests_total" in expr and " / " in expr):
        return "percentunit"
    return None


def test_units():
    seen = set()
    for panel, target in TARGETS:
        unit = panel["fieldConfig"]["defaults"]["unit"]
        want = unit_for(target["expr"])
        if want:
            assert unit == want, (panel["title"], unit)
            seen.add(unit)
        if "_requests_total" in target["expr"] and " / " not in target["expr"]:
            assert unit == "reqps", panel["title"]
    assert seen == {"s", "Bps", "suffix: tokens/s", "percentunit"}


def test_new_panels_are_there():
    exprs = " ".join(t["expr"] for _, t in TARGETS)
    for name in (
        "pdspec_running_requests",
        "pdspec_waiting_requests",
        "pdspec_time_to_first_token_seconds_bucket",
        "pdspec_inter_token_latency_seconds_bucket",
        "pdspec_queue_time_seconds_bucket",
        "pdspec_engine_step_seconds_bucket",
        "pdspec_prompt_tokens_total",
    ):
        assert name in exprs, name
    for metric in ("time_to_first_token", "inter_token_latency"):
        quantiles = {
            re.match(r"histogram_quantile\(([\d.]+),", t["expr"]).group(1)
            for _, t in TARGETS
            if f"pdspec_{metric}_seconds_bucket" in t["expr"]
        }
        assert quantiles == {"0.5", "0.99"}, metric
    titles = [p["title"] for p in PANELS]
    assert "Error ratio by code" in titles and len(set(titles)) == len(titles)
    ids = [p["id"] for p in PANELS]
    assert len(set(ids)) == len(ids)


def test_panels_do_not_overlap():
    cells = set()
    for panel in PANELS:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, panel["title"]
        cells |= mine


def test_compose_provisioning_serves_the_dashboard_with_its_datasource():
    datasources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]  # what ${datasource} picks by default
    assert source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "pdspec.yml").read_text())
    assert providers["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    volumes = compose["services"]["grafana"]["volumes"]
    assert "./grafana/dashboards:/var/lib/grafana/dashboards:ro" in volumes
    assert "./grafana/provisioning:/etc/grafana/provisioning:ro" in volumes
