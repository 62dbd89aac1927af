"""Image rows in the paged engine at f32 against HF transformers: a tiny random LLaVA (CLIP vision
tower, projector, Llama text model; the text model written as llama.cpp writes it) generates
greedily with HF's own image features, and the engine, given the same features as ImageSpans at
the image tokens' positions, gives the same tokens with the same logprobs: one image and two, an
image cut across prefill chunks, beside a text-only request, n choices on one prefill, through
the async engine, from the prefix cache (the same image hits, another image of the same size
does not), and through preemption. Gemma 3's rows go in after its embedding scale; the kernel's
one-token clone takes none. A text-only engine's graph takes no image inputs."""
from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import numpy as np
import openvino as ov
import pytest
import torch
from gguf_fixtures import FAMILIES, family_gguf, tiny_hf_model, write_gguf
from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration
from vision_fixtures import pieces_fed

from vinoserve.engine.async_engine import AsyncLLMEngine
from vinoserve.engine.llm import LLM
from vinoserve.engine.llm_engine import EngineConfig, LLMEngine
from vinoserve.model import cpu_defaults
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.cpu_class import CpuClass
from vinoserve.model.image_inputs import IMAGE_EMBEDS, IMAGE_ROWS, ImageRules
from vinoserve.scheduler import media
from vinoserve.scheduler.media import ImageSpan
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.scheduler.scheduler import SchedulerConfig

F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
IMAGE_TOKEN = 258  # "<|endoftext|>" of the tests' vocabulary: any id inside it does
LOGPROB_ATOL = 1e-3  # f32 on both sides; the tokens are compared exactly
LOWBIT_MODEL = str(Path(__file__).parent / "data" / "llamacpp-tiny-llama-Q4_K_M.gguf")


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """(HF LLaVA, its text model's GGUF, per image: (key, HF's features [rows, hidden], pixels))."""
    text = tiny_hf_model("llama")
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                              image_size=16, patch_size=4)
    cfg = LlavaConfig(vision_config=vision, text_config=text.config, image_token_index=IMAGE_TOKEN,
                      vision_feature_layer=-1, vision_feature_select_strategy="default")
    torch.manual_seed(5)
    hf = LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for p in hf.model.multi_modal_projector.parameters():  # rows of the text model's scale, not ~0
            p.copy_(torch.randn_like(p) * 0.3)
    hf.model.language_model.load_state_dict(text.model.state_dict())
    hf.lm_head.load_state_dict(text.lm_head.state_dict())
    hf.generation_config.eos_token_id = None  # EOS just another token, as with ignore_eos
    path = write_gguf(text, tmp_path_factory.mktemp("llava") / "text.gguf")
    pixels = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        features = hf.model.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
    images = [(f"image-{i}".encode(), f.numpy().astype(np.float32), pixels[i:i + 1]) for i, f in enumerate(features)]
    return hf, str(path), images


def _prompt(parts: list, images) -> tuple[list[int], list[ImageSpan], torch.Tensor | None]:
    """Token ids from `parts` (a list of ids, or an image's index: its rows of image tokens), the
    spans of those images, and their pixels in order (HF's input)."""
    ids, spans, pixels = [], [], []
    for part in parts:
        if isinstance(part, int):
            key, rows, px = images[part]
            spans.append(ImageSpan(len(ids), rows, key))
            ids += [IMAGE_TOKEN] * len(rows)
            pixels.append(px)
        else:
            ids += part
    return ids, spans, torch.cat(pixels) if pixels else None


def _text(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, IMAGE_TOKEN, n).tolist()


def _hf_generate(hf, ids: list[int], pixels: torch.Tensor | None) -> tuple[list[int], list[float]]:
    """HF's greedy tokens and each one's logprob (EOS just another token, as with ignore_eos)."""
    vision = {} if pixels is None else {"pixel_values": pixels}  # None: HF's LLaVA runs its tower on nothing
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), **vision, max_new_tokens=MAX_TOKENS, do_sample=False,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def _config(path: str, num_blocks: int = 64, budget: int = 16, prefix: bool | None = None,
            images: bool = True) -> EngineConfig:
    return EngineConfig(model=path, compile=F32, num_kv_blocks=num_blocks, enable_prefix_caching=prefix,
                        image_inputs=images, scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget))


def _assert_as_hf(hf, prompts, outputs) -> None:
    for (ids, _, pixels), out in zip(prompts, outputs):
        tokens, logprobs = _hf_generate(hf, ids, pixels)
        assert out.token_ids == tokens
        np.testing.assert_allclose([lp for lp, _ in out.logprobs], logprobs, rtol=0, atol=LOGPROB_ATOL)


@pytest.fixture(scope="module")
def image_llm(llava):
    """One engine for the tests that need no particular cache: prefix caching off, so each test's
    requests compute their prompts themselves."""
    return LLM(_config(llava[1], prefix=False), log=lambda m: None)


def test_one_and_two_images_and_a_text_only_prompt_batched_equal_hf_with_images_cut_across_chunks(llava, image_llm):
    hf, _, images = llava
    prompts = [_prompt([_text(1, 5), 0, _text(2, 30)], images),
               _prompt([_text(3, 3), 1, _text(4, 10), 2, _text(5, 8)], images),
               _prompt([_text(6, 40)], images)]
    with pieces_fed(image_llm.engine.runner) as seen:
        outputs = image_llm.generate([p[0] for p in prompts], GREEDY, images=[p[1] for p in prompts])
    _assert_as_hf(hf, prompts, outputs)
    rows = len(images[0][1])
    assert sum(seen) == 3 * rows and any(n < rows for n in seen)  # every row fed once, some spans in parts


def test_choices_of_an_image_prompt_share_its_prefill_and_equal_hf(llava, image_llm):
    hf, _, images = llava
    prompt = _prompt([_text(13, 6), 0, _text(14, 12)], images)
    with pieces_fed(image_llm.engine.runner) as seen:
        outputs = image_llm.generate(prompt[0], replace(GREEDY, n=2), images=[prompt[1]])
    _assert_as_hf(hf, [prompt, prompt], outputs)
    assert sum(seen) == len(images[0][1])  # the second choice forked from the first's prompt


def test_the_async_engine_takes_images_and_refuses_bad_ones_before_queueing(llava):
    hf, path, images = llava
    ids, spans, pixels = _prompt([_text(15, 6), 2, _text(16, 12)], images)
    engine = AsyncLLMEngine(LLMEngine(_config(path, prefix=False), log=lambda m: None))

    async def generate() -> tuple[list[int], list[float]]:
        tokens, logprobs = [], []
        async for out in engine.generate(ids, GREEDY, images=spans):
            tokens += out.new_token_ids
            logprobs += [lp for lp, _ in out.new_logprobs]
        return tokens, logprobs

    try:
        with pytest.raises(ValueError, match="run past the prompt"):
            engine.prepare(ids[:10], GREEDY, images=spans)
        assert engine.prepare(ids, GREEDY, images=spans) == ids
        tokens, logprobs = asyncio.run(generate())
    finally:
        engine.shutdown()
    reference = _hf_generate(hf, ids, pixels)
    assert tokens == reference[0]
    np.testing.assert_allclose(logprobs, reference[1], rtol=0, atol=LOGPROB_ATOL)


def test_the_same_image_hits_the_prefix_cache_and_another_image_of_the_same_size_does_not(llava):
    hf, path, images = llava
    engine = LLM(_config(path, budget=64), log=lambda m: None)
    block = engine.engine.blocks.block_size
    first = _prompt([_text(7, 5), 0, _text(8, 2 * block)], images)
    follow_up = _prompt([_text(7, 5), 0, _text(8, 2 * block), _text(9, 20)], images)
    other = _prompt([_text(7, 5), 1, _text(8, 2 * block), _text(9, 20)], images)
    late = [_prompt([_text(10, block + 3), i, _text(11, 20)], images) for i in (0, 1)]  # a text block first

    prefix = engine.engine.blocks.prefix

    def hit_tokens(p) -> int:
        """The prompt tokens a request found cached, its tokens checked against HF's."""
        before = prefix.num_hit_tokens
        _assert_as_hf(hf, [p], engine.generate(p[0], GREEDY, images=[p[1]]))
        return prefix.num_hit_tokens - before

    assert hit_tokens(first) == 0
    assert hit_tokens(follow_up) == 2 * block  # the image's block, and the text block chained after it
    assert hit_tokens(other) == 0  # the same placeholder tokens, another image
    assert hit_tokens(late[0]) == 0
    assert hit_tokens(late[1]) == block  # the text block before the image only


def test_preemption_recomputes_the_image_rows_exactly(llava):
    hf, path, images = llava
    # 60 tokens: 2 blocks each, 3 by the end, with room for 6
    prompts = [_prompt([_text(12 + i, 4), i, _text(20 + i, 40)], images) for i in range(3)]
    llm = LLM(_config(path, num_blocks=6, budget=64, prefix=False), log=lambda m: None)
    outputs = llm.generate([p[0] for p in prompts], GREEDY, images=[p[1] for p in prompts])
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_as_hf(hf, prompts, outputs)


def test_gemma3_takes_the_rows_after_its_embedding_scale(tmp_path):
    hf, path = family_gguf(FAMILIES["gemma3"], tmp_path / "gemma3.gguf")
    hf.generation_config.eos_token_id = None  # EOS just another token, as with ignore_eos
    ids = _text(30, 40)
    # rows of an unscaled embedding's size: scaled by sqrt(hidden) = 8 they would outweigh the layers'
    # outputs in the residual stream, and the logits would move (RMSNorm alone would hide any scale)
    # (one row: Gemma 3's image rows attend to each other both ways, and this causal HF reference
    # is that only for one; test_gemma3_images.py compares whole images)
    rows = np.random.default_rng(31).standard_normal((1, hf.config.hidden_size)).astype(np.float32) * 0.2
    with torch.no_grad():  # HF's Gemma3Model: masked_scatter onto embed_tokens' output, which is scaled
        embeds = hf.model.embed_tokens(torch.tensor([ids]))
        embeds[0, 6:7] = torch.from_numpy(rows)
        out = hf.generate(inputs_embeds=embeds, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0, output_logits=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, -MAX_TOKENS:].tolist()
    logprobs = [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]
    llm = LLM(_config(str(path)), log=lambda m: None)
    got = llm.generate(ids, GREEDY, images=[[ImageSpan(6, rows, b"rows")]])[0]
    assert got.token_ids == tokens
    np.testing.assert_allclose([lp for lp, _ in got.logprobs], logprobs, rtol=0, atol=LOGPROB_ATOL)


def test_a_text_only_engine_takes_no_image_inputs_and_refuses_images(llava):
    _, path, images = llava
    engine = LLMEngine(_config(path, images=False), log=lambda m: None)
    assert not {IMAGE_EMBEDS, IMAGE_ROWS} & engine.model.paged.input_names
    assert engine.model.paged.image_width is None
    with pytest.raises(ValueError, match="this model takes no images"):
        engine.add_request("r", [1] * 20, GREEDY, images=[ImageSpan(0, images[0][1], b"x")])


@pytest.mark.parametrize("spans, why", [
    ([ImageSpan(-1, np.zeros((4, 64), np.float32), b"k")], "outside the prompt"),
    ([ImageSpan(18, np.zeros((4, 64), np.float32), b"k")], "run past the prompt"),
    ([ImageSpan(0, np.zeros((4, 64), np.float32), b"k"), ImageSpan(3, np.zeros((4, 64), np.float32), b"j")],
     "overlaps"),
    ([ImageSpan(0, np.zeros((4, 32), np.float32), b"k")], r"takes \[rows >= 1, 64\]"),
    ([ImageSpan(0, np.zeros((4, 64), np.float32), b"")], "key"),
])
def test_bad_spans_are_value_errors(image_llm, spans, why):
    with pytest.raises(ValueError, match=why):
        image_llm.engine.add_request("bad", [1] * 20, GREEDY, images=spans)
    assert not image_llm.engine.has_unfinished_requests


def _on_one_token(one_token: bool) -> list[tuple[list[int], list[float]]]:
    """An image request's and a text request's tokens and logprobs, one request at a time (a step
    of one token runs on the clone, where there is one), on the kernel's one compilation."""
    llm = LLM(EngineConfig(model=LOWBIT_MODEL, compile=CompileOptions(one_token=one_token), image_inputs=True,
                           speculative=None), log=lambda m: None)
    paged = llm.engine.model.paged
    if one_token:
        rows = next(i for i in paged.decode.inputs if IMAGE_ROWS in i.get_names())
        assert paged.decode_tokens == 1 and rows.get_partial_shape() == ov.PartialShape([0])
    span = ImageSpan(5, np.random.default_rng(40).standard_normal((20, paged.image_width)).astype(np.float32) * 0.05,
                     b"k")
    runner, on_clone = llm.engine.runner, []
    prepare, clone = runner.prepare, {id(b.request) for b in runner._decode_inputs or ()}

    def spy(chunks, rotation=None):
        step = prepare(chunks, rotation)
        on_clone.append(id(step.request) in clone)
        return step

    runner.prepare = spy
    ids = _text(41, 40)
    out = [(o.token_ids, [lp for lp, _ in o.logprobs])
           for imgs in ([span], []) for o in llm.generate(ids, GREEDY, images=[imgs])]
    assert any(on_clone) == one_token
    return out


def test_the_one_token_clone_takes_no_rows_statically_and_image_requests_compute_alike(kernel, monkeypatch):
    """The kernel's one-token clone (decode steps, which never carry image rows) has its image
    inputs fixed at zero rows; an image request's tokens and logprobs are bit for bit those of the
    dynamic compilation alone."""
    monkeypatch.setattr(cpu_defaults, "this_cpu", lambda: CpuClass.AVX512_BF16)  # the kernel's one compilation
    with_clone = _on_one_token(True)
    assert with_clone == _on_one_token(False) and with_clone[0] != with_clone[1]


def test_spans_come_back_in_prompt_order_and_key_only_the_blocks_they_reach():
    a, b = ImageSpan(40, np.ones((8, 4), np.float64), b"a"), ImageSpan(2, np.ones((3, 4), np.float32), b"b")
    spans = media.checked_spans([a, b], 64, ImageRules(4))
    assert [s.key for s in spans] == [b"b", b"a"] and spans[1].embeddings.dtype == np.float32
    assert [(at, len(rows)) for at, rows in media.rows_in(spans, 4, 44)] == [(4, 1), (40, 4)]
    assert media.extra_keys(spans, 8, 40) == b"" and media.extra_keys(spans, 32, 64) != media.extra_keys(spans, 36, 68)
    assert media.extra_keys(spans, 0, 32) != media.extra_keys([ImageSpan(2, b.embeddings, b"c")], 0, 32)
