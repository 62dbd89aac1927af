"""Text <-> token ids on CPU through OpenVINO tokenizer/detokenizer models."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Sequence
from os import PathLike
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import openvino as ov
import openvino_tokenizers  # noqa: F401  registers the tokenizer ops; must precede read/compile

from .chat_template import render_chat
from .gguf_tokenizer import build_tokenizer_models, read_tokenizer_metadata

TOKENIZER_XML = "openvino_tokenizer.xml"
DETOKENIZER_XML = "openvino_detokenizer.xml"

ModelLike = ov.Model | str | PathLike


class Tokenizer:
    """Encodes and decodes one text at a time; thread-safe (one infer request per model, locked)."""

    def __init__(
        self,
        tokenizer_model: ModelLike,
        detokenizer_model: ModelLike,
        eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
        chat_template: str | None = None,
        pad_token_id: int | None = None,
        special_token_ids: Iterable[int] | None = None,
        core: ov.Core | None = None,
    ) -> None:
        core = core or ov.Core()
        tokenizer = _read(core, tokenizer_model)
        detokenizer = _read(core, detokenizer_model).clone()  # clone: we edit it below
        graph_skip_ids = _disable_graph_skip(detokenizer)
        self._special_ids = frozenset(special_token_ids if special_token_ids is not None else graph_skip_ids)
        self._eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self._bos_token_id = bos_token_id
        self._pad_token_id = pad_token_id
        self.chat_template = chat_template

        self._encoder = core.compile_model(tokenizer, "CPU").create_infer_request()
        self._decoder = core.compile_model(detokenizer, "CPU").create_infer_request()
        self._encode_lock = threading.Lock()
        self._decode_lock = threading.Lock()
        self.token_bytes = _token_bytes(core, detokenizer)

        # The graph always adds its template tokens (BOS...). Learn how many it puts before and
        # after the text, so add_special_tokens=False can cut exactly those off -- even when the
        # text itself starts with a literal "<s>".
        empty, probe = self._encode_all(""), self._encode_all("a")
        prefix = 0
        while prefix < len(empty) and prefix < len(probe) and empty[prefix] == probe[prefix]:
            prefix += 1
        self._added_prefix, self._added_suffix = prefix, len(empty) - prefix

    @classmethod
    def from_ir_dir(cls, path: str | PathLike, core: ov.Core | None = None) -> Tokenizer:
        """Load openvino_tokenizer.xml / openvino_detokenizer.xml as optimum-cli or
        openvino_tokenizers export them. Special ids and the chat template come from the
        tokenizer's rt_info (openvino-genai convention), else from the HF json files beside it;
        stop ids are the union of all of them (generation_config.json often lists several)."""
        path = Path(path)
        core = core or ov.Core()
        tokenizer = core.read_model(path / TOKENIZER_XML)
        configs = [
            _read_json(path / name) for name in ("generation_config.json", "config.json", "tokenizer_config.json")
        ]

        def found(key: str) -> list[Any]:
            rt_info = [_parse_rt_value(tokenizer.get_rt_info(key).value)] if tokenizer.has_rt_info(key) else []
            return [v for v in rt_info + [c.get(key) for c in configs] if v is not None]

        def lookup(key: str) -> Any:
            return next(iter(found(key)), None)

        eos_ids = [i for v in found("eos_token_id") for i in (v if isinstance(v, list) else [v])]
        chat_template = lookup("chat_template")
        if chat_template is None and (path / "chat_template.jinja").exists():
            chat_template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        tok = cls(
            tokenizer,
            path / DETOKENIZER_XML,
            eos_token_ids=eos_ids,
            bos_token_id=lookup("bos_token_id"),
            pad_token_id=lookup("pad_token_id"),
            chat_template=chat_template if isinstance(chat_template, str) else None,
            core=core,
        )
        # tokenizer_config.json names special tokens by text only
        if not tok._eos_token_ids and (eos_id := tok._token_id(lookup("eos_token"))) is not None:
            tok._eos_token_ids = (eos_id,)
        if tok._bos_token_id is None:
            tok._bos_token_id = tok._token_id(lookup("bos_token"))
        return tok

    @classmethod
    def from_gguf(cls, gguf_file: gguf.GGUFReader | str | PathLike, core: ov.Core | None = None) -> Tokenizer:
        """Build from the tokenizer in a GGUF file (a reader or a path)."""
        reader = gguf_file if isinstance(gguf_file, gguf.GGUFReader) else gguf.GGUFReader(gguf_file)
        meta = read_tokenizer_metadata(reader)
        tokenizer, detokenizer = build_tokenizer_models(reader)
        return cls(
            tokenizer,
            detokenizer,
            eos_token_ids=meta.eos_token_ids,
            bos_token_id=meta.bos_token_id,
            chat_template=meta.chat_template,
            pad_token_id=meta.pad_token_id,
            special_token_ids=meta.special_token_ids,
            core=core,
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_ids[0] if self._eos_token_ids else None

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._pad_token_id

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids that decode(skip_special_tokens=True) drops."""
        return self._special_ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._encode_all(text)
        if add_special_tokens:
            return ids
        return ids[self._added_prefix : len(ids) - self._added_suffix]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        with self._decode_lock:
            self._decoder.infer({0: np.asarray(ids, dtype=np.int64).reshape(1, -1)})
            return str(self._decoder.get_output_tensor(0).str_data[0])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            **variables: Any) -> str:
        """The prompt text for a conversation, as HF's apply_chat_template renders it: with
        `chat_template` instead of the model's, and `variables` (e.g. enable_thinking) for the
        template to read."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template")

        def text(token_id: int | None) -> str:
            return "" if token_id is None else self.decode([token_id], skip_special_tokens=False)

        fixed = {"bos_token": text(self.bos_token_id), "eos_token": text(self.eos_token_id)}
        if tools:
            fixed["tools"] = tools
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt, **{**variables, **fixed})

    def _token_id(self, token: Any) -> int | None:
        if isinstance(token, dict):  # {"content": "<s>", ...}
            token = token.get("content")
        if not isinstance(token, str):
            return None
        ids = self.encode(token, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def _encode_all(self, text: str) -> list[int]:
        with self._encode_lock:
            self._encoder.infer({0: np.array([text])})
            return self._encoder.get_tensor("input_ids").data[0].tolist()


def _read(core: ov.Core, model: ModelLike) -> ov.Model:
    return model if isinstance(model, ov.Model) else core.read_model(model)


def _disable_graph_skip(detokenizer: ov.Model) -> list[int]:
    """Empty the VocabDecoder's skip list and return it.

    The list is baked in as a constant (folded from openvino_tokenizers' Slice), so the graph can
    only ever skip or never skip. We make it never skip and filter the ids in Python instead,
    which lets every decode choose."""
    skip: list[int] = []
    for node in detokenizer.get_ordered_ops():
        if node.get_type_name() != "VocabDecoder" or node.get_input_size() < 5:
            continue
        source = node.input_value(4).get_node()
        if source.get_type_name() != "Constant":
            continue  # unknown layout: leave the graph's own behaviour alone
        skip += np.asarray(source.get_data()).reshape(-1).tolist()
        node.input(4).replace_source_output(ov.op.Constant(ov.Type.i32, ov.Shape([0]), []).output(0))
    detokenizer.validate_nodes_and_infer_types()
    return skip


def _token_bytes(core: ov.Core, detokenizer: ov.Model) -> list[bytes]:
    """The raw bytes each token id contributes to a text, for O(1) streaming detokenization.

    Decodes every id once, in one batched call, with UTF-8 validation bypassed (a byte-level
    token may hold half a character). Each id follows a fixed first token because decoders
    strip the leading space of a text's first token (SentencePiece), which a token mid-text keeps."""
    model = detokenizer.clone()
    for node in model.get_ordered_ops():
        if node.get_type_name() == "UTF8Validate":
            for out, src in zip(node.outputs(), node.input_values()):
                for target in out.get_target_inputs():
                    target.replace_source_output(src)
    model.validate_nodes_and_infer_types()
    request = core.compile_model(model, "CPU").create_infer_request()
    vocab = _vocab_size(model)
    # Any token whose text is not empty: only its own bytes are cut off again. (A text that ends
    # in NUL comes back without it, so a lone b"\0" token would look empty and cut nothing.)
    first, prefix = 0, b""
    for first in range(min(vocab, 256)):
        request.infer({0: np.array([[first]], dtype=np.int64)})
        if prefix := request.get_output_tensor(0).bytes_data[0]:
            break
    request.infer({0: np.stack([np.full(vocab, first, np.int64), np.arange(vocab, dtype=np.int64)], axis=1)})
    rows = request.get_output_tensor(0).bytes_data
    return [row[len(prefix):] if row.startswith(prefix) else row for row in rows]


def _vocab_size(detokenizer: ov.Model) -> int:
    decoder = next(n for n in detokenizer.get_ordered_ops() if n.get_type_name() == "VocabDecoder")
    return decoder.input_value(1).get_partial_shape()[0].get_length()


def _parse_rt_value(value: Any) -> Any:
    """rt_info read back from XML is a string: "2", "[2, 7]" or a template."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
