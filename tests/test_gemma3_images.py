"""Gemma 3's images at f32 against HF's Gemma3ForConditionalGeneration, whose image rows attend
to each other both ways in prefill (token_type_ids): a tiny random model (SigLIP tower, Gemma 3
projector, the 6-layer Gemma 3 text model of the GGUF fixtures, sliding window 24, 16 rows an
image) generates greedily with its own image features; the engine, given the same features,
gives the same tokens with the same logprobs: one image and two, batched, an image the chunk
budget would cut (kept whole, even past a budget smaller than the image), a repeat from the
prefix cache and a prompt whose cached prefix would end inside an image (not taken), through
preemption. HF with the image rows left causal answers otherwise, so the comparison sees the
difference. The Gemma 3 projector loads only beside a language model compiled so."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_fixtures import FAMILIES, tiny_hf_model, write_gguf
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig
from vision_fixtures import pieces_fed, write_mmproj

from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.image_attention import TOKEN_TYPES
from vinoserve.scheduler import media
from vinoserve.scheduler.media import ImageSpan
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
IMAGE_TOKEN, BOI, EOI = 258, 256, 257  # ids inside the fixtures' vocabulary
ROWS = 16  # an image's rows: 8x8 patches pooled 2x2
LOGPROB_ATOL = 1e-3  # f32 on both sides; the tokens are compared exactly


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(HF Gemma 3, its text model's GGUF, its mmproj GGUF, per image: (key, HF's rows, pixels))."""
    spec = {k: v for k, v in FAMILIES["gemma3"].items() if k != "arch"}
    text = tiny_hf_model("gemma3", **spec)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=40, num_attention_heads=2, num_hidden_layers=1,
                                image_size=32, patch_size=4)
    cfg = Gemma3Config(vision_config=vision, text_config=text.config, mm_tokens_per_image=ROWS,
                       image_token_index=IMAGE_TOKEN, boi_token_index=BOI, eoi_token_index=EOI)
    torch.manual_seed(7)
    hf = Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF initialises the projection to zeros: rows of the text embeddings' scale instead
        proj = hf.model.multi_modal_projector
        proj.mm_input_projection_weight.copy_(torch.randn_like(proj.mm_input_projection_weight) * 0.3)
    hf.model.language_model.load_state_dict(text.model.state_dict())
    hf.lm_head.load_state_dict(text.lm_head.state_dict())
    hf.generation_config.eos_token_id = None  # EOS just another token, as with ignore_eos
    folder = tmp_path_factory.mktemp("gemma3")
    path = write_gguf(text, folder / "text.gguf", "gemma3")
    mmproj = write_mmproj(hf, folder / "mmproj.gguf")
    pixels = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        features = hf.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
    images = [(f"image-{i}".encode(), f.numpy().astype(np.float32), pixels[i:i + 1]) for i, f in enumerate(features)]
    return hf, str(path), mmproj, images


def _text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, BOI, n).tolist()


def _prompt(parts: list, images) -> tuple[list[int], list[ImageSpan], torch.Tensor | None]:
    """Token ids from `parts` (ids, or an image's index: BOI, its rows of image tokens, EOI as
    Gemma 3's processor lays them out), the spans of those images, their pixels in order."""
    ids, spans, pixels = [], [], []
    for part in parts:
        if isinstance(part, int):
            key, rows, px = images[part]
            ids.append(BOI)
            spans.append(ImageSpan(len(ids), rows, key))
            ids += [IMAGE_TOKEN] * len(rows) + [EOI]
            pixels.append(px)
        else:
            ids += part
    return ids, spans, torch.cat(pixels) if pixels else None


def _hf_generate(hf, ids: list[int], pixels: torch.Tensor | None, both_ways: bool = True):
    """HF's greedy tokens and their logprobs; `both_ways` False: the image rows left causal."""
    tensor = torch.tensor([ids])
    extra = {} if pixels is None else {"pixel_values": pixels}
    if both_ways:
        extra["token_type_ids"] = (tensor == IMAGE_TOKEN).long()
    with torch.no_grad():
        out = hf.generate(tensor, attention_mask=torch.ones_like(tensor), **extra, max_new_tokens=MAX_TOKENS,
                          do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]


def _llm(path: str, budget: int = 16, prefix: bool | None = False) -> LLM:
    scheduler = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget)
    return LLM(EngineConfig(model=path, compile=F32, num_kv_blocks=64, enable_prefix_caching=prefix,
                            image_inputs=True, scheduler=scheduler), log=lambda m: None)


def _assert_as_hf(hf, prompts, outputs) -> None:
    for (ids, _, pixels), out in zip(prompts, outputs):
        tokens, logprobs = _hf_generate(hf, ids, pixels)
        assert out.token_ids == tokens
        np.testing.assert_allclose([lp for lp, _ in out.logprobs], logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_hf_answers_otherwise_with_the_image_rows_left_causal(gemma3):
    hf, _, _, images = gemma3
    ids, _, pixels = _prompt([_text(1, 5), 0, _text(2, 6)], images)
    both = _hf_generate(hf, ids, pixels)
    causal = _hf_generate(hf, ids, pixels, both_ways=False)
    assert np.abs(np.array(both[1]) - np.array(causal[1])).max() > 20 * LOGPROB_ATOL


def test_one_and_two_images_batched_equal_hf_with_each_image_in_one_chunk(gemma3):
    hf, path, _, images = gemma3
    # budget 16, blocks of 32: the first chunk would end at 16, inside the image at 6..21
    prompts = [_prompt([_text(1, 5), 0, _text(2, 6)], images),
               _prompt([_text(3, 3), 1, _text(4, 4), 2, _text(5, 7)], images)]
    llm = _llm(path)
    assert TOKEN_TYPES in llm.engine.model.paged.input_names
    with pieces_fed(llm.engine.runner) as pieces:
        outputs = llm.generate([p[0] for p in prompts], GREEDY, images=[p[1] for p in prompts])
    assert pieces and all(n == ROWS for n in pieces)
    _assert_as_hf(hf, prompts, outputs)


def test_an_image_longer_than_the_budget_is_computed_whole(gemma3):
    hf, path, _, images = gemma3
    prompt = _prompt([_text(6, 9), 1, _text(7, 12)], images)
    llm = _llm(path, budget=8)
    with pieces_fed(llm.engine.runner) as pieces:
        outputs = llm.generate([prompt[0]], GREEDY, images=[prompt[1]])
    assert pieces == [ROWS]
    _assert_as_hf(hf, [prompt], outputs)


def test_a_repeat_hits_the_prefix_cache_and_a_hit_never_ends_inside_an_image(gemma3):
    hf, path, _, images = gemma3
    llm = _llm(path, budget=64, prefix=True)
    # the image at 21..36 crosses the first block's end (32)
    first = _prompt([_text(8, 20), 0, _text(9, 50)], images)
    same_start = _prompt([_text(8, 20), 0, _text(10, 50)], images)
    prefix = llm.engine.blocks.prefix
    hits = []
    for p in (first, first, same_start):
        before = prefix.num_hit_tokens
        outputs = llm.generate([p[0]], GREEDY, images=[p[1]])
        hits.append(prefix.num_hit_tokens - before)
        _assert_as_hf(hf, [p], outputs)
    assert hits[0] == 0 and hits[1] == 64  # both full blocks, the image inside the first two
    assert hits[2] == 0  # only the first block matches, and it ends inside the image


def test_preemption_recomputes_each_image_whole(gemma3):
    hf, path, _, images = gemma3
    # 60 tokens each, 68 by the end: 18 blocks across its layer groups (global and windowed), 20 in all
    prompts = [_prompt([_text(12 + i, 4), i, _text(20 + i, 38)], images) for i in range(3)]
    llm = LLM(EngineConfig(model=path, compile=F32, num_kv_blocks=20, enable_prefix_caching=False, image_inputs=True,
                           scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)), log=lambda m: None)
    with pieces_fed(llm.engine.runner) as pieces:
        outputs = llm.generate([p[0] for p in prompts], GREEDY, images=[p[1] for p in prompts])
    assert llm.engine.scheduler.num_preemptions > 0 and set(pieces) == {ROWS}
    _assert_as_hf(hf, prompts, outputs)


def test_images_longer_than_the_sliding_window_are_refused(gemma3):
    _, path, _, _ = gemma3
    llm = _llm(path)
    rows = np.zeros((25, 64), np.float32)  # the window is 24
    with pytest.raises(ValueError, match="at most 24 rows"):
        llm.generate([_text(11, 30)], GREEDY, images=[[ImageSpan(2, rows, b"long")]])


def test_the_gemma3_projector_loads_beside_gemma3_only(gemma3, tmp_path):
    _, path, mmproj, _ = gemma3
    llm = LLM(EngineConfig(model=path, mmproj=str(mmproj), compile=F32, num_kv_blocks=16), log=lambda m: None)
    assert llm.engine.model.vision.projector == "gemma3"
    llama = write_gguf(tiny_hf_model("llama"), tmp_path / "llama.gguf")
    with pytest.raises(ModelLoadError, match="both ways"):
        LLM(EngineConfig(model=str(llama), mmproj=str(mmproj), compile=F32, num_kv_blocks=16), log=lambda m: None)


def test_chunks_end_before_or_after_an_image_whose_rows_attend_both_ways():
    rows = np.zeros((10, 4), np.float32)
    spans = (ImageSpan(5, rows, b"a", bidirectional=True), ImageSpan(30, rows, b"b"))
    assert media.whole_images_end(spans, 0, 8) == 5  # cut back to the image's start
    assert media.whole_images_end(spans, 5, 8) == 15  # the image starts the chunk: all of it
    assert media.whole_images_end(spans, 0, 15) == 15
    assert media.whole_images_end(spans, 20, 33) == 33  # a causal image may be cut
    assert media.inside_whole_image(spans, 6) and not media.inside_whole_image(spans, 5)
    assert not media.inside_whole_image(spans, 15) and not media.inside_whole_image(spans, 31)
