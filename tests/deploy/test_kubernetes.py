"""deploy/kubernetes/ manifests and the Helm chart deploy/helm/marsproxy: every object validates
against the Kubernetes OpenAPI schemas (kubernetes-validate, which bundles them: offline), the
sidecar/gateway shapes hold, and the marsproxy config in each ConfigMap passes load_config.
The chart is rendered by Helm's own engine (helm-python-sdk: Helm's Go SDK through ctypes, no
helm binary, no cluster) when that package is installed."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

from marsproxy.config import load_config

KUBE_VERSION = "1.30.0"
MANIFESTS = ("sidecar.yaml", "gateway.yaml", "redis.yaml")
CHART = "deploy/helm/marsproxy"


@pytest.fixture(scope="module")
def kv() -> Any:
    return pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed"
    )


def _validate(kv: Any, docs: list[dict[str, Any]]) -> None:
    for d in docs:
        if d.get("apiVersion", "").startswith("monitoring.coreos.com/"):
            continue  # a CRD: not in the core schemas (checked by shape below)
        kv.validate(d, KUBE_VERSION, strict=True)


def _load(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _config_of(cm: dict[str, Any], tmp_path: Path) -> Any:
    f = tmp_path / "marsproxy.yaml"
    f.write_text(cm["data"]["marsproxy.yaml"])
    return load_config(f, environ={})


def _by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _container(dep: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [
        c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == name
    ]
    assert len(found) == 1, name
    return found[0]


def _check_marsproxy_container(c: dict[str, Any]) -> None:
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert c["securityContext"]["runAsNonRoot"] is True
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["MARSPROXY_CONFIG"] == "/etc/marsproxy/marsproxy.yaml"
    assert all("TOKEN" not in e["name"] or "valueFrom" in e for e in c["env"])  # never inline
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert "/etc/marsproxy" in mounts


def _check_selects(svc: dict[str, Any], dep: dict[str, Any]) -> None:
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_negative_control(kv: Any) -> None:
    """The validator does reject a wrong manifest (so the passes below mean something)."""
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
           "spec": {"ports": [{"port": "eighty"}]}}
    with pytest.raises(Exception):  # noqa: B017 - the package's own error type
        kv.validate(bad, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifests_validate(kv: Any, repo: Path, name: str) -> None:
    docs = _load(repo / "deploy/kubernetes" / name)
    assert docs
    _validate(kv, docs)


@pytest.mark.parametrize("name", ["sidecar.yaml", "gateway.yaml"])
def test_manifest_admin_token_from_optional_secret(repo: Path, name: str) -> None:
    docs = _load(repo / "deploy/kubernetes" / name)
    dep = next(d for d in _by_kind(docs, "Deployment")
               if any(c["name"] == "marsproxy"
                      for c in d["spec"]["template"]["spec"]["containers"]))
    (ref,) = [e["valueFrom"]["secretKeyRef"] for e in _container(dep, "marsproxy")["env"]
              if e["name"] == "MARSPROXY_AUTH__ADMIN_TOKEN"]
    assert ref == {"name": "marsproxy-admin", "key": "admin-token", "optional": True}


def test_sidecar_pod(repo: Path, tmp_path: Path) -> None:
    docs = _load(repo / "deploy/kubernetes/sidecar.yaml")
    (cm,) = _by_kind(docs, "ConfigMap")
    (dep,) = _by_kind(docs, "Deployment")
    (svc,) = _by_kind(docs, "Service")
    cfg = _config_of(cm, tmp_path)
    assert [w.url for w in cfg.workers] == ["http://127.0.0.1:8000"]
    assert cfg.server.host == "0.0.0.0" and cfg.server.port == 8080
    assert cfg.policy == "mars"
    vllm = _container(dep, "vllm")
    assert "--scheduling-policy=priority" in vllm["args"]
    assert "--enable-prefix-caching" in vllm["args"]
    assert "--port=8000" in vllm["args"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"]
    _check_marsproxy_container(_container(dep, "marsproxy"))
    _check_selects(svc, dep)
    assert svc["spec"]["ports"][0]["port"] == 8080
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    assert vols["config"]["configMap"]["name"] == cm["metadata"]["name"]


def test_gateway_with_redis(repo: Path, tmp_path: Path) -> None:
    docs = _load(repo / "deploy/kubernetes/gateway.yaml")
    redis = _load(repo / "deploy/kubernetes/redis.yaml")
    (cm,) = _by_kind(docs, "ConfigMap")
    cfg = _config_of(cm, tmp_path)
    assert cfg.store.backend == "redis"
    (redis_svc,) = _by_kind(redis, "Service")
    assert cfg.store.redis_url == f"redis://{redis_svc['metadata']['name']}:6379/0"
    deps = {d["metadata"]["name"]: d for d in _by_kind(docs, "Deployment")}
    dep = deps["marsproxy-gateway"]
    assert dep["spec"]["replicas"] >= 2
    _check_marsproxy_container(_container(dep, "marsproxy"))
    (sts,) = _by_kind(docs, "StatefulSet")
    n = sts["spec"]["replicas"]
    assert [w.url for w in cfg.workers] == [f"http://vllm-{i}.vllm:8000" for i in range(n)]
    (redis_dep,) = _by_kind(redis, "Deployment")
    _check_selects(redis_svc, redis_dep)


# -- Helm chart ---------------------------------------------------------------------------------

def test_chart_files(repo: Path) -> None:
    chart = yaml.safe_load((repo / CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "marsproxy"
    values = yaml.safe_load((repo / CHART / "values.yaml").read_text())
    assert values["mode"] in ("sidecar", "gateway")
    for key in ("replicas", "redis", "serviceMonitor", "workers", "vllm", "config", "policy",
                "auth"):
        assert key in values, key


@pytest.fixture(scope="module")
def helm() -> Any:
    return pytest.importorskip(
        "helm_python", reason="helm-python-sdk is not installed (renders charts with Helm's SDK)"
    )


def _render(helm: Any, repo: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    chart = helm.Chart.load(str(repo / CHART))
    try:
        out = chart.render(values, name="rel", namespace="agents")
    finally:
        chart.close()
    docs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


GATEWAY = {
    "mode": "gateway",
    "replicas": 3,
    "workers": [{"url": "http://vllm-0.vllm:8000", "name": "vllm-0"},
                {"url": "http://vllm-1.vllm:8000", "name": "vllm-1"}],
    "serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
    "config": {"admission": {"window_init": 24, "window_max": 24}},
}


def test_helm_lint(helm: Any, repo: Path) -> None:
    for values in ({}, GATEWAY):
        report = helm.lint(str(repo / CHART), values, strict=True)
        errors = [m for m in report["messages"] if m["severity"] >= 2]
        assert not report["errors"] and not errors, report


def test_helm_sidecar_mode(helm: Any, kv: Any, repo: Path, tmp_path: Path) -> None:
    docs = _render(helm, repo, {"replicas": 2})
    _validate(kv, docs)
    assert sorted(d["kind"] for d in docs) == ["ConfigMap", "Deployment", "Service"]
    (cm,) = _by_kind(docs, "ConfigMap")
    cfg = _config_of(cm, tmp_path)
    assert [w.url for w in cfg.workers] == ["http://127.0.0.1:8000"]
    assert cfg.store.backend == "memory"
    assert cfg.policy == "mars" and cfg.scheduler.priority_policy == "session_fcfs"
    (dep,) = _by_kind(docs, "Deployment")
    assert dep["spec"]["replicas"] == 2
    # No admin token configured: no Secret, no token variable.
    env = {e["name"] for e in _container(dep, "marsproxy")["env"]}
    assert "MARSPROXY_AUTH__ADMIN_TOKEN" not in env
    vllm = _container(dep, "vllm")
    assert "--scheduling-policy=priority" in vllm["args"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == "1"
    _check_marsproxy_container(_container(dep, "marsproxy"))
    (svc,) = _by_kind(docs, "Service")
    _check_selects(svc, dep)


def test_helm_gateway_mode(helm: Any, kv: Any, repo: Path, tmp_path: Path) -> None:
    docs = _render(helm, repo, GATEWAY)
    _validate(kv, docs)
    (cm,) = _by_kind(docs, "ConfigMap")
    cfg = _config_of(cm, tmp_path)
    assert cfg.store.backend == "redis"
    assert cfg.store.redis_url == "redis://rel-marsproxy-redis:6379/0"
    assert cfg.admission.window_max == 24
    assert [w.name for w in cfg.workers] == ["vllm-0", "vllm-1"]
    deps = {d["metadata"]["name"]: d for d in _by_kind(docs, "Deployment")}
    assert set(deps) == {"rel-marsproxy", "rel-marsproxy-redis"}
    gw = deps["rel-marsproxy"]
    assert gw["spec"]["replicas"] == 3
    assert [c["name"] for c in gw["spec"]["template"]["spec"]["containers"]] == ["marsproxy"]
    _check_marsproxy_container(_container(gw, "marsproxy"))
    svcs = {s["metadata"]["name"]: s for s in _by_kind(docs, "Service")}
    _check_selects(svcs["rel-marsproxy"], gw)
    _check_selects(svcs["rel-marsproxy-redis"], deps["rel-marsproxy-redis"])
    (sm,) = _by_kind(docs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    svc_labels = svcs["rel-marsproxy"]["metadata"]["labels"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc_labels.items()
    assert sm["metadata"]["labels"]["release"] == "prom"


def test_helm_external_redis_and_errors(helm: Any, repo: Path, tmp_path: Path) -> None:
    docs = _render(helm, repo, {**GATEWAY, "redis": {"url": "redis://ext:6379/1"}})
    (cm,) = _by_kind(docs, "ConfigMap")
    assert _config_of(cm, tmp_path).store.redis_url == "redis://ext:6379/1"
    assert all("redis" not in d["metadata"]["name"] for d in docs)
    with pytest.raises(helm.HelmError, match="workers"):
        _render(helm, repo, {"mode": "gateway"})
    with pytest.raises(helm.HelmError, match="sidecar or gateway"):
        _render(helm, repo, {"mode": "bogus"})


def _token_ref(dep: dict[str, Any]) -> dict[str, Any] | None:
    for e in _container(dep, "marsproxy")["env"]:
        if e["name"] == "MARSPROXY_AUTH__ADMIN_TOKEN":
            ref: dict[str, Any] = e["valueFrom"]["secretKeyRef"]
            return ref
    return None


def test_helm_policy_and_admin_token(helm: Any, kv: Any, repo: Path, tmp_path: Path) -> None:
    """`policy` reaches the config; the admin token comes from a Secret (the chart's own from
    auth.adminToken, or auth.existingSecret), never from the ConfigMap."""
    docs = _render(helm, repo, {**GATEWAY, "policy": "fcfs",
                                "auth": {"adminToken": "s3cret-token"},
                                "config": {"auth": {"protect_metrics": True}}})
    _validate(kv, docs)
    (cm,) = _by_kind(docs, "ConfigMap")
    assert "s3cret-token" not in cm["data"]["marsproxy.yaml"]
    cfg = _config_of(cm, tmp_path)
    assert cfg.policy == "fcfs"
    assert cfg.admission.enabled is False  # the fcfs preset: a plain session-affine proxy
    assert cfg.scheduler.priority_policy == "off" and cfg.scheduler.retention_policy == "off"
    (secret,) = _by_kind(docs, "Secret")
    assert secret["metadata"]["name"] == "rel-marsproxy-auth"
    assert base64.b64decode(secret["data"]["admin-token"]) == b"s3cret-token"
    gw = next(d for d in _by_kind(docs, "Deployment") if d["metadata"]["name"] == "rel-marsproxy")
    assert _token_ref(gw) == {"name": "rel-marsproxy-auth", "key": "admin-token"}
    # The token reaches the config as the environment gives it.
    env_cfg = load_config(tmp_path / "marsproxy.yaml",
                          environ={"MARSPROXY_AUTH__ADMIN_TOKEN": "s3cret-token"})
    assert env_cfg.auth.admin_token.get_secret_value() == "s3cret-token"
    (sm,) = _by_kind(docs, "ServiceMonitor")  # protect_metrics: Prometheus sends the token
    assert sm["spec"]["endpoints"][0]["authorization"]["credentials"] == {
        "name": "rel-marsproxy-auth", "key": "admin-token"}

    docs = _render(helm, repo, {"auth": {"existingSecret": "ops-token", "adminToken": "ignored",
                                         "existingSecretKey": "token"}})
    _validate(kv, docs)
    assert not _by_kind(docs, "Secret")  # the existing one wins; the chart makes none
    (dep,) = _by_kind(docs, "Deployment")
    assert _token_ref(dep) == {"name": "ops-token", "key": "token"}


SENTINEL = {
    **GATEWAY,
    "redis": {
        "sentinel": {"hosts": ["redis-node-0.redis-headless:26379",
                               "redis-node-1.redis-headless:26379",
                               "redis-node-2.redis-headless:26379"], "service": "prod"},
        "username": "marsproxy", "existingSecret": "redis-auth",
        "sentinelPasswordKey": "sentinel-password",
        "tls": {"enabled": True, "existingSecret": "redis-tls", "clientCertificate": True},
    },
}


def _env_ref(dep: dict[str, Any], name: str) -> dict[str, Any] | None:
    for e in _container(dep, "marsproxy")["env"]:
        if e["name"] == name:
            ref: dict[str, Any] = e["valueFrom"]["secretKeyRef"]
            return ref
    return None


def test_helm_sentinel_tls_and_acl_user(helm: Any, kv: Any, repo: Path, tmp_path: Path) -> None:
    """Redis behind Sentinel, over TLS with client certificates, as an ACL user: the store config
    names the sentinels and the service, passwords come from a Secret through the environment
    (never the ConfigMap), the certificates from a mounted Secret; no Redis of the chart's."""
    report = helm.lint(str(repo / CHART), SENTINEL, strict=True)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2]
    docs = _render(helm, repo, SENTINEL)
    _validate(kv, docs)
    assert all("redis" not in d["metadata"]["name"] for d in docs)
    (cm,) = _by_kind(docs, "ConfigMap")
    store = _config_of(cm, tmp_path).store
    assert store.backend == "redis" and store.redis_url.startswith("rediss://")
    assert store.sentinels == tuple(SENTINEL["redis"]["sentinel"]["hosts"])  # type: ignore[index]
    assert store.sentinel_service == "prod" and store.username == "marsproxy"
    assert (store.password_env, store.sentinel_password_env) == (
        "REDIS_PASSWORD", "REDIS_SENTINEL_PASSWORD")
    (gw,) = _by_kind(docs, "Deployment")
    assert _env_ref(gw, "REDIS_PASSWORD") == {"name": "redis-auth", "key": "redis-password"}
    assert _env_ref(gw, "REDIS_SENTINEL_PASSWORD") == {"name": "redis-auth",
                                                       "key": "sentinel-password"}
    mounts = {m["name"]: m["mountPath"] for m in _container(gw, "marsproxy")["volumeMounts"]}
    vols = {v["name"]: v for v in gw["spec"]["template"]["spec"]["volumes"]}
    assert vols["redis-tls"]["secret"]["secretName"] == "redis-tls"
    for f in (store.tls.ca_file, store.tls.cert_file, store.tls.key_file):
        assert f is not None and str(Path(f).parent) == mounts["redis-tls"], (f, mounts)

    # Plain Sentinel: redis:// to the data nodes, no secrets, no certificates.
    plain = {**GATEWAY, "redis": {"sentinel": {"hosts": ["s:26379"]}}}
    docs = _render(helm, repo, plain)
    (cm,) = _by_kind(docs, "ConfigMap")
    store = _config_of(cm, tmp_path).store
    assert store.redis_url.startswith("redis://") and store.sentinels == ("s:26379",)
    assert store.sentinel_service == "mymaster" and store.password_env is None
    assert store.tls.ca_file is None
    with pytest.raises(helm.HelmError, match=r"redis\.tls\.existingSecret"):
        _render(helm, repo, {**GATEWAY, "redis": {"tls": {"enabled": True}}})
