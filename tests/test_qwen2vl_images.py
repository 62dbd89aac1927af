"""Qwen2.5-VL's M-RoPE in the paged engine at f32 against HF transformers: a tiny random
Qwen2_5_VLForConditionalGeneration generates greedily with its own image features and 3-D
positions (get_rope_index), and the engine, given the same features as ImageSpans with their
grids, gives the same tokens and logprobs: images of different shapes, one cut across prefill
chunks, text after them (whose positions run max(h, w) past each image, not h x w), decode
steps, n choices, the prefix cache and preemption. The language model is written as llama.cpp
writes Qwen2-VL's (architecture qwen2vl, rope.dimension_sections)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf_fixtures import tiny_hf_model, write_gguf
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.image_inputs import ImageRules
from vinoserve.model.loader import load_model
from vinoserve.scheduler import media
from vinoserve.scheduler.media import ImageSpan
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
IMAGE_TOKEN = 258  # any id of the tests' vocabulary does: the rows replace its embedding
SECTIONS = (2, 3, 3)  # of head size 16's 8 frequencies: every stream turns some
LOGPROB_ATOL = 1e-3
GRIDS = [(1, 4, 6), (1, 6, 2), (1, 2, 2)]  # (t, h, w) in patches: merged 2x3, 3x1 and 1x1 rows


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(HF Qwen2.5-VL, its language model's GGUF, per image: (key, HF's rows, pixels, grid_thw))."""
    text = tiny_hf_model("qwen2", heads=4, kv_heads=2)
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 40, "num_heads": 2, "out_hidden_size": 64,
              "patch_size": 14, "window_size": 56, "fullatt_block_indexes": [1]}
    text_cfg = {**text.config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                            "mrope_section": list(SECTIONS)}}
    cfg = Qwen2_5_VLConfig(text_config=text_cfg, vision_config=vision, image_token_id=IMAGE_TOKEN,
                           video_token_id=259, vision_start_token_id=257, tie_word_embeddings=False)
    torch.manual_seed(5)
    hf = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.model.visual.parameters():  # rows of the text model's scale, not ~0
            p.copy_(torch.randn_like(p) * 0.3)
    hf.model.language_model.load_state_dict(text.model.state_dict())
    hf.lm_head.load_state_dict(text.lm_head.state_dict())
    hf.generation_config.eos_token_id = None  # EOS just another token, as with ignore_eos
    path = write_gguf(text, tmp_path_factory.mktemp("qwen2vl") / "text.gguf", arch="qwen2", mrope_sections=SECTIONS)
    g = torch.Generator().manual_seed(9)
    images = []
    for i, grid in enumerate(GRIDS):
        pixels = torch.randn(grid[1] * grid[2], 3 * 2 * 14 * 14, generator=g)
        thw = torch.tensor([grid])
        with torch.no_grad():
            rows = hf.model.get_image_features(pixels, thw, return_dict=True).pooler_output[0]
        images.append((f"image-{i}".encode(), rows.numpy().astype(np.float32), pixels, thw))
    return hf, str(path), images


def _prompt(parts: list, images):
    """Token ids from `parts` (ids, or an image's index), the images' spans, and HF's inputs."""
    ids, spans, pixels, grids = [], [], [], []
    for part in parts:
        if isinstance(part, int):
            key, rows, px, thw = images[part]
            spans.append(ImageSpan(len(ids), rows, key, grid=(int(thw[0, 1]) // 2, int(thw[0, 2]) // 2)))
            ids += [IMAGE_TOKEN] * len(rows)
            pixels.append(px)
            grids.append(thw)
        else:
            ids += part
    return ids, spans, (torch.cat(pixels), torch.cat(grids)) if pixels else None


def _text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, IMAGE_TOKEN, n).tolist()


def _hf_generate(hf, ids: list[int], vision) -> tuple[list[int], list[float]]:
    kwargs = {"attention_mask": torch.ones(1, len(ids), dtype=torch.long)}  # else pad_token_id 0 masks token 0
    if vision is not None:
        kwargs |= {"pixel_values": vision[0], "image_grid_thw": vision[1],
                  "mm_token_type_ids": (torch.tensor([ids]) == IMAGE_TOKEN).int()}
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), **kwargs, max_new_tokens=MAX_TOKENS, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]


def _assert_as_hf(hf, prompts, outputs) -> None:
    for (ids, _, vision), out in zip(prompts, outputs):
        tokens, logprobs = _hf_generate(hf, ids, vision)
        assert out.token_ids == tokens
        np.testing.assert_allclose([lp for lp, _ in out.logprobs], logprobs, rtol=0, atol=LOGPROB_ATOL)


def _config(path: str, num_blocks: int = 64, budget: int = 16, prefix: bool | None = False) -> EngineConfig:
    return EngineConfig(model=path, compile=F32, num_kv_blocks=num_blocks, enable_prefix_caching=prefix,
                        image_inputs=True, scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget))


@pytest.fixture(scope="module")
def llm(qwen):
    return LLM(_config(qwen[1]), log=lambda m: None)


def test_images_of_several_shapes_and_text_after_them_equal_hf(qwen, llm):
    hf, _, images = qwen
    prompts = [_prompt([_text(1, 11), 0, _text(2, 20)], images),  # the image cut by the 16-token budget
               _prompt([_text(3, 3), 1, _text(4, 9), 2, [257], 0, _text(5, 6)], images),
               _prompt([_text(6, 30)], images)]
    outputs = llm.generate([p[0] for p in prompts], GREEDY, images=[p[1] for p in prompts])
    _assert_as_hf(hf, prompts, outputs)
    # the reference itself tells M-RoPE from plain positions: the same rows at plain positions differ
    ids, spans, _ = prompts[1]
    plain = [ImageSpan(s.offset, s.embeddings, s.key) for s in spans]
    assert llm.engine.model.paged.image_grids
    with pytest.raises(ValueError, match="needs each image's grid"):
        llm.generate(ids, GREEDY, images=[plain])


def test_choices_share_the_prefill_and_equal_hf(qwen, llm):
    hf, _, images = qwen
    prompt = _prompt([_text(13, 6), 1, _text(14, 12)], images)
    outputs = llm.generate(prompt[0], replace(GREEDY, n=2), images=[prompt[1]])
    _assert_as_hf(hf, [prompt, prompt], outputs)


def test_the_prefix_cache_reuses_an_image_and_the_text_after_it(qwen):
    hf, path, images = qwen
    engine = LLM(_config(path, budget=64, prefix=True), log=lambda m: None)
    block = engine.engine.blocks.block_size
    first = _prompt([_text(7, 5), 0, _text(8, 2 * block)], images)
    follow_up = _prompt([_text(7, 5), 0, _text(8, 2 * block), _text(9, 20)], images)
    prefix = engine.engine.blocks.prefix
    for p, hits in ((first, 0), (follow_up, 2 * block)):
        before = prefix.num_hit_tokens
        _assert_as_hf(hf, [p], engine.generate(p[0], GREEDY, images=[p[1]]))
        assert prefix.num_hit_tokens - before == hits


def test_preemption_recomputes_images_at_their_positions(qwen):
    hf, path, images = qwen
    prompts = [_prompt([_text(12 + i, 4), i, _text(20 + i, 52)], images) for i in range(3)]
    engine = LLM(_config(path, num_blocks=6, budget=64), log=lambda m: None)
    outputs = engine.generate([p[0] for p in prompts], GREEDY, images=[p[1] for p in prompts])
    assert engine.engine.scheduler.num_preemptions > 0
    _assert_as_hf(hf, prompts, outputs)


def test_positions_run_as_hf_get_rope_index(qwen):
    hf, _, images = qwen
    ids, spans, vision = _prompt([_text(1, 5), 0, _text(2, 4), 1, [257], 2, _text(3, 3)], images)
    spans = media.checked_spans(spans, len(ids), ImageRules(64, grids=True))
    theirs, delta = hf.model.get_rope_index(torch.tensor([ids]), (torch.tensor([ids]) == IMAGE_TOKEN).int(),
                                            image_grid_thw=vision[1])
    ours = media.rope_positions(spans, 0, len(ids))
    np.testing.assert_array_equal(ours, theirs[:, 0].numpy())
    assert media.rope_shift(spans, len(ids)) == int(delta)
    for start, stop in ((0, 7), (3, 20), (20, len(ids))):  # any chunk's positions are the whole's
        part = media.rope_positions(spans, start, stop)
        expected = ours[:, start:stop]
        if part is None:  # no image rows there: index + the shift of the images before
            assert (expected == np.arange(start, stop) + media.rope_shift(spans, start)).all()
        else:
            np.testing.assert_array_equal(part, expected)


def test_a_qwen2vl_file_without_three_sections_is_one_clear_error(qwen, tmp_path):
    text = tiny_hf_model("qwen2", heads=4, kv_heads=2)
    path = write_gguf(text, tmp_path / "bad.gguf", arch="qwen2", mrope_sections=(2, 3, 4))
    with pytest.raises(ModelLoadError, match="M-RoPE sections"):
        load_model(str(path), F32)
