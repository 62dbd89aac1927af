"""Gemma 3's images in chat through a real `vinoserve serve` (issue 58): a tiny random Gemma 3
(SigLIP tower, Gemma 3 projector, 6-layer Gemma 3 text model with a window of 24), written as
llama.cpp ships it, with its mmproj beside it, served at f32. Its vocabulary holds Gemma's image
tokens as control tokens, so the prompt lays each image out as Gemma 3's processor does
("\\n\\n<start_of_image>", 16 "<image_soft_token>" rows, "<end_of_image>\\n\\n"). The chat reply
equals transformers' greedy generation from the same image with its rows attending to each other
both ways (token_type_ids); the same chat again reuses the cached blocks that hold the image
whole and answers the same; other text after the same image reuses none, since the only block
that matches ends inside the image."""
from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import openai
import pytest
import torch
from gguf_fixtures import EOS_ID, FAMILIES, TOKENS, Vocab, tiny_hf_model, write_gguf
from PIL import Image
from server_process import ServerProcess
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    SiglipVisionConfig,
)
from vision_clients import random_png
from vision_fixtures import HALF, with_text_model, write_mmproj

VOCAB = Vocab(TOKENS + ["<image_soft_token>", "<start_of_image>", "<end_of_image>"],
              [1] * (len(TOKENS) - 2) + [3] * 5, EOS_ID)
IMAGE_TOKEN = len(TOKENS)
ROWS = 16  # 8x8 patches pooled 2x2
BEFORE, AFTER = "the t " * 6, " he th" * 12
MAX_TOKENS = 6
LOGPROB_ATOL = 1e-3  # f32 on both sides


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    spec = {k: v for k, v in FAMILIES["gemma3"].items() if k != "arch"}
    text = tiny_hf_model("gemma3", vocab=VOCAB, **spec)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=40, num_attention_heads=2, num_hidden_layers=1,
                                image_size=32, patch_size=4)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(
        vision_config=vision, text_config=text.config, mm_tokens_per_image=ROWS, image_token_index=IMAGE_TOKEN,
        boi_token_index=IMAGE_TOKEN + 1, eoi_token_index=IMAGE_TOKEN + 2)).eval()
    with_text_model(hf, text)
    where = tmp_path_factory.mktemp("gemma3")
    write_mmproj(hf, where / "mmproj-tiny-gemma3.gguf")
    srv = ServerProcess("--model", str(write_gguf(text, where / "tiny-gemma3.gguf", "gemma3", vocab=VOCAB)),
                        "--inference-precision", "f32", "--kv-cache-precision", "f32", "--kv-cache-size", "0.1",
                        log_path=where / "server.log").wait_ready()
    yield hf, srv
    assert srv.terminate() == 0


def _messages(png: str, after: str = AFTER) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": BEFORE},
                                         {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                                         {"type": "text", "text": after}]}]


def _tokens(srv: ServerProcess, messages: list[dict]) -> list[int]:
    return httpx.post(f"{srv.url}/tokenize", json={"messages": messages}).json()["tokens"]


def _hf_reply(hf, srv: ServerProcess, png: str, after: str = AFTER) -> tuple[str, list[float]]:
    """HF's greedy reply and its tokens' logprobs."""
    ids = _tokens(srv, _messages(png, after))
    start = ids.index(IMAGE_TOKEN)
    assert ids[start - 1] == IMAGE_TOKEN + 1 and ids[start:start + ROWS] == [IMAGE_TOKEN] * ROWS
    assert ids[start + ROWS] == IMAGE_TOKEN + 2 and ids.count(IMAGE_TOKEN) == ROWS
    return _hf_generate(hf, srv, ids, [png])


def _hf_generate(hf, srv: ServerProcess, ids: list[int], pngs: list[str]) -> tuple[str, list[float]]:
    """HF's greedy reply to prompt `ids` holding `pngs`' rows (each image's both ways) and its logprobs."""
    pixels = Gemma3ImageProcessorPil(size={"height": 32, "width": 32}, image_mean=HALF, image_std=HALF)(
        [Image.open(io.BytesIO(base64.b64decode(p))) for p in pngs], return_tensors="pt").pixel_values
    tensor = torch.tensor([ids])
    with torch.no_grad():
        out = hf.generate(input_ids=tensor, pixel_values=pixels, token_type_ids=(tensor == IMAGE_TOKEN).long(),
                          attention_mask=torch.ones_like(tensor), max_new_tokens=MAX_TOKENS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(ids):].tolist()
    logprobs = [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]
    return httpx.post(f"{srv.url}/detokenize", json={"tokens": tokens}).json()["prompt"], logprobs


def _assert_as_hf(reply, hf_reply: tuple[str, list[float]]) -> None:
    """The same text, and logprobs as HF's: a causal image moves them well past this."""
    assert reply.choices[0].message.content == hf_reply[0]
    logprobs = [t.logprob for t in reply.choices[0].logprobs.content]
    np.testing.assert_allclose(logprobs, hf_reply[1], rtol=0, atol=LOGPROB_ATOL)


def test_chat_with_an_image_equals_transformers_and_a_repeat_reuses_its_blocks(gemma3):
    hf, srv = gemma3
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)

    def chat(png: str, after: str = AFTER):
        return client.chat.completions.create(model="tiny-gemma3", messages=_messages(png, after),
                                              max_tokens=MAX_TOKENS, temperature=0, logprobs=True,
                                              extra_body={"ignore_eos": True})

    png = random_png(1)
    reply = chat(png)
    _assert_as_hf(reply, _hf_reply(hf, srv, png))
    again = chat(png)
    assert again.choices[0].message.content == reply.choices[0].message.content
    # the image's rows are 22..37: the two full blocks before the last tokens hold them whole
    assert _tokens(srv, _messages(png)).index(IMAGE_TOKEN) == 22
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    # other text after the same image: only the first block matches, and it ends inside the image
    other = chat(png, " th he" * 12)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    _assert_as_hf(other, _hf_reply(hf, srv, png, " th he" * 12))



def test_two_images_in_one_message_each_attending_both_ways_equal_transformers(gemma3):
    hf, srv = gemma3
    pngs = random_png(5), random_png(6)
    content = [{"type": "text", "text": BEFORE}]
    for png in pngs:
        content += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                    {"type": "text", "text": AFTER}]
    messages = [{"role": "user", "content": content}]
    ids = _tokens(srv, messages)
    assert ids.count(IMAGE_TOKEN) == 2 * ROWS
    expected = _hf_generate(hf, srv, ids, list(pngs))
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model="tiny-gemma3", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=True, extra_body={"ignore_eos": True})
    _assert_as_hf(reply, expected)
