"""Llama (2, 3.x with its RoPE scaling, TinyLlama, SmolLM2), Mistral and Mixtral, whose GGUFs are
`llama`: the common decoder, Mixtral's FFN a mixture of experts (`expert_count`) whose top-k
weights are renormalised (llama.cpp's src/models/llama.cpp). llama.cpp's converter permutes Q/K
rows for its GPT-J-style RoPE."""
from __future__ import annotations

from vinoserve.model.architectures.decoder import Decoder
from vinoserve.model.config import ModelConfig
from vinoserve.model.gguf_file import GGUFTensor


class Llama(Decoder):
    expert_weights_norm = True

    @classmethod
    def from_file(cls, t: GGUFTensor, cfg: ModelConfig) -> GGUFTensor:
        if ".attn_q." in t.name or ".attn_k." in t.name:
            heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
            return unpermute_rows(t, heads)
        return t


def unpermute_rows(t: GGUFTensor, heads: int) -> GGUFTensor:
    """Undo convert_hf_to_gguf's `permute`, back to HF's rotate-half row order. Rows are whole
    quant blocks, so this is the same for every type."""
    w, rows = t.data, t.data.shape[0]
    return t.with_rows(w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))
