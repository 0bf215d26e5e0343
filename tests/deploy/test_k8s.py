"""The Kubernetes manifests (deploy/k8s, kustomize layout) render, validate against the
Kubernetes schemas, and agree with the code: env names are real flags of the node CLIs and
configure the ports the probes, Services and ServiceMonitors use; the headless decode Service
selects the decode pods prefill's dns:/// address names; the GPU overlay asks for a GPU; the
PrometheusRule carries deploy/alerts.yml.

`render` is a small kustomize: resources (files and directories), namespace, and patches
(strategic merge, by path). A kustomization using anything else fails the test; where
kustomize or kubectl is installed its `build` output is compared with `render`."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from decode_node.__main__ import parse_args as decode_args
from prefill_node.__main__ import parse_args as prefill_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
KUSTOMIZATIONS = ["base", "overlays/gpu", "monitoring"]
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]  # grpc probes are GA since 1.27
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}
CRDS = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
# strategic-merge keys of the lists the renderer merges (k8s.io/api patchMergeKey); other lists are replaced
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name"}
PARSERS = {"decode": decode_args, "prefill": prefill_args}


def strategic_merge(base: dict, patch: dict) -> None:
    for key, value in patch.items():
        assert not key.startswith("$"), f"patch directive {key} is not implemented by the test renderer"
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            strategic_merge(base[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(base.get(key), list):
            merge_key = MERGE_KEYS[key]
            new = []
            for item in value:
                match = next((b for b in base[key] if b[merge_key] == item[merge_key]), None)
                if match is None:
                    new.append(copy.deepcopy(item))
                else:
                    strategic_merge(match, item)
            base[key][:0] = new  # kustomize (kyaml) puts the patch's new items first
        else:
            base[key] = copy.deepcopy(value)


def render(directory: Path) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - {"apiVersion", "kind", "namespace", "resources", "patches"}
    assert not unsupported, f"{directory}: the test renderer does not implement {unsupported}"
    assert kustomization["kind"] == "Kustomization"
    docs: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        docs += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, f"{directory}: only strategic-merge patches by path are implemented"
        body = yaml.safe_load((directory / patch["path"]).read_text())
        targets = [
            d
            for d in docs
            if (d["apiVersion"], d["kind"], d["metadata"]["name"])
            == (body["apiVersion"], body["kind"], body["metadata"]["name"])
        ]
        assert len(targets) == 1, f"{patch['path']} matches {len(targets)} resources"
        strategic_merge(targets[0], body)
    if "namespace" in kustomization:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = kustomization["namespace"]
    return docs


def by_key(docs: list[dict]) -> dict:
    keyed = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs}
    assert len(keyed) == len(docs), "duplicate resources"
    return keyed


def find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(docs: list[dict], role: str) -> dict:
    (c,) = find(docs, "Deployment", f"pdspec-{role}")["spec"]["template"]["spec"]["containers"]
    return c


def port(c: dict, name: str) -> int:
    (p,) = [p["containerPort"] for p in c["ports"] if p["name"] == name]
    return p


def environment(docs: list[dict], c: dict) -> dict[str, str]:
    """The container's environment as the kubelet builds it: envFrom first, env overrides."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        env.update(find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for item in c.get("env", []):
        assert "value" in item, f"{item['name']}: only literal values are checked"
        env[item["name"]] = item["value"]
    return env


def flag_env_names(role: str, capsys) -> set[str]:
    """The PDSPEC_* names the node's parser reads (its --help lists `[env NAME]` per flag)."""
    with pytest.raises(SystemExit):
        PARSERS[role](["--help"])
    names = set(re.findall(r"\[env\s+(PDSPEC_\w+)\]", capsys.readouterr().out))
    assert f"PDSPEC_{role.upper()}_PORT" in names
    return names


SECRET_FILES = ("_PEER_TOKEN_FILE", "_API_KEY_FILE")  # files the pods read from mounted Secrets


def node_config(env: dict[str, str], role: str, monkeypatch, tmp_path_factory=None):
    """The node's config from `env`; a Secret file it names is stood in for by a temporary
    file with a valid secret (the cluster creates the Secrets: README.md)."""
    with monkeypatch.context() as m:
        for name, value in env.items():
            if name.endswith(SECRET_FILES):
                assert tmp_path_factory is not None, name
                stand_in = tmp_path_factory.mktemp("secret") / Path(value).name
                stand_in.write_text("0123456789abcdef" * 4 + "\n")
                value = str(stand_in)
            m.setenv(name, value)
        return PARSERS[role]([])


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(K8S / name) for name in KUSTOMIZATIONS}


def test_renderer_merges_like_kustomize():
    base = {"spec": {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "image": "i"}], "t": [1, 2]}}
    strategic_merge(
        base,
        {
            "spec": {
                "containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}, {"name": "Z", "value": "3"}]}],
                "t": [3],
            }
        },
    )
    assert base == {
        "spec": {
            "containers": [
                {
                    "name": "a",
                    "env": [{"name": "Y", "value": "2"}, {"name": "Z", "value": "3"}, {"name": "X", "value": "1"}],
                    "image": "i",
                }
            ],
            "t": [3],
        }
    }
    strategic_merge(base, {"spec": {"containers": [{"name": "b", "image": "j"}]}})
    assert [c["name"] for c in base["spec"]["containers"]] == ["b", "a"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_manifests_validate_against_the_kubernetes_schemas(rendered, name, version):
    docs = rendered[name]
    assert docs
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue  # not in kubernetes-validate's schemas: test_monitoring_objects checks them
        kubernetes_validate.validate(doc, version, strict=True)
        if doc["kind"] not in CLUSTER_SCOPED:
            assert doc["metadata"]["namespace"] == "pdspec", doc["metadata"]["name"]


def test_a_broken_manifest_fails_validation(rendered):
    """The schema check can fail: an unknown field and a wrong type are caught."""
    deployment = copy.deepcopy(find(rendered["base"], "Deployment", "pdspec-decode"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)
    deployment = copy.deepcopy(find(rendered["base"], "Deployment", "pdspec-decode"))
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("name", ["base", "overlays/gpu"])
def test_env_names_are_real_flags_and_configure_the_ports(rendered, name, capsys, monkeypatch, tmp_path_factory):
    docs = rendered[name]
    for role in ("decode", "prefill"):
        c = container(docs, role)
        assert c["args"] == [f"{role}_node"]
        env = environment(docs, c)
        names = {n for n in env if n.startswith("PDSPEC_")}
        assert names == set(env), set(env) - names
        assert names <= flag_env_names(role, capsys), names - flag_env_names(role, capsys)
        config = node_config(env, role, monkeypatch, tmp_path_factory)  # parses: types and choices are valid
        assert config.host == "0.0.0.0"
        assert config.port == port(c, "grpc") == {"decode": 50052, "prefill": 50051}[role]
        assert config.metrics_port == port(c, "metrics") == PARSERS[role]([]).metrics_port
        pod = find(docs, "Deployment", f"pdspec-{role}")["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= config.grace_s + 10
        assert config.engine.spec.max_speculative_tokens == int(env[f"PDSPEC_{role.upper()}_MAX_SPECULATIVE_TOKENS"])
        assert config.engine.spec.method == "prompt-lookup"  # the fastest exact default (BENCHMARKS.md)
        if role == "prefill":
            assert port(c, "http") == 8000
            namespace = find(docs, "Deployment", "pdspec-decode")["metadata"]["namespace"]
            decode_service = find(docs, "Service", "pdspec-decode")
            (grpc_port,) = [p["port"] for p in decode_service["spec"]["ports"] if p["name"] == "grpc"]
            assert config.decode_addr == f"dns:///pdspec-decode.{namespace}.svc.cluster.local:{grpc_port}"
            assert grpc_port == port(container(docs, "decode"), "grpc")
    decode = node_config(environment(docs, container(docs, "decode")), "decode", monkeypatch, tmp_path_factory)
    assert decode.engine.device == ("cuda" if name == "overlays/gpu" else "cpu")


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_headless_decode_service_selects_the_decode_pods(rendered):
    docs = rendered["base"]
    service = find(docs, "Service", "pdspec-decode")
    assert service["spec"]["clusterIP"] == "None"  # DNS answers with every ready pod: round_robin
    pods = {role: find(docs, "Deployment", f"pdspec-{role}")["spec"]["template"] for role in ("decode", "prefill")}
    assert selects(service["spec"]["selector"], pods["decode"]["metadata"]["labels"])
    assert not selects(service["spec"]["selector"], pods["prefill"]["metadata"]["labels"])
    for role, pod in pods.items():
        deployment = find(docs, "Deployment", f"pdspec-{role}")
        assert deployment["spec"]["selector"]["matchLabels"] == pod["metadata"]["labels"]
    prefill_service = find(docs, "Service", "pdspec-prefill")
    assert prefill_service["spec"].get("clusterIP") != "None"
    assert selects(prefill_service["spec"]["selector"], pods["prefill"]["metadata"]["labels"])
    assert not selects(prefill_service["spec"]["selector"], pods["decode"]["metadata"]["labels"])
    for role, svc in (("decode", service), ("prefill", prefill_service)):
        c = container(docs, role)
        for p in svc["spec"]["ports"]:
            assert port(c, p["targetPort"]) == p["port"], (role, p)  # named target ports exist
    assert {p["name"] for p in prefill_service["spec"]["ports"]} == {"grpc", "http", "metrics"}


def mounted_secret(docs: list[dict], role: str, path: str) -> tuple[str, str]:
    """The Secret whose volume is mounted (read-only) where `path` lies in the role's container."""
    pod = find(docs, "Deployment", f"pdspec-{role}")["spec"]["template"]["spec"]
    c = container(docs, role)
    (mount,) = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["defaultMode"] & 0o077 in (0o040, 0), oct(volume["secret"]["defaultMode"])  # no other
    return volume["secret"]["secretName"], Path(path).relative_to(mount["mountPath"]).as_posix()


@pytest.mark.parametrize("name", ["base", "overlays/gpu"])
def test_both_nodes_read_one_peer_token_and_the_api_key_from_secrets(rendered, name):
    docs = rendered[name]
    secrets = {}
    for role in ("decode", "prefill"):
        env = environment(docs, container(docs, role))
        secrets[role] = mounted_secret(docs, role, env[f"PDSPEC_{role.upper()}_PEER_TOKEN_FILE"])
        assert f"PDSPEC_{role.upper()}_API_KEY" not in env  # a key, if any, comes from a file
    assert secrets["decode"] == secrets["prefill"] == ("pdspec-peer-token", "token")
    prefill = environment(docs, container(docs, "prefill"))
    assert mounted_secret(docs, "prefill", prefill["PDSPEC_PREFILL_API_KEY_FILE"]) == ("pdspec-api-key", "api-key")
    assert not any(d["kind"] == "Secret" for d in docs)  # created in the cluster, never in the repository
    readme = (K8S / "README.md").read_text()
    assert "create secret generic pdspec-peer-token --from-file=token=" in readme
    assert "create secret generic pdspec-api-key --from-file=api-key=" in readme


def test_network_policy_lets_only_prefill_reach_decode_grpc(rendered):
    docs = rendered["base"]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = {role: find(docs, "Deployment", f"pdspec-{role}")["spec"]["template"] for role in ("decode", "prefill")}
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    assert selects(spec["podSelector"]["matchLabels"], pods["decode"]["metadata"]["labels"])
    assert not selects(spec["podSelector"]["matchLabels"], pods["prefill"]["metadata"]["labels"])
    decode = container(docs, "decode")
    allowed = {}  # port name -> who may connect (None: anyone)
    for rule in spec["ingress"]:
        for p in rule["ports"]:
            assert p["protocol"] == "TCP" and isinstance(p["port"], str)
            port(decode, p["port"])  # a named port of the decode container
            allowed[p["port"]] = rule.get("from")
    assert set(allowed) == {"grpc", "metrics"} and allowed["metrics"] is None
    (source,) = allowed["grpc"]
    assert set(source) == {"podSelector"}  # this namespace's pods, no other namespace
    labels = source["podSelector"]["matchLabels"]
    assert selects(labels, pods["prefill"]["metadata"]["labels"])
    assert not selects(labels, pods["decode"]["metadata"]["labels"])


def test_probes_target_the_grpc_ports(rendered):
    docs = rendered["base"]
    decode = container(docs, "decode")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert decode[probe]["grpc"] == {"port": port(decode, "grpc")}, probe  # grpc.health.v1, service ""
    prefill = container(docs, "prefill")
    assert prefill["readinessProbe"]["grpc"] == {"port": port(prefill, "grpc")}
    # prefill's health follows its decode peer: liveness must not restart it when decode is away
    assert prefill["livenessProbe"] == {**prefill["livenessProbe"], "tcpSocket": {"port": port(prefill, "grpc")}}
    assert "grpc" not in prefill["livenessProbe"]
    assert prefill["startupProbe"]["tcpSocket"] == {"port": port(prefill, "grpc")}


def test_pods_run_as_the_image_user_with_resource_requests(rendered):
    uid = int(re.search(r"useradd .*--uid (\d+) pdspec", (DEPLOY / "Dockerfile").read_text()).group(1))
    for name in ("base", "overlays/gpu"):
        for role in ("decode", "prefill"):
            pod = find(rendered[name], "Deployment", f"pdspec-{role}")["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["runAsUser"] == uid
            c = container(rendered[name], role)
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), (name, role)


def test_gpu_overlay_gives_decode_a_gpu_and_the_cuda_image(rendered):
    base, gpu = by_key(rendered["base"]), by_key(rendered["overlays/gpu"])
    assert set(base) == set(gpu)
    changed = {key for key in base if base[key] != gpu[key]}
    assert changed == {("Deployment", "pdspec", "pdspec-decode")}
    decode = container(rendered["overlays/gpu"], "decode")
    assert decode["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert decode["resources"]["requests"] == container(rendered["base"], "decode")["resources"]["requests"]
    assert decode["image"] == "pdspec:cuda"
    pod = gpu[("Deployment", "pdspec", "pdspec-decode")]["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert "nvidia.com/gpu" not in container(rendered["overlays/gpu"], "prefill")["resources"].get("limits", {})
    assert "nvidia.com/gpu" not in str(rendered["base"])
    # the images the manifests name are the ones the Dockerfiles say they build
    assert "-t pdspec:cuda ." in (DEPLOY / "Dockerfile.cuda").read_text()
    assert "-t pdspec:cpu ." in (DEPLOY / "Dockerfile").read_text()
    assert container(rendered["overlays/gpu"], "prefill")["image"] == container(rendered["base"], "decode")["image"]
    assert container(rendered["base"], "decode")["image"] == "pdspec:cpu"


def test_monitoring_objects(rendered):
    docs = rendered["monitoring"]
    base = rendered["base"]
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"pdspec-prefill", "pdspec-decode"}
    scrape_jobs = {j["job_name"] for j in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]}
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(monitor["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
        selector = monitor["spec"]["selector"]
        assert set(selector) == {"matchLabels"}
        services = [
            s for s in base if s["kind"] == "Service" and selects(selector["matchLabels"], s["metadata"]["labels"])
        ]
        assert len(services) == 1, monitor["metadata"]["name"]
        (service,) = services
        # the job label is the Service name: the same job names as deploy/prometheus.yml
        assert "jobLabel" not in monitor["spec"] and service["metadata"]["name"] in scrape_jobs
        assert service["metadata"]["namespace"] == monitor["metadata"]["namespace"]
        assert monitor["spec"]["endpoints"]
        for endpoint in monitor["spec"]["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
            assert re.fullmatch(r"\d+[smh]", endpoint["interval"]) and endpoint["path"] == "/metrics"
            (p,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
            role = service["metadata"]["labels"]["app.kubernetes.io/component"]
            assert p["port"] == port(container(base, role), "metrics") == PARSERS[role]([]).metrics_port
    (rule,) = [d for d in docs if d["kind"] == "PrometheusRule"]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert group["name"] and group["rules"]
        for r in group["rules"]:
            assert set(r) <= {"alert", "record", "expr", "for", "labels", "annotations"} and r["expr"]
            assert ("alert" in r) != ("record" in r)


def prometheus_rule_text() -> str:
    """deploy/k8s/monitoring/prometheusrule.yaml: deploy/alerts.yml's groups under spec."""
    alerts = (DEPLOY / "alerts.yml").read_text()
    groups = alerts[alerts.index("\ngroups:") + 1 :]
    return (
        "# Generated from deploy/alerts.yml (the same groups; tests/deploy/test_k8s.py checks they agree).\n"
        "# Regenerate: python -m tests.deploy.test_k8s --write-prometheusrule\n"
        "apiVersion: monitoring.coreos.com/v1\n"
        "kind: PrometheusRule\n"
        "metadata:\n"
        "  name: pdspec\n"
        "  labels:\n"
        "    app.kubernetes.io/name: pdspec\n"
        "spec:\n" + "".join(f"  {line}" if line.strip() else line for line in groups.splitlines(keepends=True))
    )


def test_prometheusrule_carries_the_alert_rules():
    path = K8S / "monitoring" / "prometheusrule.yaml"
    rule = yaml.safe_load(path.read_text())
    alerts = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    hint = "regenerate: python -m tests.deploy.test_k8s --write-prometheusrule"
    assert rule["spec"] == alerts, hint
    assert path.read_text() == prometheus_rule_text(), hint
    assert yaml.safe_load(prometheus_rule_text())["spec"] == alerts


def kustomize_build(directory: Path) -> list[dict] | None:
    if shutil.which("kustomize"):
        command = ["kustomize", "build", str(directory)]
    elif shutil.which("kubectl"):
        command = ["kubectl", "kustomize", str(directory)]
    else:
        return None
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_real_kustomize_builds_what_the_renderer_renders(rendered, name):
    built = kustomize_build(K8S / name)
    if built is None:
        # Optional: neither kustomize nor kubectl is on PATH (CI installs neither); the renderer
        # above is then the only build, and it refuses kustomization features it does not implement.
        pytest.skip("kustomize/kubectl not installed")
    assert by_key(built) == by_key(rendered[name])


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-prometheusrule"]:
        (K8S / "monitoring" / "prometheusrule.yaml").write_text(prometheus_rule_text())
    else:
        sys.exit("usage: python -m tests.deploy.test_k8s --write-prometheusrule")
