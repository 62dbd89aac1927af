"""Token logprobs in OpenAI's shapes: chat's entries, and completions' older parallel lists."""
from __future__ import annotations

from vinoserve.engine.outputs import RequestOutput
from vinoserve.model.tokenizer import Tokenizer


def token_entry(tokenizer: Tokenizer, token: int, logprob: float) -> dict:
    raw = tokenizer.token_bytes[token] if token < len(tokenizer.token_bytes) else b""
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": max(logprob, -9999.0), "bytes": list(raw)}


def output_entries(tokenizer: Tokenizer, out: RequestOutput) -> list[dict]:
    """An engine output's tokens, each with its top alternatives."""
    entries = []
    for token, (logprob, top) in zip(out.new_token_ids, out.new_logprobs or []):
        entry = token_entry(tokenizer, token, logprob)
        entry["top_logprobs"] = [token_entry(tokenizer, t, lp) for t, lp in top]
        entries.append(entry)
    return entries


def legacy_logprobs(entries: list[dict] | None) -> dict | None:
    """The completions API's older parallel-list shape."""
    if entries is None:
        return None
    offsets, pos = [], 0
    for e in entries:
        offsets.append(pos)
        pos += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": offsets}
