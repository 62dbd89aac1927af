"""`vinoserve chat`: a terminal chat with any OpenAI-compatible server, or with a model run here.

Without --url the server is started in this process on a loopback port, so both ways share one
code path: the same sampling defaults, chat template and abort-on-disconnect. Ctrl-C closes the
stream, which makes the server abort the request and free its cache.
"""
from __future__ import annotations

import argparse
import base64
import json
import mimetypes
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

HELP = "/reset: forget the conversation · /system TEXT: set the system prompt (/system alone clears it) · " \
       "/image PATH: send an image with your next message · /exit or Ctrl-D: quit · Ctrl-C: stop the reply"


class ChatError(Exception):
    """What the server answered instead of a reply."""


@dataclass
class ReplyStats:
    tokens: int = 0
    ttft: float | None = None  # seconds from sending to the first token
    decode_seconds: float = 0.0  # first token to last
    finish_reason: str | None = None

    def describe(self) -> str:
        parts = [f"{self.tokens} tokens"]
        if self.ttft is not None:
            parts.append(f"TTFT {self.ttft * 1000:.0f} ms")
        if self.tokens > 1 and self.decode_seconds > 0:
            parts.append(f"{(self.tokens - 1) / self.decode_seconds:.1f} tokens/s")
        if self.finish_reason:
            parts.append(self.finish_reason)
        return " · ".join(parts)


@dataclass
class ChatClient:
    """Streams chat completions from an OpenAI-compatible server."""

    base_url: str  # ends in /v1
    api_key: str | None = None
    model: str | None = None  # None: the first one the server lists
    options: dict = field(default_factory=dict)  # temperature, max_tokens... (absent: the server's defaults)

    def __post_init__(self) -> None:
        self.base_url = self.base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.http = httpx.Client(headers=headers, timeout=httpx.Timeout(30.0, read=None))

    def resolve_model(self) -> str:
        if self.model is None:
            res = self.http.get(f"{self.base_url}/models")
            _raise_for(res)
            self.model = res.json()["data"][0]["id"]
        return self.model

    def stream(self, messages: list[dict], stats: ReplyStats) -> Iterator[str]:
        body = {"model": self.resolve_model(), "messages": messages, "stream": True,
                "stream_options": {"include_usage": True}, **self.options}
        start = time.monotonic()
        first = last = None
        with self.http.stream("POST", f"{self.base_url}/chat/completions", json=body) as res:
            if res.status_code != 200:
                res.read()
                _raise_for(res)
            for line in res.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ChatError(chunk["error"].get("message", str(chunk["error"])))
                if chunk.get("usage"):
                    stats.tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices") or []:
                    stats.finish_reason = choice.get("finish_reason") or stats.finish_reason
                    delta = choice.get("delta") or {}
                    if "content" not in delta or (delta.get("role") and not delta["content"]):
                        continue
                    last = time.monotonic()
                    first = first or last
                    stats.tokens += 1  # until usage gives the exact count
                    stats.ttft = first - start
                    stats.decode_seconds = last - first
                    if delta["content"]:
                        yield delta["content"]


def _raise_for(res: httpx.Response) -> None:
    if res.status_code == 200:
        return
    try:
        message = res.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = res.text.strip() or res.reason_phrase
    raise ChatError(f"{res.status_code}: {message}")


class Conversation:
    """History, system prompt and the slash commands, over any ChatClient."""

    def __init__(self, client: ChatClient, system: str | None = None, out=sys.stdout, err=sys.stderr) -> None:
        self.client, self.system, self.out, self.err = client, system, out, err
        self.history: list[dict] = []
        self.images: list[str] = []  # data: URLs of /image files, sent with the next message

    def messages(self) -> list[dict]:
        return ([{"role": "system", "content": self.system}] if self.system else []) + self.history

    def handle(self, line: str) -> bool:
        """One line the user typed; False when they asked to leave."""
        text = line.strip()
        if not text:
            return True
        command, _, rest = text.partition(" ")
        if command in ("/exit", "/quit"):
            return False
        if command == "/reset":
            self.history.clear()
            self._note("(conversation cleared)")
        elif command == "/system":
            self.system = rest.strip() or None
            self._note(f"(system prompt: {self.system!r})" if self.system else "(system prompt cleared)")
        elif command == "/image":
            self._attach(rest.strip())
        elif command in ("/help", "/?"):
            self._note(HELP)
        else:
            self.reply(text)
        return True

    def _attach(self, path: str) -> None:
        try:
            data = Path(path).expanduser().read_bytes()
        except OSError as e:
            self._note(f"error: /image {path}: {e.strerror or e}")
            return
        kind = mimetypes.guess_type(path)[0] or "image/png"
        self.images.append(f"data:{kind};base64,{base64.b64encode(data).decode()}")
        self._note(f"(image {path} attached to your next message: {len(data)} bytes)")

    def reply(self, text: str) -> None:
        images, self.images = self.images, []
        content = [{"type": "image_url", "image_url": {"url": url}} for url in images] + [{"type": "text", "text": text}]
        self.history.append({"role": "user", "content": content if images else text})
        stats, answer = ReplyStats(), []
        try:
            for piece in self.client.stream(self.messages(), stats):
                answer.append(piece)
                self.out.write(piece)
                self.out.flush()
        except KeyboardInterrupt:  # leaving the stream closes the connection: the server aborts
            stats.finish_reason = "stopped"
        except (ChatError, httpx.HTTPError) as e:
            self.out.write("\n")
            self._note(f"error: {e}")
            self.history.pop()
            self.images = images  # still attached: the user may try again
            return
        self.out.write("\n")
        if answer:
            self.history.append({"role": "assistant", "content": "".join(answer)})
        else:
            self.history.pop()
        self._note(f"({stats.describe()})")

    def _note(self, text: str) -> None:
        self.err.write(text + "\n")
        self.err.flush()


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None,
                   help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (default: run --model here); "
                        "with --url, --model names the model on that server (default: the first it lists)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' to --url")
    p.add_argument("--system", default=None, help="system prompt (change it later with /system)")
    p.add_argument("--temperature", type=float, default=None, help="default: the model's (see /v1/models)")
    p.add_argument("--max-tokens", type=int, default=None, help="per reply (default: the server's)")


def run(args: argparse.Namespace, engine_config=None) -> int:
    options = {k: v for k, v in (("temperature", args.temperature), ("max_tokens", args.max_tokens)) if v is not None}
    if args.url:
        client = ChatClient(args.url, args.api_key, args.model, options)
        return _loop(client, args.system)
    with _LocalServer(args, engine_config) as url:
        return _loop(ChatClient(url, options=options), args.system)


def _loop(client: ChatClient, system: str | None) -> int:
    try:
        model = client.resolve_model()
    except (ChatError, httpx.HTTPError) as e:
        print(f"vinoserve chat: cannot reach {client.base_url}: {e}", file=sys.stderr)
        return 1
    try:
        import readline  # noqa: F401  (line editing and history for input())
    except ImportError:
        pass
    # Ctrl-C stops a reply even where the launcher ignored SIGINT (a shell's background job, a
    # runner's `nohup ... &`): Python then leaves it ignored, and the reply ran to its end.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    conversation = Conversation(client, system)
    print(f"chatting with {model} at {client.base_url}. {HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:  # as in Python's REPL: drop the line, keep going
            print(file=sys.stderr)
            continue
        if not conversation.handle(line):
            return 0


class _LocalServer:
    """The OpenAI server on a free loopback port in a background thread, quiet, until exit."""

    def __init__(self, args: argparse.Namespace, engine_config) -> None:
        import logging

        import uvicorn

        from vinoserve.server.app import ServerConfig, create_app

        # The engine's progress (download, conversion, cache size, sampling defaults), not uvicorn's.
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        logging.getLogger("vinoserve").setLevel(logging.INFO)
        config = ServerConfig(engine_config, generation_config=args.generation_config,
                              override_generation_config=args.override_generation_config)
        self.failure: str | None = None  # why the model did not load, or the engine died
        self.server = uvicorn.Server(uvicorn.Config(create_app(config, on_fatal=self._stop), host="127.0.0.1",
                                                    port=0, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, name="vinoserve-chat-server", daemon=True)

    def _stop(self, reason: str) -> None:
        self.failure = reason
        self.server.should_exit = True

    def __enter__(self) -> str:
        from vinoserve.model.errors import ModelLoadError

        print("loading the model ...", file=sys.stderr, flush=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise ModelLoadError(self.failure or "the in-process server did not start")
            time.sleep(0.05)
        sockets = [sock for server in self.server.servers for sock in server.sockets]
        if not sockets:  # closed as soon as it started: the model failed to load meanwhile
            self.thread.join(30)
            raise ModelLoadError(self.failure or "the in-process server did not start")
        port = sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        while self.failure is None:
            try:
                if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                    return url
            except httpx.TransportError:  # the server is stopping: the failure is about to be known
                pass
            time.sleep(0.2)
        self.__exit__()
        raise ModelLoadError(self.failure)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
