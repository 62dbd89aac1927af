"""Build OpenVINO tokenizer/detokenizer models from the tokenizer a GGUF file carries.

A GGUF has no tokenizer.json, only llama.cpp's `tokenizer.ggml.*` metadata. We assemble the
same openvino_tokenizers pipeline steps that its HF converter would, but from that metadata, so
serving needs neither transformers nor torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf
import openvino as ov
from openvino.preprocess import PrePostProcessor
from openvino_tokenizers.constants import MIN_CACHE_CAPACITY, UTF8ReplaceMode
from openvino_tokenizers.tokenizer_pipeline import (
    AddToken,
    BPETokenizationStep,
    ByteFallbackStep,
    BytesToCharsStep,
    CombineSegmentsStep,
    FuseStep,
    PaddingStep,
    RegexDecodingStep,
    RegexNormalizationStep,
    RegexSplitStep,
    Sequence,
    SpecialTokensSplit,
    TokenizerPipeline,
    UTF8ValidateStep,
    VocabDecoderStep,
)
from openvino_tokenizers.utils import apply_unicode_to_bytes

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = (
    gguf.TokenType.NORMAL, gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED
)
# Matched whole in the text before any splitting (llama.cpp's tokenizer_st_partition does the same)
_ADDED_TYPES = (CONTROL, USER_DEFINED, UNKNOWN)

# Split regexes for byte-level BPE, as llama.cpp (src/llama-vocab.cpp) and the models'
# tokenizer.json files use them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> the regexes that split the text, applied one after the other like
# llama.cpp's regex_exprs. 'default' follows transformers (plain GPT-2 regex), not llama.cpp's
# odd fallback set.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(["default", "gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais"], (_GPT2,)),
    # HF: Digits(individual_digits=True) then ByteLevel. Two separate splits, not one merged
    # alternation: "  1" must give "  ", "1" (as HF and llama.cpp do), not " ", " ", "1".
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"], (r"\p{N}", _GPT2)
    ),
    **dict.fromkeys(
        [
            "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
            "dbrx", "smaug-bpe", "chatglm-bpe", "glm4",
        ],
        (_LLAMA3,),
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"], (_QWEN2,)),
    **dict.fromkeys(["gpt-4o", "llama4"], (_GPT4O,)),
}
SUPPORTED_MODELS = ("gpt2", "llama")


@dataclass(frozen=True)
class TokenizerMetadata:
    """The tokenizer part of a GGUF's metadata (llama.cpp key names in comments)."""

    model: str  # tokenizer.ggml.model: 'gpt2' (byte-level BPE) or 'llama' (SentencePiece BPE)
    pre: str | None  # tokenizer.ggml.pre
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None  # "left right", byte-level models only
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    eot_token_id: int | None
    eom_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    add_space_prefix: bool
    chat_template: str | None

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation (llama.cpp's end-of-generation set, minus text guessing)."""
        ids = [self.eos_token_id, self.eot_token_id, self.eom_token_id]
        if "<|call|>" in self.tokens and "<|return|>" in self.tokens:
            # gpt-oss (OpenAI's harmony format): a reply ends with <|return|> or, to call a tool,
            # <|call|> (its generation_config's eos ids, llama.cpp's end-of-generation set); its GGUF
            # names only the first. <|end|> only closes a message (the reasoning) within a reply.
            end = self.tokens.index("<|end|>") if "<|end|>" in self.tokens else None
            ids = [i for i in ids if i != end] + [self.tokens.index("<|return|>"), self.tokens.index("<|call|>")]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @property
    def special_token_ids(self) -> list[int]:
        """Ids a decode with skip_special_tokens drops: what HF counts as special for a GGUF."""
        ids = [i for i, t in enumerate(self.token_types) if t in (CONTROL, UNKNOWN)]
        named = (self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id)
        ids += [i for i in named if i is not None]
        return sorted(set(ids))

    @property
    def added_tokens(self) -> dict[str, int]:
        """Tokens matched whole in the input text before any splitting, as llama.cpp does."""
        return {
            token: i
            for i, (token, t) in enumerate(zip(self.tokens, self.token_types))
            if t in _ADDED_TYPES and token
        }


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return None
    if field.types[0] == gguf.GGUFValueType.ARRAY and field.types[-1] == gguf.GGUFValueType.STRING:
        # contents() decodes strictly; a stray invalid byte in a token must not make the file unreadable
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
    return field.contents()


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def read_tokenizer_metadata(reader: gguf.GGUFReader) -> TokenizerMetadata:
    model = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise ValueError("GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens missing)")
    token_types = _field(reader, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    scores = _field(reader, "tokenizer.ggml.scores")
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    add_space_prefix = _field(reader, "tokenizer.ggml.add_space_prefix")
    return TokenizerMetadata(
        model=model,
        pre=_field(reader, "tokenizer.ggml.pre"),
        tokens=tokens,
        token_types=[int(t) for t in token_types],
        scores=None if scores is None else [float(s) for s in scores],
        merges=_field(reader, "tokenizer.ggml.merges"),
        bos_token_id=_optional_int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_token_id=_optional_int(_field(reader, "tokenizer.ggml.eos_token_id")),
        unk_token_id=_optional_int(_field(reader, "tokenizer.ggml.unknown_token_id")),
        pad_token_id=_optional_int(_field(reader, "tokenizer.ggml.padding_token_id")),
        eot_token_id=_optional_int(_field(reader, "tokenizer.ggml.eot_token_id")),
        eom_token_id=_optional_int(_field(reader, "tokenizer.ggml.eom_token_id")),
        # llama.cpp's defaults when the key is absent: SentencePiece vocabularies add BOS and a
        # prefix space, byte-level ones do neither.
        add_bos_token=bool(add_bos) if add_bos is not None else model == "llama",
        add_eos_token=bool(_field(reader, "tokenizer.ggml.add_eos_token") or False),
        add_space_prefix=bool(add_space_prefix) if add_space_prefix is not None else model == "llama",
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def merges_from_scores(tokens: list[str], scores: list[float], skip: set[int]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges, implied by the vocabulary: every split of a token into two
    tokens, ranked by the merged token's score. Same order as transformers' generate_merges,
    so ties break the way the HF reference does."""
    vocab = {token: i for i, token in enumerate(tokens) if i not in skip}
    merges = []
    for token, token_id in vocab.items():
        local = [
            (token[:k], token[k:], scores[token_id])
            for k in range(1, len(token))
            if token[:k] in vocab and token[k:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _cache_size(meta: TokenizerMetadata) -> int:
    # the BPE op's word cache, sized as openvino_tokenizers' HF converter sizes it
    return max(len(meta.tokens) // 5, MIN_CACHE_CAPACITY)


def _byte_level_steps(meta: TokenizerMetadata) -> tuple[list, VocabDecoderStep]:
    if meta.pre not in PRE_TOKENIZER_SPLITS:
        raise ValueError(
            f"Unsupported tokenizer.ggml.pre {meta.pre!r} for a byte-level ('gpt2') GGUF tokenizer; "
            f"supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    if meta.merges is None:
        raise ValueError("Byte-level GGUF tokenizer has no tokenizer.ggml.merges")
    added = meta.added_tokens
    steps = [
        # mergeable=False: TokenizerPipeline would otherwise fold consecutive splits into one regex
        *(RegexSplitStep(regex, behaviour="isolate", mergeable=False) for regex in PRE_TOKENIZER_SPLITS[meta.pre]),
        # Only marks the pipeline byte-level: BPETokenizationStep.finalize turns the vocab into
        # raw bytes and drops this step.
        BytesToCharsStep(),
        BPETokenizationStep(
            vocab=list(meta.tokens), merges=list(meta.merges), added_tokens=added, cache_capacity=_cache_size(meta)
        ),
    ]
    # Normal tokens are spelled in GPT-2's byte alphabet; added tokens are plain text.
    decoder_vocab = [
        token.encode() if token_type in _ADDED_TYPES else apply_unicode_to_bytes(token, True)
        for token, token_type in zip(meta.tokens, meta.token_types)
    ]
    return steps, VocabDecoderStep(vocab=decoder_vocab, skip_tokens=meta.special_token_ids)


def _sentencepiece_steps(meta: TokenizerMetadata) -> tuple[list, list, VocabDecoderStep]:
    if meta.scores is None:
        raise ValueError("SentencePiece ('llama') GGUF tokenizer has no tokenizer.ggml.scores")
    added = meta.added_tokens
    skip = set(added.values())  # a special token is never the result of a merge
    unk = meta.tokens[meta.unk_token_id] if meta.unk_token_id is not None else ""
    # HF's Metaspace(prepend_scheme="first"): "▁" before the text unless it starts with a space
    # (TokenizerPipeline then also skips it when the text starts with a special token).
    prefix = [RegexNormalizationStep.prepend_with_check_regex("▁", " ")] if meta.add_space_prefix else []
    steps = [
        RegexNormalizationStep.replace_spaces_metaspace("▁"),
        BPETokenizationStep(
            vocab=list(meta.tokens),
            merges=merges_from_scores(meta.tokens, meta.scores, skip),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
            added_tokens=added,
            cache_capacity=_cache_size(meta),
        ),
    ]
    return prefix, steps, VocabDecoderStep(vocab=list(meta.tokens), skip_tokens=meta.special_token_ids)


def _decoding_steps(meta: TokenizerMetadata, vocab_decoder: VocabDecoderStep) -> list:
    if meta.model == "gpt2":
        return [vocab_decoder, FuseStep(), UTF8ValidateStep(UTF8ReplaceMode.REPLACE)]
    steps = [
        vocab_decoder,
        RegexDecodingStep.replace_sp_spaces(),
        ByteFallbackStep(),
        FuseStep(),
        UTF8ValidateStep(UTF8ReplaceMode.REPLACE),
    ]
    if meta.add_space_prefix:
        steps.append(RegexDecodingStep.strip_forward_space())
    return steps


def _keep_outputs(model: ov.Model, names: tuple[str, ...]) -> ov.Model:
    # CombineSegments also yields token_type_ids; convert_tokenizer drops them for decoder LLMs
    outputs = [next(o for o in model.outputs if name in o.names) for name in names]
    return ov.Model(outputs, model.get_parameters(), model.get_friendly_name())


def _set_output_type(model: ov.Model, element_type: ov.Type) -> ov.Model:
    ppp = PrePostProcessor(model)
    for i in range(len(model.outputs)):
        ppp.output(i).tensor().set_element_type(element_type)
    return ppp.build()


def _set_input_type(model: ov.Model, element_type: ov.Type) -> ov.Model:
    ppp = PrePostProcessor(model)
    for i in range(len(model.inputs)):
        ppp.input(i).tensor().set_element_type(element_type)
    return ppp.build()


def build_tokenizer_models(reader: gguf.GGUFReader) -> tuple[ov.Model, ov.Model]:
    """(tokenizer, detokenizer) OpenVINO models for the GGUF's tokenizer.

    The tokenizer maps a string batch [B] to i64 `input_ids` and `attention_mask` [B, T],
    adding BOS when the file asks for it. The detokenizer maps i64 ids [B, T] to strings and,
    like openvino_tokenizers' default export, skips special tokens; the skip list is a constant
    input of its VocabDecoder, which vinoserve.model.tokenizer empties to choose per call.
    The models' rt_info carries bos/eos/pad ids and the chat template, as openvino-genai expects.
    """
    meta = read_tokenizer_metadata(reader)
    if meta.model == "gpt2":
        prefix, (model_steps, vocab_decoder) = [], _byte_level_steps(meta)
    elif meta.model == "llama":
        prefix, model_steps, vocab_decoder = _sentencepiece_steps(meta)
    else:
        raise ValueError(
            f"Unsupported tokenizer.ggml.model {meta.model!r}; supported: {', '.join(SUPPORTED_MODELS)}"
        )

    bos = []
    if meta.add_bos_token and meta.bos_token_id is not None:
        bos = [AddToken(token=meta.tokens[meta.bos_token_id], _token_id=meta.bos_token_id)]
    pipeline = TokenizerPipeline()
    pipeline.add_steps(
        [
            *prefix,  # must be the first step: TokenizerPipeline applies it before the special split
            SpecialTokensSplit.from_string_iter(meta.added_tokens),
            *model_steps,
            CombineSegmentsStep([*bos, Sequence()]),
            PaddingStep(token=None, _token_id=meta.pad_token_id or 0),
            *_decoding_steps(meta, vocab_decoder),
        ]
    )
    tokenizer = _keep_outputs(pipeline.get_tokenizer_ov_subgraph(), ("input_ids", "attention_mask"))
    tokenizer = _set_output_type(tokenizer, ov.Type.i64)
    detokenizer = _set_input_type(pipeline.get_detokenizer_ov_subgraph(), ov.Type.i64)

    for model in (tokenizer, detokenizer):
        for name, value in (
            ("bos_token_id", meta.bos_token_id),
            ("eos_token_id", meta.eos_token_id),
            ("pad_token_id", meta.pad_token_id),
            ("chat_template", meta.chat_template),
        ):
            if value is not None:
                model.set_rt_info(value, name)
        model.set_rt_info(str(meta.add_bos_token), "add_bos_token")
    return tokenizer, detokenizer
