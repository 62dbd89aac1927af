"""A first run as a user meets it, against a real server on loopback (SmolLM2, an API key): the
model's sampling defaults, prompt tokens in /metrics while a request runs, the terminal chat
(over pipes, Ctrl-C as SIGINT) and the browser chat page (Debian's chromium, driven by playwright)."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pexpect
from pexpect.popen_spawn import PopenSpawn
import pytest

from server_process import ServerProcess
from test_server import metric

pytestmark = pytest.mark.slow
KEY = "test-key"
AUTH = {"authorization": f"Bearer {KEY}"}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# The built-in model's recommended values, with a reply cap small enough for a quick test.
DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "max_tokens": 48}
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    # Answers are asserted by content: f32, so every CPU computes the same greedy text (at bf16
    # SmolLM2's first answer token to FRANCE depends on the CPU's rounding).
    srv = ServerProcess("--api-key", KEY, "--kv-cache-size", "0.5", "--inference-precision", "f32", "--kv-cache-precision", "f32",
                        "--override-generation-config", '{"max_new_tokens": 48}').wait_ready()
    yield srv
    assert srv.terminate() == 0


def chat(server, timeout: float = 120, **body) -> dict:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": FRANCE, **body}, headers=AUTH,
                   timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(server, timeout: float = 10) -> None:
    """Aborts land at the next engine step."""
    deadline = time.monotonic() + timeout
    while metric(server, "vllm:num_requests_running") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:kv_cache_usage_perc") == 0


def prompt_len(server, messages: list[dict]) -> int:
    return httpx.post(f"{server.url}/tokenize", json={"messages": messages}, headers=AUTH).json()["count"]


def test_models_shows_the_defaults_in_force(server):
    card = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]
    assert card["sampling_defaults"] == DEFAULTS


def test_the_readme_request_is_bounded_by_the_model_defaults(server):
    # The README's curl, as a new user sends it: no temperature, no max_tokens.
    r = httpx.post(f"{server.url}/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"model": "smollm2-135m-instruct", "messages": FRANCE})
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= DEFAULTS["max_tokens"]


def test_fields_left_out_take_the_model_defaults_and_given_ones_win(server):
    haiku = [{"role": "user", "content": "Write a haiku about autumn."}]
    implicit = chat(server, messages=haiku, seed=7, max_tokens=24)
    explicit = chat(server, messages=haiku, seed=7, max_tokens=24, temperature=0.2, top_p=0.9)
    assert implicit["choices"][0]["message"]["content"] == explicit["choices"][0]["message"]["content"]
    # max_tokens: the default unless the request says otherwise.
    assert chat(server, ignore_eos=True)["usage"]["completion_tokens"] == DEFAULTS["max_tokens"]
    assert chat(server, ignore_eos=True, max_tokens=3)["usage"]["completion_tokens"] == 3


def test_prompt_tokens_are_counted_as_soon_as_the_prompt_is_computed(server):
    count = prompt_len(server, FRANCE)
    before = metric(server, "vllm:prompt_tokens_total")
    # Room to run for a minute: on a busy machine the client may read its first token seconds late.
    body = {"messages": FRANCE, "stream": True, "max_tokens": 4000, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60) as r:
        # Held, not left to the for loop: a line iterator dropped after `break` is closed, which
        # closes the response, and the server rightly aborts the request of a client that left.
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: ") and "role" not in json.loads(line[6:])["choices"][0]["delta"]:
                break  # the first token is out; the request runs on
        assert metric(server, "vllm:num_requests_running") == 1
        assert metric(server, "vllm:prompt_tokens_total") == before + count
    wait_idle(server)
    assert metric(server, "vllm:prompt_tokens_total") == before + count  # not counted twice


def _spawn_chat(*args: str):
    """The chat over pipes, not a pseudo-terminal: CI's sandbox gave a pty child nothing but EOF.
    Ctrl-C is the SIGINT a terminal would send (`child.kill(signal.SIGINT)`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent.parent), os.environ.get("PYTHONPATH")]))}
    child = PopenSpawn([sys.executable, "-m", "vinoserve.cli", "chat", *args], env=env, encoding="utf-8",
                       timeout=120)
    try:
        child.expect_exact("> ")
    except (pexpect.EOF, pexpect.TIMEOUT):
        raise AssertionError(f"vinoserve chat did not prompt (exit {child.proc.poll()}): {child.before!r}")
    return child


def _turn(child, text: str) -> str:
    """Send one line; the reply up to its stats line."""
    child.sendline(text)
    child.expect(r"\((\d+ tokens[^)]*)\)\r?\n")
    reply = child.before
    child.expect_exact("> ")
    return reply


def test_terminal_chat_against_a_server(server):
    child = _spawn_chat("--url", server.url, "--api-key", KEY, "--temperature", "0", "--max-tokens", "40")
    sent = lambda: metric(server, "vllm:prompt_tokens_total")  # noqa: E731
    start = sent()
    assert "Paris" in _turn(child, "What is the capital of France?")
    first = sent() - start
    assert first == prompt_len(server, FRANCE)
    _turn(child, "And of Germany?")  # the history goes with it: both turns and the answer
    assert sent() - start - first > first + 8
    child.sendline("/reset")
    child.expect_exact("(conversation cleared)")
    child.expect_exact("> ")
    mark = sent()
    _turn(child, "What is the capital of France?")
    assert sent() - mark == first  # a fresh conversation again
    child.sendline("/system You are a pirate.")
    child.expect_exact("> ")
    child.sendline("/reset")
    child.expect_exact("> ")
    mark = sent()
    _turn(child, "What is the capital of France?")
    assert sent() - mark == prompt_len(server, [{"role": "system", "content": "You are a pirate."}, *FRANCE])

    child.sendline("/exit")
    child.expect(pexpect.EOF)

    # Ctrl-C stops the reply: the stream closes and the server aborts the request.
    child = _spawn_chat("--url", server.url, "--api-key", KEY, "--max-tokens", "2000")
    child.sendline("Tell me a long story about a dragon who learns to cook.")
    generated = metric(server, "vllm:generation_tokens_total")
    deadline = time.monotonic() + 60
    while metric(server, "vllm:generation_tokens_total") < generated + 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    child.kill(signal.SIGINT)
    child.expect(r"· stopped\)")
    child.expect_exact("> ")
    wait_idle(server)
    child.sendeof()
    child.expect(pexpect.EOF)
    assert child.wait() == 0


def test_terminal_chat_with_the_builtin_engine(smollm2_gguf):
    child = _spawn_chat("--temperature", "0", "--max-tokens", "32", "--kv-cache-size", "0.1", "--inference-precision", "f32", "--kv-cache-precision", "f32")
    assert "Paris" in _turn(child, "What is the capital of France?")
    child.sendline("/exit")
    child.expect(pexpect.EOF, timeout=60)
    assert child.wait() == 0


def _browser():
    """Debian's chromium (.ci/run installs it; VINOSERVE_REQUIRE_BROWSER=1 makes its absence a failure)."""
    if not Path(CHROMIUM).exists() and not os.environ.get("VINOSERVE_REQUIRE_BROWSER"):
        pytest.skip(f"{CHROMIUM} not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    return sync_playwright()


def test_chat_page_streams_a_reply_and_stops_server_side(server, tmp_path):
    with _browser() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 720})
            outside = []  # nothing may be fetched from anywhere but this server
            page.on("request", lambda req: req.url.startswith(server.url) or outside.append(req.url))
            page.goto(server.url + "/")
            # The server has a key: the page asks for it, then shows the model and its defaults.
            page.locator("#apikey").wait_for(state="visible")
            page.fill("#apikey", KEY)
            page.locator("#apikey").dispatch_event("change")
            page.wait_for_function("document.getElementById('model').textContent.includes('smollm2')")
            assert "temperature 0.2" in page.text_content("#model")
            page.fill("#system", "You are a helpful geography teacher.")
            page.fill("#temperature", "0")
            page.fill("#maxtokens", "32")
            page.fill("#input", "What is the capital of France?")
            page.keyboard.press("Enter")
            page.wait_for_function("document.querySelector('.stats')?.textContent.includes('tokens/s')",
                                   timeout=60_000)
            # The page streamed what the API answers to the same greedy request, system prompt included
            # (what a 135M model says at temperature 0 depends on the CPU's precision, not the page).
            system = [{"role": "system", "content": "You are a helpful geography teacher."}]
            expected = chat(server, messages=system + FRANCE, temperature=0, max_tokens=32)
            assert page.text_content(".msg.assistant").strip() == \
                expected["choices"][0]["message"]["content"].strip()
            stats = page.text_content(".stats")
            assert "TTFT" in stats and stats.endswith(expected["choices"][0]["finish_reason"]), stats
            shots = Path(os.environ.get("VINOSERVE_SCREENSHOTS", tmp_path))  # to look at it
            shots.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(shots / "chat_page.png"))

            # A long reply, stopped: the request is aborted on the server, the page is ready again.
            page.fill("#maxtokens", "2000")
            page.fill("#input", "Tell me a long story about a dragon.")
            page.click("#send")
            page.wait_for_function("document.querySelectorAll('.msg.assistant')[1]?.textContent.length > 20",
                                   timeout=60_000)
            assert metric(server, "vllm:num_requests_running") == 1
            page.click("#stop")
            page.wait_for_function("document.querySelectorAll('.stats')[1]?.textContent.includes('stopped')")
            wait_idle(server)
            assert page.is_enabled("#send") and not page.is_enabled("#stop")
            assert not outside, outside
        finally:
            browser.close()



def test_terminal_chat_attaches_images_to_the_next_message(tmp_path):
    """`/image PATH` sends the file as a data: URL with the next message only; a missing file is a note."""
    import base64
    import io

    from vinoserve.chat import Conversation

    class Recorder:  # a ChatClient: what the conversation would send
        def __init__(self):
            self.sent = []

        def stream(self, messages, stats):
            self.sent.append(messages)
            yield "ok"

    picture = tmp_path / "shot.jpg"
    picture.write_bytes(b"\xff\xd8\xff\xe0 jpeg bytes")
    client, out, err = Recorder(), io.StringIO(), io.StringIO()
    chat = Conversation(client, out=out, err=err)
    chat.handle(f"/image {tmp_path / 'missing.png'}")
    assert "error: /image" in err.getvalue()
    chat.handle(f"/image {picture}")
    chat.handle("What is this?")
    chat.handle("And now?")
    first, second = client.sent[0][-1]["content"], client.sent[1][-1]["content"]
    assert first == [{"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,"
                                                                + base64.b64encode(picture.read_bytes()).decode()}},
                     {"type": "text", "text": "What is this?"}]
    assert second == "And now?" and client.sent[1][0]["content"] == first  # the history keeps the image
