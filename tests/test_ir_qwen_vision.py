"""Qwen2.5-VL and Qwen2-VL served from an `optimum-cli export openvino --task image-text-to-text`
directory (issue 58): a tiny random model of each exported by optimum-intel's main_export, loaded
by path alone. The export's language model takes M-RoPE's three position streams as position_ids
[3, B, L], which the PagedAttention transformation keeps as [3, tokens]; the runner feeds the
streams the scheduler computes from each image's grid. Its two vision models (patches, then the
layers and merger with the per-size inputs HF computes in Python) run as one graph. At f32, greedy
tokens and their logprobs equal transformers' generate with one image and with two of different
shapes, text after each; 2.5-VL's images span several attention windows. The one-token
clone of such a graph keeps the three streams."""
from __future__ import annotations

import io

import numpy as np
import openvino as ov
import pytest
import torch
from PIL import Image

from ir_vlm_fixtures import QWEN_FAMILIES, exports, f32_llm, image_processor, png, served
from vinoserve.model import one_token
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.paged import to_paged
from vinoserve.model.vlm_export import read_language_model
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.server.images import MARKER

pytestmark = pytest.mark.ir
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
LOGPROB_ATOL = 1e-3  # f32 on both sides; the tokens are compared exactly
# (width, height) -> its rows at 8..64 merged rows an image: resized to 112 x 84 px (3 x 4 merged
# rows: 2.5-VL's 56 px windows cut it in four) and 56 x 140 px (5 x 2)
WIDE, TALL = (50, 37), (40, 90)
ROWS = {WIDE: 12, TALL: 10}


@pytest.fixture(scope="module")
def qwen(ir_export, tmp_path_factory):
    """family -> (HF model, its export's directory); ir_export skips where optimum-intel is missing."""
    return exports(tmp_path_factory)


def _hf_generate(family: str, hf, ids: list[int], pngs: list[bytes]) -> tuple[list[int], list[float]]:
    pixels = image_processor(family)([Image.open(io.BytesIO(p)) for p in pngs], return_tensors="pt")
    tensor = torch.tensor([ids])
    # which tokens are an image's, as Qwen2VLProcessor returns them: without it HF places the
    # image rows as text
    types = (tensor == hf.config.image_token_id).int()
    with torch.no_grad():
        out = hf.generate(tensor, attention_mask=torch.ones_like(tensor), pixel_values=pixels.pixel_values,
                          image_grid_thw=pixels.image_grid_thw, mm_token_type_ids=types, max_new_tokens=MAX_TOKENS,
                          do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]


@pytest.mark.parametrize("family", QWEN_FAMILIES)
def test_one_and_two_images_of_different_shapes_equal_transformers(family, qwen):
    hf, ir = qwen(family)
    llm = f32_llm(ir)
    model = llm.engine.model
    assert model.paged.image_grids and model.vision.projector == {"qwen2_vl": "qwen2vl_merger"}.get(
        family, "qwen2.5vl_merger")
    first, second = png(1, WIDE), png(2, TALL)
    cases = [(f"the t {MARKER} he th", [first]), (f"he {MARKER} t{MARKER} the", [second, first])]
    prompts = [served(llm, text, pngs) for text, pngs in cases]
    image_id = hf.config.image_token_id
    assert [p.ids.count(image_id) for p in prompts] == [ROWS[WIDE], ROWS[TALL] + ROWS[WIDE]]
    outputs = llm.generate([p.ids for p in prompts], GREEDY, images=[list(p.images) for p in prompts])
    for prompt, (_, pngs), out in zip(prompts, cases, outputs):
        tokens, logprobs = _hf_generate(family, hf, prompt.ids, pngs)
        assert out.token_ids == tokens
        np.testing.assert_allclose([lp for lp, _ in out.logprobs], logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_the_one_token_clone_takes_three_position_rows(qwen):
    """The kernel compilation's one-token clone (model/one_token.py) of such a graph: position_ids
    [3, 1], the token's three streams, where other graphs' is [1]."""
    _, ir = qwen("qwen2_5_vl")
    model = read_language_model(ov.Core(), ir)
    to_paged(model, CompileOptions())
    shapes = {i.get_any_name(): i.get_partial_shape() for i in one_token.graph(model).inputs}
    assert shapes["position_ids"] == ov.PartialShape([3, 1]) and shapes["input_ids"] == ov.PartialShape([1])
