"""The clients of `vinoserve bench soak`: a mix of chat, completions, Responses and embeddings
requests, streamed or whole, with a share of clients leaving before the first token, mid-stream or
during a whole reply's wait; a few invalid requests (each must be a 400) and light routes. Each
result is counted in a Tally that soak.py judges."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from vinoserve.bench.workloads import _english_words

# A disconnect is one of these, chosen uniformly among those the request's kind allows.
DISCONNECTS = ("before-first-token", "mid-stream", "non-stream-wait")
# Generation endpoints, by the share of generation requests each gets (embeddings, when an
# embedder is served, take EMBED_SHARE of them first).
GENERATION = (("chat", 0.4), ("completion", 0.4), ("responses", 0.2))
EMBED_SHARE = 0.15
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "responses": "/v1/responses",
         "embeddings": "/v1/embeddings"}


@dataclass
class SoakConfig:
    num_requests: int = 500
    concurrency: int = 48
    stream_share: float = 0.7
    disconnect_share: float = 0.2
    invalid_share: float = 0.03  # requests that must be answered 400
    max_tokens: int = 64  # requests that stay get 1..max_tokens
    disconnect_max_tokens: int = 1500  # large, so a missed abort shows as tokens generated for nobody
    max_undelivered_per_disconnect: float = 4.0
    max_rss_growth: float = 0.05  # resident memory, end of the first tenth to the last tenth's peak
    time_limit_s: float = 3600.0
    settle_s: float = 10.0  # after the last request, how long aborts may take to land
    sample_every_s: float = 2.0
    seed: int = 0


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    disconnects: Counter = field(default_factory=Counter)
    delivered_tokens: int = 0
    disconnected_streams: int = 0  # engine requests whose client left (a multi-prompt request has several)
    client_errors: list[str] = field(default_factory=list)  # unexpected client-side failures
    done: int = 0


class Soak:
    def __init__(self, base_url: str, model: str, config: SoakConfig, api_key: str | None = None,
                 embedder: str | None = None) -> None:
        self.url, self.model, self.embedder, self.c = base_url.rstrip("/"), model, embedder, config
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.rng = random.Random(config.seed)
        self.words = _english_words()
        self.tally = Tally()

    def _prompt(self) -> str:
        return " ".join(self.rng.choices(self.words, k=self.rng.randint(4, 120)))

    def _body(self, kind: str, stream: bool, leave: bool) -> dict:
        max_tokens = self.c.disconnect_max_tokens if leave else self.rng.randint(1, self.c.max_tokens)
        body = {"model": self.model, "stream": stream, "temperature": self.rng.choice((0.0, 0.8))}
        if kind == "responses":  # its own length field, and no ignore_eos (OpenAI's API has none)
            return {**body, "input": self._prompt(), "max_output_tokens": max_tokens}
        body.update(max_tokens=max_tokens, ignore_eos=leave)
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": self._prompt()}]
            if self.rng.random() < 0.2:
                body.update(logprobs=True, top_logprobs=2)
        else:
            prompts = [self._prompt() for _ in range(self.rng.choice((1, 1, 1, 2, 3)))]
            body["prompt"] = prompts[0] if len(prompts) == 1 else prompts
            if self.rng.random() < 0.2:
                body["logprobs"] = 2
        if stream and self.rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if self.rng.random() < 0.1:
            body["stop"] = ["\n\n", " the"]
        return body

    def _invalid(self) -> tuple[str, dict]:
        user = [{"role": "user", "content": "x"}]
        choices = [("/v1/chat/completions", {"model": self.model, "messages": []}),
                   ("/v1/completions", {"model": self.model, "prompt": "x", "max_tokens": -1}),
                   ("/v1/completions", {"model": self.model, "prompt": []}),
                   ("/v1/chat/completions", {"model": self.model, "messages": user, "temperature": -1}),
                   # a stop id past the vocabulary, held back by min_tokens: once a 500
                   ("/v1/completions", {"model": self.model, "prompt": "x", "stop_token_ids": [10**7],
                                        "min_tokens": 1}),
                   ("/v1/responses", {"model": self.model, "input": []})]
        if self.embedder is not None:
            choices.append(("/v1/embeddings", {"model": self.embedder, "input": [[1, 10**7]]}))
        return self.rng.choice(choices)

    def _kind(self) -> str:
        if self.embedder is not None and self.rng.random() < EMBED_SHARE:
            return "embeddings"
        names, weights = zip(*GENERATION)
        return self.rng.choices(names, weights)[0]

    async def one(self, client: httpx.AsyncClient) -> None:
        r = self.rng.random()
        if r < self.c.invalid_share:
            path, body = self._invalid()
            resp = await client.post(self.url + path, json=body, headers=self.headers)
            self.tally.kinds["invalid"] += 1
            self._status(resp.status_code, expect=400)
            return
        if r < self.c.invalid_share + 0.03:
            await self._light(client)
            return
        kind = self._kind()
        if kind == "embeddings":
            await self._embeddings(client, leave=self.rng.random() < self.c.disconnect_share)
            return
        stream, leave = self.rng.random() < self.c.stream_share, self.rng.random() < self.c.disconnect_share
        how = self.rng.choice(DISCONNECTS[:2] if stream else DISCONNECTS[2:] + DISCONNECTS[:1]) if leave else None
        body = self._body(kind, stream, leave)
        self.tally.kinds[f"{kind}-{'stream' if stream else 'plain'}"] += 1
        if how is not None:
            self.tally.disconnects[how] += 1
            self.tally.disconnected_streams += len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
        if stream:
            await self._stream(client, kind, body, how)
        else:
            await self._plain(client, kind, body, how)

    async def _light(self, client: httpx.AsyncClient) -> None:
        path, body = self.rng.choice((("/v1/models", None), ("/tokenize", {"prompt": self._prompt()}),
                                      ("/detokenize", {"tokens": [1, 2, 3]}), ("/health", None)))
        self.tally.kinds["light"] += 1
        if body is None:
            resp = await client.get(self.url + path, headers=self.headers)
        else:
            resp = await client.post(self.url + path, json=body, headers=self.headers)
        self._status(resp.status_code, expect=200)

    async def _embeddings(self, client: httpx.AsyncClient, leave: bool) -> None:
        texts = [self._prompt() for _ in range(self.rng.randint(1, 8))]
        body = {"model": self.embedder, "input": texts, "truncate_prompt_tokens": -1}
        self.tally.kinds["embeddings"] += 1
        if leave:
            self.tally.disconnects["embeddings-wait"] += 1
        resp = await self._post(client, PATHS["embeddings"], body, self.rng.uniform(0.0, 0.05) if leave else None)
        if resp is not None and self._status(resp.status_code, expect=200) and len(resp.json()["data"]) != len(texts):
            self.tally.client_errors.append(f"embeddings: {len(resp.json()['data'])} vectors for {len(texts)} inputs")

    async def _post(self, client: httpx.AsyncClient, path: str, body: dict, leave_after: float | None):
        """The response, or None when the client left (after `leave_after` seconds) before it came."""
        request = client.post(self.url + path, json=body, headers=self.headers)
        if leave_after is None:
            return await request
        try:
            return await asyncio.wait_for(request, leave_after)
        except asyncio.TimeoutError:
            return None

    async def _plain(self, client: httpx.AsyncClient, kind: str, body: dict, how: str | None) -> None:
        # Leaving while the server is still generating: before it starts, or some way in.
        wait = None if how is None else self.rng.uniform(0.0, 0.05) if how == "before-first-token" \
            else self.rng.uniform(0.1, 2.0)
        resp = await self._post(client, PATHS[kind], body, wait)
        if resp is None or not self._status(resp.status_code, expect=200):
            return
        data = resp.json()
        if kind == "responses":
            self.tally.delivered_tokens += data["usage"]["output_tokens"]
            ok = data["status"] in ("completed", "incomplete")
        else:
            self.tally.delivered_tokens += data["usage"]["completion_tokens"]
            ok = all(c["finish_reason"] in ("stop", "length") for c in data["choices"])
        if not ok and how is None:
            self.tally.client_errors.append(f"{kind} ended badly: {json.dumps(data)[:300]}")

    async def _stream(self, client: httpx.AsyncClient, kind: str, body: dict, how: str | None) -> None:
        leave_after = 0 if how == "before-first-token" else self.rng.randint(1, 40) if how else None
        tokens, finished = 0, 0
        async with client.stream("POST", self.url + PATHS[kind], json=body, headers=self.headers) as resp:
            if not self._status(resp.status_code, expect=200):
                await resp.aread()
                return
            if leave_after == 0:
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk or chunk.get("type") in ("error", "response.failed"):
                    self.tally.client_errors.append(f"stream error: {line[6:300]}")
                    self.tally.statuses["stream-error"] += 1
                    return
                new, ended = _stream_tokens(kind, chunk)
                tokens, finished = tokens + new, finished + ended
                self.tally.delivered_tokens += new
                if leave_after is not None and tokens >= leave_after:
                    return  # leaving the block closes the connection mid-stream
        expected = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1
        if how is None and finished != expected:
            self.tally.client_errors.append(f"{kind} stream ended with {finished} of {expected} choices finished")

    def _status(self, status: int, expect: int) -> bool:
        self.tally.statuses[status] += 1
        if status != expect and not 400 <= status < 500:
            self.tally.client_errors.append(f"HTTP {status} where {expect} was expected")
        elif status != expect and expect == 400:
            self.tally.client_errors.append(f"HTTP {status} for an invalid request")
        return status == expect

    async def run(self, sample) -> float:
        """All requests, `concurrency` at a time; `sample()` is called every sample_every_s."""
        limits = httpx.Limits(max_connections=self.c.concurrency, max_keepalive_connections=0)
        start = time.monotonic()
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(self.c.num_requests):
                queue.put_nowait(i)

            async def worker() -> None:
                while not queue.empty() and time.monotonic() - start < self.c.time_limit_s:
                    queue.get_nowait()
                    try:
                        await self.one(client)
                    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
                        self.tally.client_errors.append(f"{type(e).__name__}: {e}")
                    self.tally.done += 1

            async def sampler() -> None:
                while True:
                    await sample(time.monotonic() - start)
                    await asyncio.sleep(self.c.sample_every_s)

            probe = asyncio.create_task(sampler())
            await asyncio.gather(*(worker() for _ in range(self.c.concurrency)))
            probe.cancel()
        return time.monotonic() - start


def _stream_tokens(kind: str, chunk: dict) -> tuple[int, int]:
    """Tokens (text pieces) and finished choices in one streamed event of `kind`."""
    if kind == "responses":
        kind_of = chunk.get("type")
        return int(kind_of == "response.output_text.delta"), int(kind_of in ("response.completed",
                                                                              "response.incomplete"))
    tokens = finished = 0
    for choice in chunk.get("choices", []):
        if kind == "chat" and "role" in choice["delta"]:
            continue
        tokens += 1
        finished += choice["finish_reason"] is not None
    return tokens, finished
