"""deploy/kubernetes and its two cache-aware variants, checked without a cluster: each
kustomization renders (kubectl kustomize), every built-in object validates against Kubernetes'
schemas, the router's arguments parse with the router's own parser, and the objects that no schema
here knows (InferencePool, HTTPRoute) point at what the variant deploys."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from sglang_router.launch_router import parse_router_args

K8S = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes"
KUBECTL = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
CRD_KINDS = {"InferencePool", "HTTPRoute"}


def _render(variant: str) -> dict[tuple[str, str], dict]:
    out = subprocess.run([KUBECTL, "kustomize", str(K8S / variant)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out.stdout)}


@pytest.mark.parametrize("variant", ["", "router", "inference-pool"])
def test_renders_and_validates(variant):
    objects = _render(variant)
    assert ("Deployment", "vinoserve") in objects
    for (kind, name), obj in objects.items():
        try:
            kubernetes_validate.validate(obj, "1.33", strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert kind in CRD_KINDS, f"{kind}/{name} has no schema"


def test_the_validator_rejects_a_broken_object():
    deployment = _render("")["Deployment", "vinoserve"]
    deployment["spec"]["template"]["spec"]["containers"][0]["port"] = 8000  # "ports" misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.33", strict=True)


def _pods(objects: dict) -> tuple[dict, int]:
    template = objects["Deployment", "vinoserve"]["spec"]["template"]
    return template["metadata"]["labels"], template["spec"]["containers"][0]["ports"][0]["containerPort"]


def _may(objects: dict, account: str, verb: str, resource: str) -> bool:
    roles = [b["roleRef"]["name"] for (k, _), b in objects.items()
             if k == "RoleBinding" and {"kind": "ServiceAccount", "name": account} in b["subjects"]]
    return any(resource in rule["resources"] and verb in rule["verbs"]
               for name in roles for rule in objects["Role", name]["rules"])


def test_the_router_finds_the_pods_by_label():
    objects = _render("router")
    labels, port = _pods(objects)
    pod = objects["Deployment", "vinoserve-router"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == ["python", "-m", "sglang_router.launch_router"]
    args = parse_router_args(container["args"])  # the router's own parser: flags and key format
    assert args.service_discovery and args.service_discovery_port == port
    assert args.selector.items() <= labels.items()
    assert args.control_plane_api_keys, "the router's worker API must not be open"
    assert all(_may(objects, pod["serviceAccountName"], verb, "pods") for verb in ("list", "watch"))
    service = objects["Service", "vinoserve-router"]["spec"]
    assert service["ports"][0]["targetPort"] == container["ports"][0]["name"]


def test_the_inference_pool_points_at_the_pods_and_the_picker():
    objects = _render("inference-pool")
    labels, port = _pods(objects)
    pool = objects["InferencePool", "vinoserve"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    assert labels["llm-d.ai/engine-type"] == "vllm"  # the picker then reads vLLM's metric names
    assert [p["number"] for p in spec["targetPorts"]] == [port]
    picker = objects["Service", spec["endpointPickerRef"]["name"]]["spec"]
    assert spec["endpointPickerRef"]["port"]["number"] in [p["port"] for p in picker["ports"]]
    (rule,) = objects["HTTPRoute", "vinoserve"]["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": "vinoserve"}]
    epp = objects["Deployment", "vinoserve-epp"]["spec"]["template"]["spec"]
    assert "--pool-name=vinoserve" in epp["containers"][0]["args"]
    assert all(_may(objects, epp["serviceAccountName"], "watch", r) for r in ("pods", "inferencepools"))
    config = yaml.safe_load(objects["ConfigMap", "vinoserve-epp"]["data"]["epp-config.yaml"])
    types = {p["type"] for p in config["plugins"]}
    assert "prefix-cache-scorer" in types
    assert {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]} <= types
