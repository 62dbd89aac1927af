"""Decoder LLMs as embedders and rerankers (Qwen3-Embedding, Qwen3-Reranker), from a GGUF whose
`{arch}.pooling_type` says so (llama.cpp's converter writes LAST for the embedders; RANK marks a
reranker here). The GGUF is converted as for chat (model/convert.py, cached) and its graph run
whole-prompt, like an encoder: the paged engine has no path that returns a hidden state, and a
pooled prompt keeps no KV cache. Right-padded batches under the graph's causal + padding mask;
the hidden state of each sequence's last token is gathered in the graph.

- embedder: that state (after the final norm), L2-normalised; the tokenizer appends EOS, as
  Qwen3-Embedding's does.
- reranker: the LM head's "yes" and "no" rows applied to it: score = softmax(yes, no)[yes] =
  sigmoid(yes - no), which `run` returns as the one logit (yes - no) of a classifier.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import openvino as ov
import openvino.opset13 as ops

from vinoserve.model.blocks import const
from vinoserve.model.convert import converted_dir
from vinoserve.model.encoders.config import EncoderConfig
from vinoserve.model.encoders.model import EncoderOptions
from vinoserve.model.encoders.packing import Sequence, right_padded
from vinoserve.model.encoders.tokenizer import Encoded, TooLong
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_file import field
from vinoserve.model.gguf_loader import GGUFModel
from vinoserve.model.graph_facts import lm_head
from vinoserve.model.tokenizer import Tokenizer

POOLED = {gguf.PoolingType.LAST: "embed", gguf.PoolingType.RANK: "rerank"}
# Qwen3-Reranker's prompt (its model card): the pair goes between these, the answer is yes or no.
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
                 "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def pooling_kind(path: Path) -> str | None:
    """"embed" or "rerank" for a decoder GGUF marked for pooling, else None."""
    if path.suffix != ".gguf" or not path.is_file():
        return None
    try:
        reader = gguf.GGUFReader(path)
        arch = field(reader, "general.architecture")
        return POOLED.get(field(reader, f"{arch}.pooling_type"))
    except Exception:  # unreadable: the loader that gets it says why
        return None


class DecoderTokenizer:
    """EncoderTokenizer's interface over a chat tokenizer: texts end with EOS, pairs go into the
    reranker's prompt."""

    def __init__(self, tok: Tokenizer) -> None:
        self._tok = tok
        self.vocab_size = len(tok.token_bytes)
        if tok.eos_token_id is None:
            raise ModelLoadError("the GGUF's tokenizer names no EOS token, which ends an embedder's input")
        self._prefix = tok.encode(RERANK_PREFIX, add_special_tokens=False)
        self._suffix = tok.encode(RERANK_SUFFIX, add_special_tokens=False)

    def token(self, text: str) -> int:
        ids = [i for i, b in enumerate(self._tok.token_bytes) if b == text.encode()]
        if not ids:
            raise ModelLoadError(f"the vocabulary has no token {text!r}, which a reranker scores")
        return ids[0]

    def encode(self, texts: list[str] | list[tuple[str, str]], limit: int, truncate: bool) -> list[Encoded]:
        out = []
        for i, text in enumerate(texts):
            if isinstance(text, tuple):
                body = self._tok.encode(f"<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {text[0]}\n<Document>: {text[1]}",
                                        add_special_tokens=False)
                head, tail = self._prefix, self._suffix
            else:
                body, head, tail = self._tok.encode(text, add_special_tokens=False), [], [self._tok.eos_token_id]
            if len(head) + len(body) + len(tail) > limit:
                if not truncate:
                    raise TooLong(i, len(head) + len(body) + len(tail), limit)
                body = body[:max(0, limit - len(head) - len(tail))]
            out.append(Encoded(head + body + tail, [0] * (len(head) + len(body) + len(tail))))
        return out

    def cut(self, texts: list[str], max_tokens: int) -> list[str]:
        return [self._tok.decode(ids[:max_tokens]) if len(ids := self._tok.encode(t, add_special_tokens=False))
                > max_tokens else t for t in texts]


@dataclass(frozen=True)
class _Head:
    yes_no: np.ndarray  # [2, H]: the LM head's rows of "yes" and "no"


class DecoderPooler:
    """The interface of EncoderModel (config, tokenizer, run) over a decoder GGUF."""

    def __init__(self, path: Path, options: EncoderOptions = EncoderOptions(), weight_format: str = "auto",
                 log=print) -> None:
        kind = pooling_kind(path)
        if kind is None:
            raise ModelLoadError(f"{path}: not a decoder GGUF marked for pooling (pooling_type last or rank)")
        src = GGUFModel.open(path)
        directory = converted_dir(path, weight_format, log)
        core = ov.Core()
        self.tokenizer = DecoderTokenizer(Tokenizer.from_ir_dir(directory, core))
        model = core.read_model(directory / "openvino_model.xml")
        self._head = None
        if kind == "rerank":
            rows = [self.tokenizer.token("yes"), self.tokenizer.token("no")]
            name = "output.weight" if src.has("output.weight") else "token_embd.weight"
            self._head = _Head(np.stack([src.tensor(name).rows(r, r + 1).dequantize()[0] for r in rows]))
        cfg = src.config
        self.config = EncoderConfig(
            model_type=cfg.architecture, vocab_size=self.tokenizer.vocab_size, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers, num_heads=1, intermediate_size=0, hidden_act="", layer_norm_eps=0.0,
            max_position_embeddings=cfg.max_context, type_vocab_size=0, position_offset=0, pooling="last",
            normalize=kind == "embed", max_length=cfg.max_context, num_labels=1 if kind == "rerank" else 0)
        compiled = core.compile_model(_last_hidden(model), options.device, options.properties())
        self._request = compiled.create_infer_request()
        self._lock = threading.Lock()
        self.path = path
        self.weight_bytes = (directory / "openvino_model.bin").stat().st_size
        self.inference_precision = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()

    def run(self, seqs: list[Sequence], layout: str = "auto") -> np.ndarray:
        padded = right_padded(seqs)
        inputs = {name: padded[name] for name in ("input_ids", "attention_mask", "position_ids")}
        inputs.update(beam_idx=np.arange(len(seqs), dtype=np.int32), last_index=padded["lengths"] - 1)
        with self._lock:
            self._request.reset_state()  # whole prompts: no KV from the call before
            hidden = np.array(self._request.infer(inputs)["last_hidden"], np.float32)
        if self._head is not None:
            logits = hidden @ self._head.yes_no.T
            return (logits[:, 0] - logits[:, 1])[:, None]
        return hidden / np.maximum(np.linalg.norm(hidden, axis=1, keepdims=True), 1e-12)


def _last_hidden(model: ov.Model) -> ov.Model:
    """The graph with its logits replaced by the final hidden state of each row's last token
    (input `last_index` [B]): what the LM head would read there, [B, H]."""
    hidden = lm_head(model).input_value(0)  # [B, L, H] after the final norm
    last = ops.parameter([-1], ov.Type.i64, name="last_index")
    last.output(0).set_names({"last_index"})
    picked = ops.gather(hidden, ops.unsqueeze(last, const([1])), const(1), batch_dims=1)  # [B, 1, H]
    result = ops.result(ops.squeeze(picked, const([1])))
    result.output(0).set_names({"last_hidden"})
    return ov.Model([result], model.get_sinks(), [*model.get_parameters(), last], "pooled_decoder")
