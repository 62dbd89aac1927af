"""Vision-language models served from an `optimum-cli export openvino --task image-text-to-text`
directory (issue 58): a tiny random LLaVA 1.5, Gemma 3, Idefics3 and SmolVLM exported by
optimum-intel's main_export, loaded by path alone (the text embeddings spliced into the language model, the
export's vision model found beside it), and the images of a prompt taken as the server takes them
(server/images.py: decoded, prepared, encoded, laid out and tokenized with the export's tokenizer).
At f32, greedy tokens and their logprobs equal transformers' generate on the same model, with one
image and with two in one batch; Gemma 3's image rows attend to each other both ways. Pixels for
the reference: LLaVA's and Gemma 3's HF image processors; Idefics3's processor needs torchvision
in this venv's transformers, so vinoserve's own pixels for it and SmolVLM (equal to the
processor's: tests/test_vision_towers.py). `vinoserve serve --model EXPORT_DIR` answers a chat with
an image as transformers does. Exports of families not served are refused in one line (Qwen-VL's
are served: tests/test_ir_qwen_vision.py)."""
from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import openvino as ov
import openvino.opset13 as ops
import pytest
import torch
from PIL import Image

from ir_vlm_fixtures import FAMILIES, exports, f32_llm, image_processor, png, served
from server_process import ServerProcess
from vinoserve.model.compile_options import CompileOptions
from vinoserve.model.errors import ModelLoadError
from vinoserve.model.image_attention import TOKEN_TYPES
from vinoserve.model.loader import load_model
from vinoserve.model.vision.layout import image_token
from vinoserve.model.vlm_export import splice_embeddings
from vinoserve.scheduler.sampling_params import SamplingParams
from vinoserve.server.images import MARKER

pytestmark = pytest.mark.ir
F32 = CompileOptions(inference_precision="f32", kv_cache_precision="f32")
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
LOGPROB_ATOL = 1e-3  # f32 on both sides; the tokens are compared exactly
ROWS = {"llava": 16, "gemma3": 16, "idefics3": 20, "smolvlm": 20}  # a 50 x 37 image's rows (Idefics3: 2 x 2 tiles + the whole)


@pytest.fixture(scope="module")
def vlm(ir_export, tmp_path_factory):
    """family -> (HF model, its export's directory); ir_export skips where optimum-intel is missing."""
    return exports(tmp_path_factory)


def _hf_pixels(family: str, vision, pngs: list[bytes]) -> dict:
    images = [Image.open(io.BytesIO(p)) for p in pngs]
    if family in ("idefics3", "smolvlm"):
        frames = [vision.prepare(image).pixels for image in images]
        return {"pixel_values": torch.from_numpy(np.concatenate(frames))[None]}
    return {"pixel_values": image_processor(family)(images, return_tensors="pt").pixel_values}


def _hf_generate(family: str, hf, ids: list[int], pixels: dict) -> tuple[list[int], list[float]]:
    tensor = torch.tensor([ids])
    extra = dict(pixels)
    if family == "gemma3":  # its image rows attend to each other both ways, as its processor asks
        extra["token_type_ids"] = (tensor == hf.config.image_token_index).long()
    with torch.no_grad():
        out = hf.generate(tensor, attention_mask=torch.ones_like(tensor), **extra, max_new_tokens=MAX_TOKENS,
                          do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_and_two_images_equal_transformers(family, vlm):
    hf, ir = vlm(family)
    llm = f32_llm(ir)
    vision = llm.engine.model.vision
    assert vision is not None and vision.projector == {"llava": "mlp", "smolvlm": "idefics3"}.get(family, family)
    assert (TOKEN_TYPES in llm.engine.model.paged.input_names) == (family == "gemma3")
    first, second = png(1, (50, 37)), png(2, (50, 37))
    cases = [(f"the t {MARKER} he th", [first]), (f"he {MARKER} t{MARKER} the", [second, first])]
    prompts = [served(llm, text, pngs) for text, pngs in cases]
    image_id = llm.engine.model.tokenizer.encode(image_token(vision.projector), add_special_tokens=False)
    for prompt, (_, pngs) in zip(prompts, cases):
        assert prompt.ids.count(image_id[0]) == ROWS[family] * len(pngs) == sum(len(s.embeddings) for s in prompt.images)
    outputs = llm.generate([p.ids for p in prompts], GREEDY, images=[list(p.images) for p in prompts])
    for prompt, (_, pngs), out in zip(prompts, cases, outputs):
        tokens, logprobs = _hf_generate(family, hf, prompt.ids, _hf_pixels(family, vision, pngs))
        assert out.token_ids == tokens
        np.testing.assert_allclose([lp for lp, _ in out.logprobs], logprobs, rtol=0, atol=LOGPROB_ATOL)


@pytest.mark.parametrize("model_type", ["llava_next", "qwen3_vl"])
def test_exports_of_other_families_are_refused_in_one_line(model_type, tmp_path):
    # the files optimum-intel writes for Qwen-VL (3 too); the refusal comes before any is read
    words = f"exports of {model_type} are not served .from IR: llava, gemma3, idefics3, smolvlm, qwen2_vl, qwen2_5_vl."
    for xml in ("language", "text_embeddings", "vision_embeddings", "vision_embeddings_merger"):
        (tmp_path / f"openvino_{xml}_model.xml").write_text("<net/>")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "text_config": {}}))
    with pytest.raises(ModelLoadError, match=words) as e:
        load_model(str(tmp_path), F32, log=lambda m: None)
    assert "\n" not in str(e.value)


def _graph(param: str, shape: list[int], kind: ov.Type, body) -> ov.Model:
    p = ops.parameter(shape, kind, name=param)
    p.output(0).set_names({param})
    return ov.Model([ops.result(body(p))], [p])


def test_the_text_embeddings_take_the_place_of_inputs_embeds():
    """The spliced graph takes input_ids and computes the language model on the embeddings model's
    rows (its scale included); widths that differ are two exports' models, refused."""
    table = ops.constant(np.arange(12, dtype=np.float32).reshape(4, 3))

    def embeddings():
        return _graph("input", [-1, -1], ov.Type.i64, lambda ids: ops.multiply(
            ops.gather(table, ops.convert(ids, ov.Type.i32), ops.constant(np.int32(0))), ops.constant(np.float32(2))))

    def language(width: int):
        return _graph("inputs_embeds", [-1, -1, width], ov.Type.f32, lambda x: ops.add(x, ops.constant(np.float32(1))))

    spliced = splice_embeddings(language(3), embeddings())
    assert [p.get_output_tensor(0).get_names() for p in spliced.get_parameters()] == [{"input_ids"}]
    out = ov.Core().compile_model(spliced, "CPU")({"input_ids": np.array([[1, 3]])})[0]
    np.testing.assert_array_equal(out, np.arange(12, dtype=np.float32).reshape(4, 3)[[[1, 3]]] * 2 + 1)
    with pytest.raises(ModelLoadError, match="3 wide, the language model takes 5: the two models are of different"):
        splice_embeddings(language(5), embeddings())


def test_served_by_path_alone_a_chat_with_an_image_equals_transformers(vlm, tmp_path):
    """`vinoserve serve --model EXPORT_DIR`: the openai SDK's reply and its logprobs equal
    transformers' greedy generation from the same image; the prompt as /tokenize counts it."""
    hf, ir = vlm("llava")
    image = png(3, (37, 50))
    url = f"data:image/png;base64,{base64.b64encode(image).decode()}"
    messages = [{"role": "user", "content": [{"type": "text", "text": "the t "},
                                             {"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": " he th"}]}]
    srv = ServerProcess("--model", str(ir), "--inference-precision", "f32", "--kv-cache-precision", "f32",
                        "--kv-cache-size", "0.02", log_path=tmp_path / "server.log").wait_ready()
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=ir.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                               logprobs=True, extra_body={"ignore_eos": True})
        ids = httpx.post(f"{srv.url}/tokenize", json={"messages": messages}).json()["tokens"]
        tokens, logprobs = _hf_generate("llava", hf, ids, _hf_pixels("llava", None, [image]))
        text = httpx.post(f"{srv.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    finally:
        assert srv.terminate() == 0
    assert ids.count(hf.config.image_token_index) == ROWS["llava"] and reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == text
    np.testing.assert_allclose([t.logprob for t in reply.choices[0].logprobs.content], logprobs, rtol=0,
                               atol=LOGPROB_ATOL)
