"""Decoders as embedders and rerankers (model/encoders/decoder.py): tiny random Qwen3 GGUFs marked
for pooling against transformers at f32: the last token's final hidden state (Qwen3-Embedding),
and softmax of the "yes" / "no" logits at the last position (Qwen3-Reranker)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gguf_fixtures import FAMILIES, TINY_VOCAB, Vocab, tiny_hf_model, write_gguf
from vinoserve.model.encoders.decoder import DecoderPooler, pooling_kind
from vinoserve.model.encoders.model import EncoderOptions
from vinoserve.model.encoders.packing import Sequence

F32 = EncoderOptions(inference_precision="f32")
# The reranker's vocabulary must spell "yes" and "no" as tokens of their own.
VOCAB = Vocab(TINY_VOCAB.tokens[:-2] + ["yes", "no"] + TINY_VOCAB.tokens[-2:],
              TINY_VOCAB.types[:-2] + [1, 1] + TINY_VOCAB.types[-2:], TINY_VOCAB.eos_id + 2)
SPEC = {k: v for k, v in FAMILIES["qwen3"].items() if k != "arch"}


@pytest.fixture(scope="module")
def qwen3():
    return tiny_hf_model("qwen3", vocab=VOCAB, **SPEC)


def _last_states(hf, seqs: list[list[int]]) -> np.ndarray:
    with torch.no_grad():
        return np.stack([hf.model(torch.tensor([s])).last_hidden_state[0, -1].numpy() for s in seqs])


def test_qwen3_embedder_is_the_last_tokens_state(qwen3, tmp_path, monkeypatch):
    monkeypatch.setenv("VINOSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(qwen3, tmp_path / "emb.gguf", "qwen3", vocab=VOCAB, pooling=gguf.PoolingType.LAST)
    assert pooling_kind(path) == "embed" and pooling_kind(tmp_path / "nope.gguf") is None
    model = DecoderPooler(path, F32, log=lambda _: None)
    texts = ["the cat", "hello there, the world", "t"]
    enc = model.tokenizer.encode(texts, model.config.max_length, truncate=False)
    assert all(e.ids[-1] == VOCAB.eos_id for e in enc)
    got = model.run([Sequence(e.ids) for e in enc])  # right-padded in one batch
    expected = _last_states(qwen3, [e.ids for e in enc])
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    cos = (got * expected).sum(1) / np.linalg.norm(got, axis=1)
    assert cos.min() >= 0.99999 and np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)


def test_qwen3_reranker_is_p_yes(qwen3, tmp_path, monkeypatch):
    monkeypatch.setenv("VINOSERVE_CACHE", str(tmp_path / "cache"))
    path = write_gguf(qwen3, tmp_path / "rr.gguf", "qwen3", vocab=VOCAB, pooling=gguf.PoolingType.RANK)
    model = DecoderPooler(path, F32, log=lambda _: None)
    assert model.config.is_classifier
    pairs = [("the query", "he"), ("the query", "the the the"), ("the query", "t h e"), ("x", "y")]
    enc = model.tokenizer.encode(pairs, model.config.max_length, truncate=False)
    got = 1 / (1 + np.exp(-model.run([Sequence(e.ids) for e in enc])[:, 0]))
    yes, no = len(TINY_VOCAB.tokens) - 2, len(TINY_VOCAB.tokens) - 1
    with torch.no_grad():
        last = [qwen3(torch.tensor([e.ids])).logits[0, -1] for e in enc]
    expected = np.array([torch.softmax(torch.stack([x[yes], x[no]]), 0)[0].item() for x in last])
    assert np.abs(got - expected).max() < 1e-4
    assert np.argsort(-got).tolist() == np.argsort(-expected).tolist() and np.ptp(expected) > 1e-3


def test_served_beside_each_other(qwen3, tmp_path):
    import httpx

    from server_process import ServerProcess

    emb = write_gguf(qwen3, tmp_path / "emb.gguf", "qwen3", vocab=VOCAB, pooling=gguf.PoolingType.LAST)
    rr = write_gguf(qwen3, tmp_path / "rr.gguf", "qwen3", vocab=VOCAB, pooling=gguf.PoolingType.RANK)
    srv = ServerProcess("--model", f"emb={emb}", "--model", f"rr={rr}", "--inference-precision", "f32",
                        env={"VINOSERVE_CACHE": str(tmp_path / "cache")}).wait_ready()
    try:
        cards = {c["id"]: c["tasks"] for c in httpx.get(f"{srv.url}/v1/models").json()["data"]}
        assert cards == {"emb": ["embeddings", "rerank", "score"], "rr": ["rerank", "score"]}
        vectors = httpx.post(f"{srv.url}/v1/embeddings", json={"model": "emb", "input": ["the cat", "t"]}).json()
        assert len(vectors["data"]) == 2 and len(vectors["data"][0]["embedding"]) == 64
        ranked = httpx.post(f"{srv.url}/v1/rerank", json={"model": "rr", "query": "the query",
                                                           "documents": ["he", "the the the", "t h e"]}).json()
        model = DecoderPooler(rr, F32, log=lambda _: None)
        enc = model.tokenizer.encode([("the query", d) for d in ("he", "the the the", "t h e")], 4096, False)
        direct = 1 / (1 + np.exp(-model.run([Sequence(e.ids) for e in enc])[:, 0]))
        assert [r["index"] for r in ranked["results"]] == np.argsort(-direct).tolist()
        assert max(abs(r["relevance_score"] - direct[r["index"]]) for r in ranked["results"]) < 1e-5
    finally:
        assert srv.terminate() == 0
