"""Prompts for load tests. Lengths are in words (about 1.3 tokens each for English); the real
token counts come back from the server's usage and are what the report uses."""
from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    output_len: int
    conversation: int | None = None  # turns of one conversation go one after another, in order
    turn: int = 0


def stdlib_english() -> str:
    """Real English text available offline (no data set can be downloaded here): the standard
    library's documentation strings, paragraphs of 200+ characters, each once. A class without a
    docstring inherits its base's from inspect.getdoc, and a module re-exports what another defines:
    kept twice, a passage made two "fresh" prompts that start alike (prefix-cache hits in `bench
    engine`, which compares against an engine that caches no prefixes)."""
    import argparse, asyncio, collections, email, json as js, logging, subprocess, threading, unittest  # noqa

    docs = [inspect.getdoc(obj) or "" for mod in (argparse, asyncio, collections, email, js, logging, subprocess,
                                                  threading, unittest, inspect)
            for obj in (mod, *(o for _, o in inspect.getmembers(mod) if inspect.isclass(o) or inspect.isfunction(o)))]
    return "\n\n".join(dict.fromkeys(d for d in docs if len(d) > 200))


def _english_words() -> list[str]:
    return re.findall(r"[A-Za-z]+[.,]?", stdlib_english())


def _lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, n)


def random_workload(n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> list[BenchRequest]:
    """Random sequences of English words, lengths uniform in mean * [1 - r, 1 + r]."""
    rng = np.random.default_rng(seed)
    words = _english_words()
    ins, outs = _lengths(rng, n, input_len, range_ratio), _lengths(rng, n, output_len, range_ratio)
    return [BenchRequest(" ".join(rng.choice(words, int(i))), int(o)) for i, o in zip(ins, outs)]


def prefix_repetition_workload(n: int, prefix_len: int, suffix_len: int, output_len: int,
                               num_prefixes: int = 4, seed: int = 0) -> list[BenchRequest]:
    """Requests sharing one of a few long prefixes (system prompts, documents) with unique tails."""
    rng = np.random.default_rng(seed)
    words = _english_words()
    prefixes = [" ".join(rng.choice(words, prefix_len)) for _ in range(num_prefixes)]
    return [BenchRequest(f"{prefixes[i % num_prefixes]} {' '.join(rng.choice(words, suffix_len))}", output_len)
            for i in range(n)]


def multi_turn_workload(num_conversations: int, turns: int, first_len: int, turn_len: int, output_len: int,
                        seed: int = 0) -> list[BenchRequest]:
    """Chats whose every turn's prompt is the previous prompt, an answer and a new user message, so a
    server with prefix caching computes only the new part. Turns of a conversation are sent one
    after another; conversations run side by side. The answers are fixed text of `output_len`
    words rather than the model's, so the prompts are the same for every server."""
    rng = np.random.default_rng(seed)
    words = _english_words()
    out = []
    for c in range(num_conversations):
        prompt = f"User: {' '.join(rng.choice(words, first_len))}\nAssistant:"
        for t in range(turns):
            out.append(BenchRequest(prompt, output_len, conversation=c, turn=t))
            answer, user = " ".join(rng.choice(words, output_len)), " ".join(rng.choice(words, turn_len))
            prompt += f" {answer}\nUser: {user}\nAssistant:"
    return out


def text_file_workload(path: Path, n: int, input_len: int, output_len: int) -> list[BenchRequest]:
    """Consecutive slices of a plain text file, `input_len` words each (wrapping around)."""
    words = Path(path).read_text().split()
    if not words:
        raise ValueError(f"{path} has no text")
    return [BenchRequest(" ".join(words[(i * input_len + k) % len(words)] for k in range(input_len)), output_len)
            for i in range(n)]


def sharegpt_workload(path: Path, n: int, output_len: int | None = None, seed: int = 0) -> list[BenchRequest]:
    """First human turn of ShareGPT-format conversations; the output length is the reply's
    (about 1.3 tokens per word) unless fixed."""
    data = json.loads(Path(path).read_text())
    pairs = []
    for conv in data:
        turns = conv.get("conversations", [])
        if len(turns) >= 2 and turns[0].get("value") and turns[1].get("value"):
            reply = int(len(turns[1]["value"].split()) * 1.3) or 1
            pairs.append(BenchRequest(turns[0]["value"], output_len or min(reply, 2048)))
    if not pairs:
        raise ValueError(f"{path} has no usable ShareGPT conversations")
    rng = np.random.default_rng(seed)
    return [pairs[i] for i in rng.choice(len(pairs), n, replace=len(pairs) < n)]
