"""Qwen2.5-VL's images in chat through a real `vinoserve serve` (issue 58): a tiny random
Qwen2.5-VL (windowed ViT, merger, Qwen2 text model with M-RoPE), written as llama.cpp ships it,
the mmproj beside the text GGUF, served at f32. The prompt lays each image out as Qwen's chat
template does (<|vision_start|>, a run of <|image_pad|> rows, <|vision_end|>); the openai SDK's
reply and logprobs equal transformers' greedy generation from the same image (rows placed by
M-RoPE: height and width positions, the text after running max(h, w) past the image); the same
chat again reuses the image's cached blocks; the Responses and Anthropic SDKs give the same reply."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from gguf_fixtures import EOS_ID, TOKENS, Vocab, tiny_hf_model, write_gguf
from PIL import Image
from server_process import ServerProcess
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)
from vision_clients import other_clients, random_png
from vision_fixtures import CLIP_MEAN, CLIP_STD, with_text_model, write_mmproj

VOCAB = Vocab(TOKENS + ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"], [1] * (len(TOKENS) - 2) + [3] * 5,
              EOS_ID)
IMAGE_TOKEN = len(TOKENS)
SECTIONS = (2, 3, 3)  # head size 16: 8 frequencies
PIXELS = (56 * 56, 28 * 28 * 16)  # written into the mmproj and given to HF's processor: at most 16 rows
BEFORE, AFTER = "the t " * 6, " he th" * 12
MAX_TOKENS = 6
LOGPROB_ATOL = 1e-3  # f32 on both sides


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    text = tiny_hf_model("qwen2", vocab=VOCAB, heads=4, kv_heads=2)
    text_cfg = {**text.config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                            "mrope_section": list(SECTIONS)}}
    vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 40, "num_heads": 2, "out_hidden_size": 64,
              "window_size": 56, "fullatt_block_indexes": [1]}
    hf = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        vision_config=vision, text_config=text_cfg, image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN + 3,
        vision_start_token_id=IMAGE_TOKEN + 1, vision_end_token_id=IMAGE_TOKEN + 2)).eval()
    with_text_model(hf, text)
    where = tmp_path_factory.mktemp("qwen")
    write_mmproj(hf, where / "mmproj-tiny-qwen.gguf", pixels=PIXELS)
    gguf = write_gguf(text, where / "tiny-qwen.gguf", "qwen2", vocab=VOCAB, mrope_sections=SECTIONS)
    srv = ServerProcess("--model", str(gguf), "--inference-precision", "f32", "--kv-cache-precision", "f32",
                        "--kv-cache-size", "0.1", log_path=where / "server.log").wait_ready()
    yield hf, srv
    assert srv.terminate() == 0


def _messages(*pngs: str) -> list[dict]:
    """BEFORE, then each image followed by AFTER."""
    content = [{"type": "text", "text": BEFORE}]
    for png in pngs:
        content += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                    {"type": "text", "text": AFTER}]
    return [{"role": "user", "content": content}]


def _hf_reply(hf, srv: ServerProcess, *pngs: str) -> tuple[str, list[float], list[int]]:
    """HF's greedy reply, its tokens' logprobs, and the prompt's ids."""
    ids = httpx.post(f"{srv.url}/tokenize", json={"messages": _messages(*pngs)}).json()["tokens"]
    images = [Image.open(io.BytesIO(base64.b64decode(png))) for png in pngs]
    processed = Qwen2VLImageProcessorPil(size={"shortest_edge": PIXELS[0], "longest_edge": PIXELS[1]},
                                         image_mean=CLIP_MEAN, image_std=CLIP_STD)(images, return_tensors="pt")
    tensor = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(input_ids=tensor, pixel_values=processed.pixel_values,
                          image_grid_thw=processed.image_grid_thw, mm_token_type_ids=(tensor == IMAGE_TOKEN).int(),
                          attention_mask=torch.ones_like(tensor), max_new_tokens=MAX_TOKENS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]
    return httpx.post(f"{srv.url}/detokenize", json={"tokens": tokens}).json()["prompt"], logprobs, ids


def test_chat_with_an_image_equals_transformers_and_a_repeat_reuses_its_blocks(qwen):
    hf, srv = qwen
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)

    def chat(png: str):
        return client.chat.completions.create(model="tiny-qwen", messages=_messages(png), max_tokens=MAX_TOKENS,
                                              temperature=0, logprobs=True, extra_body={"ignore_eos": True})

    for seed, size in ((1, (50, 37)), (2, (30, 90))):  # 2 x 3 rows; 4 x 2 (HF's smart resize, both)
        png = random_png(seed, size)
        reply = chat(png)
        text, logprobs, ids = _hf_reply(hf, srv, png)
        start = ids.index(IMAGE_TOKEN)
        rows = ids.count(IMAGE_TOKEN)
        assert ids[start - 1] == IMAGE_TOKEN + 1 and ids[start + rows] == IMAGE_TOKEN + 2 and rows in (6, 8)
        assert reply.choices[0].message.content == text
        np.testing.assert_allclose([t.logprob for t in reply.choices[0].logprobs.content], logprobs, rtol=0,
                                   atol=LOGPROB_ATOL)
        again = chat(png)
        assert again.choices[0].message.content == text
        assert again.usage.prompt_tokens_details.cached_tokens >= 32 > start  # a block holding the image


def test_two_images_of_other_shapes_in_one_message_equal_transformers(qwen):
    """The text after the first image and the whole second image sit at positions M-RoPE moved."""
    hf, srv = qwen
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    pngs = random_png(5, (30, 90)), random_png(6, (50, 37))
    reply = client.chat.completions.create(model="tiny-qwen", messages=_messages(*pngs), max_tokens=MAX_TOKENS,
                                           temperature=0, logprobs=True, extra_body={"ignore_eos": True})
    text, logprobs, ids = _hf_reply(hf, srv, *pngs)
    assert ids.count(IMAGE_TOKEN) == 8 + 6 and ids.count(IMAGE_TOKEN + 1) == 2
    assert reply.choices[0].message.content == text
    np.testing.assert_allclose([t.logprob for t in reply.choices[0].logprobs.content], logprobs, rtol=0,
                               atol=LOGPROB_ATOL)


def test_responses_and_anthropic_clients_send_images_too(qwen):
    _, srv = qwen
    png = random_png(4)
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model="tiny-qwen", messages=_messages(png), max_tokens=MAX_TOKENS,
                                          temperature=0).choices[0].message.content
    response, message = other_clients(srv.url, "tiny-qwen", png, BEFORE, AFTER, MAX_TOKENS)
    assert response.output_text == message.content[0].text == chat
