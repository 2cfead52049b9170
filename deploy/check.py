"""`make deploy-check`: the Helm chart and docker-compose.yml, checked with the real tools.

For the chart's default values, every examples/*.yaml and a few --set variants that switch on the gated objects:
`helm lint --strict`, `helm template`, then every core object validated with kubernetes-validate --strict against
Kubernetes' own schemas (an unknown field fails). kubernetes-validate has no schemas for the custom resources
(ServiceMonitor, KEDA ScaledObject, LeaderWorkerSet): their fields are checked against the strict schemas below,
written from their CRDs, and a LeaderWorkerSet's pod templates are validated as core v1 PodTemplates. kvgate's own
code then loads the gateway's rendered config.yaml and parses every container's arguments. The compose file is
checked with Docker Compose (`docker-compose config`) for each profile, and with deploy/compose.dify.yml.

Runs in kvgate's environment (.venv); the tools come from --tools (the Makefile's .venv-deploy/bin)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "kvgate"
K8S_VERSION = "1.31.0"
VARIANTS = {  # values that switch on what the default values and the examples leave off
    "hpa, pdbs, api key, service monitor": ["-f", "examples/values-gpu.yaml", "--set",
                                            "autoscaling.kind=hpa,apiKey.value=sk-test,apiKey.existingSecret=,"
                                            "gateway.replicas=2,"
                                            "gateway.podDisruptionBudget.enabled=true,"
                                            "metrics.serviceMonitor.enabled=true,"
                                            "engines[0].podDisruptionBudget.enabled=true"],
    "keda on multi-node TP x PP": ["-f", "examples/values-multinode.yaml", "--set",
                                   "autoscaling.enabled=true,autoscaling.kind=keda,"
                                   "autoscaling.keda.serverAddress=http://prometheus:9090,"
                                   "engines[0].pipelineParallelSize=2"],
    "model and cache volumes": ["--set", "modelStorage.type=hostPath,modelStorage.hostPath.path=/data/models,"
                                         "cache.type=pvc,cache.persistentVolumeClaim.existingClaim=kvgate-cache"],
}


def strict(props: dict, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


S, I, OBJ = {"type": "string"}, {"type": "integer"}, {"type": "object"}
STRINGS = {"type": "object", "additionalProperties": S}
TEMPLATE = strict({"metadata": OBJ, "spec": OBJ}, ("spec",))
CUSTOM = {
    "ServiceMonitor": strict({"apiVersion": S, "kind": S, "metadata": OBJ, "spec": strict({
        "namespaceSelector": strict({"matchNames": {"type": "array", "items": S}, "any": {"type": "boolean"}}),
        "selector": strict({"matchLabels": STRINGS, "matchExpressions": {"type": "array"}}),
        "endpoints": {"type": "array", "minItems": 1, "items": strict({
            "port": S, "path": S, "scheme": S, "interval": S, "scrapeTimeout": S, "relabelings": {"type": "array"},
            "metricRelabelings": {"type": "array"}})}}, ("selector", "endpoints"))}, ("spec",)),
    "ScaledObject": strict({"apiVersion": S, "kind": S, "metadata": OBJ, "spec": strict({
        "scaleTargetRef": strict({"apiVersion": S, "kind": S, "name": S, "envSourceContainerName": S}, ("name",)),
        "minReplicaCount": I, "maxReplicaCount": I, "pollingInterval": I, "cooldownPeriod": I,
        "advanced": strict({"horizontalPodAutoscalerConfig": strict({"name": S, "behavior": OBJ}),
                            "restoreToOriginalReplicaCount": {"type": "boolean"}}),
        "triggers": {"type": "array", "minItems": 1, "items": strict({
            "type": S, "name": S, "metadata": STRINGS, "authenticationRef": strict({"name": S, "kind": S}, ("name",)),
            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]}}, ("type", "metadata"))}},
        ("scaleTargetRef", "triggers"))}, ("spec",)),
    "LeaderWorkerSet": strict({"apiVersion": S, "kind": S, "metadata": OBJ, "spec": strict({
        "replicas": I, "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]}, "rolloutStrategy": OBJ,
        "networkConfig": OBJ, "leaderWorkerTemplate": strict({
            "size": {"type": "integer", "minimum": 1},
            "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None", "Default"]},
            "leaderTemplate": TEMPLATE, "workerTemplate": TEMPLATE}, ("workerTemplate",))},
        ("leaderWorkerTemplate",))}, ("spec",)),
}


class Check:
    def __init__(self, tools: Path) -> None:
        self.tools = tools
        self.failures: list[str] = []

    def fail(self, what: str, why: str) -> None:
        self.failures.append(f"{what}: {why}")
        print(f"  FAIL {what}: {why}")

    def run(self, *cmd: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, **kw)

    # ---- the chart -------------------------------------------------------------------------------------------------
    def chart(self, name: str, args: list[str]) -> None:
        print(f"chart: {name}")
        helm = str(self.tools / "helm")
        r = self.run(helm, "lint", "--strict", str(CHART), *args, cwd=CHART)
        if r.returncode:
            return self.fail(f"{name}: helm lint", r.stdout + r.stderr)
        r = self.run(helm, "template", "kvgate", str(CHART), *args, cwd=CHART)
        if r.returncode:
            return self.fail(f"{name}: helm template", r.stderr)
        docs = [d for d in yaml.safe_load_all(r.stdout) if d]
        print("  " + ", ".join(f"{d['kind']}/{d['metadata']['name']}" for d in docs))
        core = [d for d in docs if d["kind"] not in CUSTOM]
        for d in docs:
            if d["kind"] in CUSTOM:
                self.custom(name, d, core)
        self.validate(name, core)
        for d in docs:
            self.kvgate_side(name, d)

    def validate(self, name: str, docs: list[dict]) -> None:
        """kubernetes-validate --strict on every object (exit 0: all passed; a missing schema is only a warning, so
        no custom resource may reach it)."""
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            yaml.safe_dump_all(docs, f)
            f.flush()
            r = self.run(str(self.tools / "kubernetes-validate"), "-k", K8S_VERSION, "--strict", "--quiet", f.name)
        out = (r.stdout + r.stderr).strip()
        if r.returncode or "WARN" in out:
            self.fail(f"{name}: kubernetes-validate", out)
        else:
            print(f"  {len(docs)} objects valid against Kubernetes {K8S_VERSION} (strict)")

    def custom(self, name: str, doc: dict, core: list[dict]) -> None:
        what = f"{name}: {doc['kind']}/{doc['metadata']['name']}"
        try:
            jsonschema.validate(doc, CUSTOM[doc["kind"]])
        except jsonschema.ValidationError as e:
            return self.fail(what, f"{e.message} at {'.'.join(map(str, e.absolute_path))}")
        if doc["kind"] == "LeaderWorkerSet":  # its pod templates go through the core schema, as PodTemplates
            t = doc["spec"]["leaderWorkerTemplate"]
            for role in ("leaderTemplate", "workerTemplate"):
                if role in t:
                    core.append({"apiVersion": "v1", "kind": "PodTemplate", "template": t[role],
                                 "metadata": {"name": f"{doc['metadata']['name']}-{role.lower()}"}})

    def kvgate_side(self, name: str, doc: dict) -> None:
        """The gateway's config.yaml loads with kvgate's loader; every container's args parse with kvgate's CLI."""
        from kvgate.gateway.cli import build_parser
        from kvgate.gateway.config import load_config

        if doc["kind"] == "ConfigMap" and "config.yaml" in doc.get("data", {}):
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "config.yaml")
                Path(path).write_text(doc["data"]["config.yaml"])
                try:
                    cfg = load_config(path)
                except Exception as e:  # noqa: BLE001 - reported
                    return self.fail(f"{name}: the gateway's config.yaml", str(e))
            print(f"  config.yaml loads: models {[m.name for m in cfg.models]}, strategy {cfg.router.strategy}")
        pods = []
        if doc["kind"] == "Deployment":
            pods = [doc["spec"]["template"]["spec"]]
        elif doc["kind"] == "LeaderWorkerSet":
            t = doc["spec"]["leaderWorkerTemplate"]
            pods = [t[k]["spec"] for k in ("leaderTemplate", "workerTemplate") if k in t]
        for pod in pods:
            for c in pod["containers"]:
                try:
                    build_parser().parse_args(c["args"])
                except SystemExit:
                    self.fail(f"{name}: {doc['metadata']['name']} args", " ".join(c["args"]))

    # ---- compose ---------------------------------------------------------------------------------------------------
    def compose(self) -> None:
        compose = str(self.tools / "docker-compose")
        for profiles, files in (("cpu", ["docker-compose.yml"]), ("gpu", ["docker-compose.yml"]),
                                ("cpu", ["docker-compose.yml", "deploy/compose.dify.yml"])):
            what = f"compose: {' + '.join(files)}, profile {profiles}"
            args = [a for f in files for a in ("-f", f)]
            r = self.run(compose, *args, "config", cwd=ROOT, env=dict(os.environ, COMPOSE_PROFILES=profiles))
            if r.returncode:
                self.fail(what, r.stderr)
                continue
            services = yaml.safe_load(r.stdout)["services"]
            kvgate = services.get("kvgate" if profiles == "cpu" else "kvgate-gpu")
            if kvgate is None or {"prometheus", "grafana"} - set(services):
                self.fail(what, f"services {sorted(services)}")
            else:
                print(f"{what}: valid, services {sorted(services)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tools", type=Path, required=True, help="folder with helm, kubernetes-validate, docker-compose")
    tools = ap.parse_args().tools.resolve()
    check = Check(tools)
    print(check.run(str(tools / "helm"), "version", "--short").stdout.strip(),
          check.run(str(tools / "docker-compose"), "version", "--short").stdout.strip())
    check.chart("default values", [])
    for f in sorted((CHART / "examples").glob("*.yaml")):
        check.chart(f"examples/{f.name}", ["-f", f"examples/{f.name}"])
    for name, args in VARIANTS.items():
        check.chart(name, args)
    check.compose()
    if check.failures:
        print(f"deploy-check: {len(check.failures)} failures", file=sys.stderr)
        return 1
    print("deploy-check: the chart and the compose file are valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
