"""`vinoserve serve --replicas 2`: two engine processes of the built-in model, each on one core,
behind SGLang's router, over real HTTP on loopback, driven by the openai client."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from gguf_fixtures import tiny_hf_model, write_gguf
from server_process import ServerProcess
from vinoserve.bench.workloads import stdlib_english

pytestmark = pytest.mark.slow
KEY = "replica-test-key"
BLOCK = 32  # the KV block size: a prompt's last partial block is never cached


def _descendants(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # it exited while we looked
            pass
    return kids + [d for k in kids for d in _descendants(k)]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _replicas(srv: ServerProcess) -> list[int]:
    return [p for p in _descendants(srv.proc.pid) if "vinoserve.cli" in _cmdline(p)]


def _healthy(srv: ServerProcess) -> int | None:
    try:
        return httpx.get(f"{srv.url}/readiness", timeout=2).json().get("healthy_workers")
    except (httpx.HTTPError, ValueError):
        return None


def _wait_healthy(srv: ServerProcess, n: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while _healthy(srv) != n:
        assert time.monotonic() < deadline, f"the router never counted {n} healthy replicas"
        assert srv.proc.poll() is None, "the supervisor exited"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def replicas(smollm2_gguf):
    srv = ServerProcess("--replicas", "2", "--kv-cache-size", "0.2", "--api-key", KEY)
    _wait_healthy(srv, 2)
    yield srv
    srv.terminate()


@pytest.fixture(scope="module")
def client(replicas):
    return openai.OpenAI(base_url=f"{replicas.url}/v1", api_key=KEY, max_retries=0)


def _conversation(client: openai.OpenAI, opening: str, turns: int) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of each turn of one chat."""
    messages, usage = [{"role": "user", "content": opening}], []
    for t in range(turns):
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12,
                                           temperature=0)
        usage.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens))
        messages += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": f"Go on with point {t + 2}, briefly."}]
    return usage


def test_follow_ups_are_served_from_their_replicas_prefix_cache(client):
    """Conversations arrive together; the router sends each follow-up to the replica that holds
    the conversation, so its whole previous prompt (but a partial last block) is cached."""
    words = stdlib_english().split()
    openings = [f"Summarize this text, point by point: {' '.join(words[i * 150:(i + 1) * 150])}" for i in range(6)]
    with ThreadPoolExecutor(len(openings)) as pool:
        chats = list(pool.map(lambda o: _conversation(client, o, 3), openings))
    follow_ups = [(prev[0], cur[1]) for chat in chats for prev, cur in zip(chat, chat[1:])]
    hits = [cached >= previous - BLOCK for previous, cached in follow_ups]
    assert sum(hits) >= 0.9 * len(follow_ups), follow_ups


def test_the_router_is_no_way_around_the_api_key(replicas):
    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{replicas.url}/v1/chat/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{replicas.url}/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    # The router's worker API, which could point it at another server, takes only the supervisor's key.
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{replicas.url}/workers", headers=auth).status_code == 401
    r = httpx.post(f"{replicas.url}/workers", json={"url": "http://127.0.0.1:9"}, headers=auth)
    assert r.status_code == 401
    models = httpx.get(f"{replicas.url}/v1/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == ["smollm2-135m-instruct"]


def test_a_killed_replica_is_replaced_while_the_other_serves(replicas, client):
    before = _replicas(replicas)
    assert len(before) == 2
    os.kill(before[0], signal.SIGKILL)
    _wait_healthy(replicas, 1, timeout=10)  # the supervisor takes it out of the router at once
    for i in range(6):  # while its replacement loads, the other replica serves everything
        r = client.completions.create(model="smollm2-135m-instruct", prompt=f"Count to {i}:", max_tokens=4)
        assert r.usage.completion_tokens == 4
    assert _healthy(replicas) == 1, "the replacement came back too fast to test anything"
    deadline = time.monotonic() + 180
    while not (len(after := _replicas(replicas)) == 2 and before[0] not in after and _healthy(replicas) == 2):
        assert time.monotonic() < deadline, "the killed replica was not replaced"
        time.sleep(0.5)
    assert before[1] in after
    r = client.completions.create(model="smollm2-135m-instruct", prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_sigterm_stops_every_process_and_exits_0(replicas):
    tree = _descendants(replicas.proc.pid)
    assert len(tree) == 3  # two replicas and the router
    assert replicas.terminate() == 0
    alive = [p for p in tree if Path(f"/proc/{p}").exists()]
    assert not alive, [_cmdline(p) for p in alive]


def test_a_taken_port_stops_everything(smollm2_gguf):
    """Its port taken: one clear line, status 1, no replica started."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "vinoserve.cli", "serve", "--replicas", "2", "--port",
                                 str(port)], stderr=subprocess.PIPE, text=True)
        tree: set[int] = set()
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:  # every child it started
            tree.update(_descendants(proc.pid))
            time.sleep(0.05)
        _, err = proc.communicate(timeout=10)
    assert proc.returncode == 1
    assert f"cannot listen on http://127.0.0.1:{port}: [Errno 98] Address already in use" in err
    assert not [p for p in tree if Path(f"/proc/{p}").exists()]


def test_from_the_first_second_every_answer_is_a_503_with_retry_after_until_a_replica_serves(tmp_path):
    """Requests at once, from the moment the process starts: until the router counts a replica,
    /health and every API answer 503 with Retry-After in the API's own error shape (or the port is
    not listening yet); from then on, 200s. Never another 5xx."""
    gguf = write_gguf(tiny_hf_model("llama"), tmp_path / "tiny.gguf")
    srv = ServerProcess("--replicas", "2", "--model", str(gguf), "--kv-cache-size", "0.05",
                        log_path=tmp_path / "server.log")
    asks = [("GET", "/health", None), ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"model": "tiny", "prompt": "ab", "max_tokens": 2}),
            ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 2, "stream": True}),
            ("POST", "/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2})]
    seen: list[tuple[float, str, int | None, httpx.Response | None]] = []
    start = time.monotonic()

    def ask(method: str, path: str, body: dict | None) -> None:
        while time.monotonic() - start < 180 and sum(r not in (None, 503) for _, p, r, _ in seen if p == path) < 3:
            try:
                r = httpx.request(method, srv.url + path, json=body, timeout=30)
                seen.append((time.monotonic() - start, path, r.status_code, r))
            except httpx.TransportError:
                seen.append((time.monotonic() - start, path, None, None))
            time.sleep(0.02)

    try:
        with ThreadPoolExecutor(len(asks)) as pool:
            list(pool.map(lambda a: ask(*a), asks))
    finally:
        assert srv.terminate() == 0
    # SGLang's router (0.3) does not route Anthropic's /v1/messages: a 404 once it serves (docs/agent-apis.md).
    served = {p: [s for _, q, s, _ in seen if q == p and s not in (None, 503)] for _, p, _ in asks}
    assert served == {p: [404 if p == "/v1/messages" else 200] * 3 for p in served}, served
    loading = [(p, r) for _, p, status, r in seen if status == 503]
    assert {p for p, _ in loading} == {path for _, path, _ in asks}, "no request saw the replicas load"
    for path, r in loading:
        assert r.headers["retry-after"] == "5", (path, r.headers)
        error = r.json()["error"]
        assert error["type"] == ("overloaded_error" if path == "/v1/messages" else "service_unavailable_error"), error
    assert not [(p, s) for _, p, s, _ in seen if s is not None and s >= 500 and s != 503]
    ready = min(t for t, p, s, _ in seen if p == "/health" and s == 200)
    assert all(s in (200, 404) for t, p, s, _ in seen if t > ready + 0.1), "a 503 after /health said ready"
