"""deploy/kubernetes validates offline: core kinds against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields fail), InferencePool and HTTPRoute against their
CRDs' v1 schemas (deploy/kubernetes/crds). And the manifests agree with kvflow: every
`kvflow serve` flag in them is one kvflow's parser accepts, the probes hit /health on the
served port, the grace period outlasts --shutdown-timeout, the selectors find the pods."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvflow.server.args import add_serve_arguments

DEPLOY = Path(__file__).parents[2] / "deploy" / "kubernetes"
K8S_VERSION = "1.33.0"
CRDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.schema.json",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.schema.json",
}


def documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> list[dict]:
    return [d for _, d in documents() if d["kind"] == kind]


def closed(schema):
    """Reject unknown fields as `kubectl apply` does (strict field validation): an object with
    declared properties takes no others unless the schema says it preserves them."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) for k, v in schema.items()}
    if (
        "properties" in out
        and "additionalProperties" not in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def crd_validator(file: str) -> jsonschema.Draft7Validator:
    schema = json.loads((DEPLOY / "crds" / file).read_text())["openAPIV3Schema"]
    schema = closed(schema)
    schema["properties"]["metadata"] = {"type": "object"}  # ObjectMeta: checked by kinds below
    return jsonschema.Draft7Validator(schema)


def test_the_expected_objects_are_there():
    kinds = sorted(d["kind"] for _, d in documents())
    for kind in ("Deployment", "Service", "HorizontalPodAutoscaler", "InferencePool",
                 "HTTPRoute", "PersistentVolumeClaim"):  # fmt: skip
        assert kind in kinds, kinds


@pytest.mark.parametrize("name, doc", documents(), ids=lambda x: x if isinstance(x, str) else "")
def test_every_manifest_validates(name, doc):
    key = (doc["apiVersion"], doc["kind"])
    if key in CRDS:
        errors = sorted(crd_validator(CRDS[key]).iter_errors(doc), key=str)
        assert not errors, [f"{list(e.path)}: {e.message}" for e in errors]
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_crd_validation_catches_mistakes():
    pool = by_kind("InferencePool")[0]
    bad = {**pool, "spec": {**pool["spec"], "targetPort": 8000}}
    bad["spec"].pop("targetPorts")
    assert list(crd_validator(CRDS[("inference.networking.k8s.io/v1", "InferencePool")])
                .iter_errors(bad))  # fmt: skip
    with pytest.raises(kubernetes_validate.ValidationError):
        deployment = by_kind("Deployment")[0]
        kubernetes_validate.validate(
            {**deployment, "spec": {**deployment["spec"], "replica": 2}}, K8S_VERSION, strict=True
        )


def kvflow_containers() -> list[tuple[dict, dict]]:
    out = []
    for deployment in by_kind("Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            if container.get("command") == ["kvflow"]:
                out.append((deployment, container))
    return out


def serve_args(container: dict) -> argparse.Namespace:
    args = container["args"]
    assert args[0] == "serve"
    parser = add_serve_arguments(argparse.ArgumentParser(exit_on_error=False))
    return parser.parse_args(args[1:])  # an unknown flag or a bad value raises


def test_kvflow_flags_probes_and_grace_period_agree():
    assert kvflow_containers()
    for deployment, container in kvflow_containers():
        args = serve_args(container)
        pod = deployment["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] > args.shutdown_timeout + 5
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["http"] == args.port and args.host == "0.0.0.0"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = container[probe]["httpGet"]
            assert get["path"] == "/health" and get["port"] in ("http", args.port)
        events = args.kv_events_config
        assert events is not None and events.active
        assert events.endpoint.endswith(f":{ports['kv-events']}")
        assert events.replay_endpoint.endswith(f":{ports['kv-replay']}")
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env["KVFLOW_CACHE"] in mounts
        assert container["resources"]["requests"] and container["resources"]["limits"]


def test_selectors_find_the_kvflow_pods():
    (deployment, container), *_ = kvflow_containers()
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    port = serve_args(container).port
    for service in by_kind("Service"):
        if (
            service["metadata"]["name"].startswith("kvflow")
            and "router" not in service["metadata"]["name"]
        ):
            assert service["spec"]["selector"].items() <= labels.items()
    pool = by_kind("InferencePool")[0]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pool["spec"]["targetPorts"] == [{"number": port}]
    route = by_kind("HTTPRoute")[0]
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["kind"], backend["name"]) == ("InferencePool", pool["metadata"]["name"])
    hpa = by_kind("HorizontalPodAutoscaler")[0]
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    router = next(d for d in by_kind("Deployment") if d["metadata"]["name"] == "kvflow-router")
    rargs = router["spec"]["template"]["spec"]["containers"][0]["args"]
    key, value = rargs[rargs.index("--selector") + 1].split("=")
    assert labels[key] == value
    assert rargs[rargs.index("--service-discovery-port") + 1] == str(port)
