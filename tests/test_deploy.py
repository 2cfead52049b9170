"""What deploy/ and docker-compose.yml promise about kvgate itself: the Grafana dashboard's PromQL names only metrics
(and labels) a live `kvgate serve` exports, the compose stack's Prometheus scrapes the kvgate service, and the image
gets every package the project has. (`make deploy-check` renders the Helm chart and validates the manifests and the
compose file with the real tools.)"""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import httpx
import yaml

from serve_helpers import free_port, serve

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "kvgate-dashboard.json"
METRIC = re.compile(r"\b((?:vllm|kvgate):[A-Za-z0-9_]+)")


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and template variable queries."""
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"])
    return exprs


def exported(metrics_text: str) -> dict[str, set[str]]:
    """Sample name -> the label names it is exported with."""
    out: dict[str, set[str]] = {}
    for line in metrics_text.splitlines():
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*?)\})? ", line)
        if m:
            out.setdefault(m.group(1), set()).update(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(2) or ""))
    return out


def test_the_dashboard_queries_only_metrics_and_labels_a_live_server_exports(tiny_llama: str, tmp_path: Path) -> None:
    port = free_port()
    with serve([tiny_llama, "--port", str(port), "--served-model-name", "tiny"], tmp_path / "serve.log", port) as (
            base, _):
        r = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        metrics = exported(httpx.get(f"{base}/metrics", timeout=10).text)
    queries = dashboard_queries()
    assert len(queries) >= 15
    named = set()
    for q in queries:
        names = METRIC.findall(q)
        assert names, f"a query that names no kvgate/vLLM metric: {q}"
        named.update(names)
        labels = set(re.findall(r"\b(?:by|without) \(([^)]*)\)", q))
        labels = {x.strip() for group in labels for x in group.split(",")} | set(re.findall(r"([a-z_]+)=~", q))
        for name in names:
            assert name in metrics, f"{name} (in {q}) is not in /metrics"
            missing = labels - metrics[name] - {"le"} if not name.endswith("_bucket") else labels - metrics[name]
            assert not missing, f"{name} has no label {missing} (in {q})"
    # the panels the dashboard is for: latency percentiles, load, KV cache, prefix cache, preemptions, tokens/s
    for must in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        assert must in named, must
    assert all(n.startswith("vllm:") for n in named)  # so that it works unchanged on a vLLM server


def test_compose_prometheus_scrapes_the_kvgate_service_grafana_gets_the_dashboard() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["kvgate:8000"]
    for name in ("kvgate", "kvgate-gpu"):  # either profile answers as "kvgate" on port 8000
        svc = compose["services"][name]
        assert "kvgate" in svc["networks"]["default"]["aliases"] and "8000" in svc["command"]
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.startswith("./deploy/grafana/kvgate-dashboard.json:") for m in mounts)
    assert DASHBOARD.exists()


def test_the_image_gets_every_package_of_the_project() -> None:
    """Each folder pyproject.toml maps a package to is copied into the image and not left out of the build
    context (a new top-level package would otherwise be missing from the image only)."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    roots = {d.split("/")[0] for d in dirs}
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    ignore = (ROOT / ".dockerignore").read_text().split()
    for root in roots:
        assert f"!{root}/" in ignore, root
        assert re.search(rf"^COPY {root} {root}$", dockerfile, re.M), root
