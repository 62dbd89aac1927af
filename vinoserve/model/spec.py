"""What serving needs to know about a model: the graph's own facts, and from config.json only what
the graph cannot say (context length, RoPE for re-rotating keys after an eviction, EOS ids).

Any decoder that optimum-cli exports and the PagedAttention transformation converts is served: no
list of architectures gates loading. Only cache rotation needs to know how an architecture applies
RoPE, and it is refused, clearly, where that is not known.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from vinoserve.model.errors import ModelLoadError
from vinoserve.model.graph_facts import GraphFacts
from vinoserve.model.rope import RopeConfig

# Families whose HF code rotates q and k rotate-half with inv_freq = 1 / theta^(2j/d) (then
# rope_scaling) over head_dim * partial_rotary_factor channels, one RoPE for every layer: what host
# and kernel re-rotation reproduce. Others (interleaved pairs, per-layer bases as in Gemma 3, layers
# without RoPE as in SmolLM3) may serve, but not evict with rotation.
ROTATE_HALF_ARCHITECTURES = ("granite", "llama", "mistral", "phi3", "qwen2", "qwen3")


@dataclass(frozen=True, kw_only=True)
class ModelSpec(GraphFacts):
    architecture: str  # config.json's model_type, for messages
    max_context: int
    rope: RopeConfig | None  # the keys' RoPE as re-rotation needs it; None: `rope_unknown` says why
    rope_unknown: str = ""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()


def read_config(path: Path) -> dict:
    """`path`'s config.json, checked for what serving needs before the (slow) compile."""
    d = _read_json(path / "config.json", required=True)
    if not isinstance(d.get("max_position_embeddings"), int):
        raise ModelLoadError(f"{path}/config.json has no max_position_embeddings (the model's context length)")
    return d


def build_spec(path: Path, config: dict, facts: GraphFacts) -> ModelSpec:
    """The config beside what the graph said; generation_config.json may add EOS ids."""
    _check_windows(config, facts, path)
    rope, unknown = _rope(config, facts.head_size)
    eos = [*_ids(config.get("eos_token_id")), *_ids(_read_json(path / "generation_config.json").get("eos_token_id"))]
    return ModelSpec(**asdict(facts), architecture=str(config.get("model_type", "")),
                     max_context=config["max_position_embeddings"], rope=rope, rope_unknown=unknown,
                     bos_token_id=config.get("bos_token_id"), eos_token_ids=tuple(dict.fromkeys(eos)))


def _read_json(path: Path, required: bool = False) -> dict:
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


def _check_windows(d: dict, facts: GraphFacts, path: Path) -> None:
    """config.json's layer_types name each layer's attention; the transformation must have given
    every sliding layer its window, or outputs past the window would not be the model's."""
    kinds, window = d.get("layer_types"), d.get("sliding_window")
    if not isinstance(kinds, list) or len(kinds) != facts.num_layers:
        return
    for i, (kind, got) in enumerate(zip(kinds, facts.sliding_windows)):
        want = int(window or 0) if kind == "sliding_attention" else 0
        if got != want:
            raise ModelLoadError(
                f"{path}: layer {i} is {kind} in config.json (window {want or 'none'}) but the PagedAttention "
                f"transformation gave it window {got or 'none'}: it would not compute what the model does")


def _rope(d: dict, head_size: int) -> tuple[RopeConfig | None, str]:
    arch = d.get("model_type")
    if arch not in ROTATE_HALF_ARCHITECTURES:
        return None, (f"RoPE of architecture {arch!r} is not known to vinoserve "
                      f"(known: {', '.join(ROTATE_HALF_ARCHITECTURES)})")
    # transformers >= 5 folds theta, scaling and the partial factor into one rope_parameters dict.
    params = d.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):
        return None, "config.json gives a RoPE per layer type"
    scaling = d.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    factor = float(params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)))
    factors = d.get("vinoserve_rope_freq_factors")  # our GGUF conversions: Llama 3.1's rope_freqs
    try:
        rope = RopeConfig(theta=float(params.get("rope_theta", d.get("rope_theta", 10000.0))),
                          dim=int(head_size * factor), scaling=scaling,
                          freq_factors=tuple(factors) if factors else None)
    except ValueError as e:
        return None, str(e)
    if rope.dim != head_size:
        return None, f"RoPE turns {rope.dim} of {head_size} channels (partial rotary)"
    return rope, ""
