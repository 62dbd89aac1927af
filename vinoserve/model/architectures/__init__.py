"""The model families a GGUF may hold, one file each, registered under their GGUF
`general.architecture` (see decoder.py for what a family says)."""
from __future__ import annotations

from vinoserve.model.architectures.decoder import Decoder, WeightSource
from vinoserve.model.architectures.gemma3 import Gemma3
from vinoserve.model.architectures.gpt_oss import GptOss
from vinoserve.model.architectures.llama import Llama
from vinoserve.model.architectures.olmoe import Olmoe
from vinoserve.model.architectures.phi3 import Phi3
from vinoserve.model.architectures.qwen2 import Qwen2
from vinoserve.model.architectures.qwen2moe import Qwen2Moe
from vinoserve.model.architectures.qwen2vl import Qwen2VL
from vinoserve.model.architectures.qwen3 import Qwen3
from vinoserve.model.architectures.qwen3moe import Qwen3Moe
from vinoserve.model.errors import ModelLoadError

FAMILIES: tuple[type[Decoder], ...] = (Llama, Qwen2, Qwen3, Gemma3, Phi3, Qwen3Moe, Qwen2Moe, Olmoe, GptOss,
                                       Qwen2VL)
_BY_GGUF = {f.gguf_architecture: f for f in FAMILIES}

__all__ = ["FAMILIES", "Decoder", "WeightSource", "for_gguf"]


def for_gguf(architecture: str | None) -> type[Decoder]:
    family = _BY_GGUF.get(architecture)
    if family is None:
        raise ModelLoadError(f"unsupported architecture {architecture!r}; supported: {', '.join(_BY_GGUF)} "
                             "(Mistral's and Mixtral's GGUFs are llama)")
    return family
