"""Qwen2-VL / Qwen2.5-VL's language model: Qwen2 with M-RoPE, whose rotary frequencies turn in
three sections with a token's temporal, height and width position (`rope.dimension_sections`:
llama.cpp writes four counts, the fourth unused). On text the three positions agree and it is
plain RoPE; image rows get theirs from their place in the image (scheduler/media.py)."""
from __future__ import annotations

from dataclasses import replace

from vinoserve.model.architectures.qwen2 import Qwen2
from vinoserve.model.config import ModelConfig
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.gguf_file import GGUFMeta


class Qwen2VL(Qwen2):
    gguf_architecture = "qwen2vl"
    hf_model_type = "qwen2vl"
    hf_class = "Qwen2ForCausalLM"

    @classmethod
    def config_from_gguf(cls, meta: GGUFMeta) -> ModelConfig:
        cfg = super().config_from_gguf(meta)
        sections = [int(s) for s in meta.key("rope.dimension_sections") or ()]
        if len(sections) < 3 or any(sections[3:]):
            raise ModelLoadError(f"{meta.path}: qwen2vl.rope.dimension_sections {sections} is not three "
                                 "counts (temporal, height, width) and an unused fourth")
        try:
            return replace(cfg, rope=replace(cfg.rope, sections=tuple(sections[:3])))
        except ValueError as e:
            raise ModelLoadError(f"{meta.path}: {e}") from e
