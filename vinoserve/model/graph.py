"""A GGUF model's OpenVINO graph, built by its architecture (model/architectures/) over the
shared blocks (model/blocks.py), with weight matrices in the chosen format (model/weights.py)."""
from __future__ import annotations

import openvino as ov

from vinoserve.model import architectures
from vinoserve.model.architectures import WeightSource
from vinoserve.model.config import ModelConfig
from vinoserve.model.weights import WeightFormat, Weights


def build_model(cfg: ModelConfig, weight: WeightSource, weight_format: WeightFormat = "f16") -> ov.Model:
    """Stateful decoder graph: logits [B, L, V] f32 from input_ids/attention_mask/position_ids/beam_idx.
    `weight` gives tensors by GGUF name, rows in HF order (GGUFModel.tensor)."""
    family = architectures.for_gguf(cfg.architecture)
    return family(cfg, weight, Weights.of(weight_format)).build()
