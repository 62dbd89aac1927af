"""What serving needs to know about a model: the graph's own facts, and from config.json only what
the graph cannot say (context length, sliding windows, RoPE for re-rotating keys after an
eviction, EOS ids).

Any decoder that optimum-cli exports and the PagedAttention transformation converts is served: no
list of architectures gates loading. Only cache rotation needs to know how an architecture applies
RoPE, and it is refused, clearly, where that is not known.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from vinoserve.model.config import rope_from_hf, sliding_windows_from_hf
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.graph_facts import GraphFacts
from vinoserve.model.rope import RopeConfig

# Families whose HF code rotates q and k rotate-half with inv_freq = 1 / theta^(2j/d) (then its
# scaling) over whole heads, one RoPE for every layer: what host and kernel re-rotation reproduce.
# Others (interleaved pairs, a RoPE per layer kind as in Gemma 3, layers without RoPE as in
# SmolLM3) may serve, but not evict with rotation. The mixtures of experts by the names a GGUF
# conversion writes (tests/test_moe_families.py) and their optimum exports' (tests/test_ir_moe.py).
ROTATE_HALF_ARCHITECTURES = ("granite", "llama", "mistral", "phi3", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "olmoe",
                             "qwen2_moe", "qwen3_moe", "mixtral")


@dataclass(frozen=True)
class ConfigFacts:
    """What config.json says that the graph cannot."""

    architecture: str  # model_type, for messages
    max_context: int
    rope: RopeConfig | None  # the model's main RoPE; None: `rope_unknown` says why
    rope_unknown: str
    sliding_windows: tuple[int, ...]  # per layer; empty where config.json names none
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ModelSpec(GraphFacts):
    architecture: str
    max_context: int
    rope: RopeConfig | None
    rope_unknown: str = ""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def of(cls, graph: GraphFacts, config: ConfigFacts) -> ModelSpec:
        # The graph's windows are what the kernel applies (set from the config's where it names any).
        said = {f.name: getattr(config, f.name) for f in fields(config) if f.name != "sliding_windows"}
        return cls(**{f.name: getattr(graph, f.name) for f in fields(graph)}, **said)

    def rotation_rope(self) -> RopeConfig:
        """The RoPE cache rotation re-applies to moved keys; ValueError where it is not known."""
        if self.architecture not in ROTATE_HALF_ARCHITECTURES:
            why = (f"vinoserve knows how {', '.join(ROTATE_HALF_ARCHITECTURES)} apply RoPE, "
                   f"not {self.architecture or 'this architecture'}")
        elif self.rope is None:
            why = self.rope_unknown
        elif self.rope.dim != self.head_size:
            why = f"RoPE turns {self.rope.dim} of {self.head_size} channels (partial rotary)"
        else:
            return self.rope
        raise ValueError(f"cache eviction re-rotates moved keys with the model's RoPE, which is not known here: "
                         f"{why}; turn rotation off (--no-rotation, or \"rotation\": false in a request's "
                         f"cache_eviction)")


def read_config(path: Path) -> ConfigFacts:
    """`path`'s config.json (and generation_config.json's EOS ids), read before the slow compile so
    that what is missing is said at once."""
    whole = read_json(path / "config.json", required=True)
    # A vision-language model's config (an image-text-to-text export's) holds its language model's
    # in text_config: context, RoPE, windows and the text model_type come from there
    d = whole.get("text_config") if isinstance(whole.get("text_config"), dict) else whole
    if not isinstance(d.get("max_position_embeddings"), int):
        raise ModelLoadError(f"{path}/config.json has no max_position_embeddings (the model's context length)")
    max_context = d["max_position_embeddings"]
    rope, unknown = None, ""
    try:
        rope = rope_from_hf(d, _head_size(d), max_context)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        unknown = f"config.json's RoPE cannot be read ({type(e).__name__}: {e})"
    layers = d.get("num_hidden_layers") or len(d.get("layer_types") or [])
    eos = [*_ids(d.get("eos_token_id")), *_ids(whole.get("eos_token_id") if whole is not d else None),
           *_ids(read_json(path / "generation_config.json").get("eos_token_id"))]
    return ConfigFacts(str(d.get("model_type", "")), max_context, rope, unknown,
                       sliding_windows_from_hf(d, layers, max_context) if layers else (),
                       d.get("bos_token_id", whole.get("bos_token_id")), tuple(dict.fromkeys(eos)))


def _head_size(d: dict) -> int:
    return int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])


def read_json(path: Path, required: bool = False) -> dict:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.parent} has no {path.name}")
        return {}
    try:
        d = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(d, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return d


def _ids(value) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else [] if value is None else [int(value)]
