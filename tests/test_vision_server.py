"""Images in chat through a real `vinoserve serve` and unmodified clients (issue 58): a tiny random
LLaVA 1.5 (CLIP tower, mlp projector, Llama text model), written as llama.cpp ships it, a text
GGUF with its mmproj GGUF beside it (found there, as llama.cpp's server finds it), served at f32.
The openai SDK's chat reply equals transformers' greedy generation from the same image; the
Responses and Anthropic APIs give the same reply; a second turn with the same image reuses its
cached blocks, another image of the same size does not; bad images and images sent to a text
model are 400s in each API's own shape; the chat page sends an image dropped on it."""
from __future__ import annotations

import base64
import io

import anthropic
import httpx
import numpy as np
import openai
import pytest
import torch
from gguf_fixtures import EOS_ID, TOKENS, Vocab, tiny_hf_model, write_gguf
from PIL import Image
from server_process import ServerProcess
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)
from vision_clients import other_clients, random_png
from vision_fixtures import CLIP_MEAN, CLIP_STD, with_text_model, write_mmproj

VOCAB = Vocab(TOKENS + ["<image>"], [1] * (len(TOKENS) - 2) + [3, 3, 3], EOS_ID)
IMAGE_TOKEN = len(TOKENS)
BEFORE, AFTER = "the t " * 8, " he th" * 6  # text around the image: the image's rows fall in full blocks
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    text = tiny_hf_model("llama", vocab=VOCAB)
    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=40, num_attention_heads=2,
                              num_hidden_layers=3, projection_dim=16)
    hf = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text.config,
                                                   image_token_index=IMAGE_TOKEN)).eval()
    with_text_model(hf, text)
    where = tmp_path_factory.mktemp("llava")
    write_mmproj(hf, where / "mmproj-tiny-llava.gguf")
    srv = ServerProcess("--model", str(write_gguf(text, where / "tiny-llava.gguf", vocab=VOCAB)),
                        "--inference-precision", "f32", "--kv-cache-precision", "f32", "--kv-cache-size", "0.1",
                        log_path=where / "server.log").wait_ready()
    yield hf, srv
    assert srv.terminate() == 0


def _messages(png: str, text: str = AFTER) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": BEFORE},
                                         {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                                         {"type": "text", "text": text}]}]


def _tokens(srv: ServerProcess, png: str) -> list[int]:
    return httpx.post(f"{srv.url}/tokenize", json={"messages": _messages(png)}).json()["tokens"]


def _image_at(srv: ServerProcess, png: str) -> int:
    return _tokens(srv, png).index(IMAGE_TOKEN)


def _hf_reply(hf, srv: ServerProcess, png: str) -> str:
    ids = _tokens(srv, png)
    assert ids.count(IMAGE_TOKEN) == 16  # (32 / 8)^2 patches, CLS dropped
    image = Image.open(io.BytesIO(base64.b64decode(png)))
    pixels = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                   image_mean=CLIP_MEAN, image_std=CLIP_STD)(image, return_tensors="pt").pixel_values
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=MAX_TOKENS,
                          do_sample=False)
    return httpx.post(f"{srv.url}/detokenize", json={"tokens": out[0, len(ids):].tolist()}).json()["prompt"]


def _chat(srv: ServerProcess, messages: list[dict], model: str = "tiny-llava", **extra):
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0, **extra)


def test_chat_with_an_image_equals_transformers_and_its_blocks_are_reused(llava):
    hf, srv = llava
    first, other = random_png(1), random_png(2)
    reply = _chat(srv, _messages(first), extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == _hf_reply(hf, srv, first)
    again = _chat(srv, _messages(first), extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == reply.choices[0].message.content
    # The first block holds text and image rows (the last tokens are computed again, as a whole
    # prompt's would be: scheduler._cached_prefix): it is reused for the same image only.
    assert again.usage.prompt_tokens_details.cached_tokens == 32 and _image_at(srv, first) < 32
    changed = _chat(srv, _messages(other), extra_body={"ignore_eos": True})  # same size, other pixels
    assert changed.usage.prompt_tokens_details.cached_tokens == 0
    assert changed.choices[0].message.content == _hf_reply(hf, srv, other)


def test_two_images_in_one_message_equal_transformers(llava):
    """Compared by logprobs (1e-3, f32 both sides): a random model's bytes need not be UTF-8, and
    text streamed in pieces and decoded whole may replace them differently."""
    hf, srv = llava
    pngs = random_png(5), random_png(6, (40, 60))
    content = [{"type": "text", "text": BEFORE}]
    for png in pngs:
        content += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                    {"type": "text", "text": AFTER}]
    messages = [{"role": "user", "content": content}]
    ids = httpx.post(f"{srv.url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert ids.count(IMAGE_TOKEN) == 2 * 16
    processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                      image_mean=CLIP_MEAN, image_std=CLIP_STD)
    pixels = processor([Image.open(io.BytesIO(base64.b64decode(p))) for p in pngs], return_tensors="pt").pixel_values
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=MAX_TOKENS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = _logprobs(out, len(ids))
    reply = _chat(srv, messages, logprobs=True, extra_body={"ignore_eos": True})
    np.testing.assert_allclose([t.logprob for t in reply.choices[0].logprobs.content], expected, rtol=0, atol=1e-3)


def _logprobs(out, prompt_len: int) -> list[float]:
    """Each generated token's logprob from generate(..., output_logits=True, return_dict_in_generate=True)."""
    tokens = out.sequences[0, prompt_len:].tolist()
    return [float(torch.log_softmax(step[0], -1)[t]) for step, t in zip(out.logits, tokens)]


def test_responses_and_anthropic_clients_send_images_too(llava):
    _, srv = llava
    png = random_png(4)
    chat = _chat(srv, _messages(png)).choices[0].message.content
    response, message = other_clients(srv.url, "tiny-llava", png, BEFORE, AFTER, MAX_TOKENS)
    assert response.output_text == message.content[0].text == chat
    # Anthropic counts cache reads apart: the same prompt, its image's rows included, and its cached blocks.
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == response.usage.input_tokens > 16
    assert message.usage.cache_read_input_tokens == response.usage.input_tokens_details.cached_tokens == 32


def test_bad_images_are_400s_naming_the_part(llava):
    _, srv = llava
    cases = [(base64.b64encode(b"not an image at all").decode(), "cannot be used"),
             (random_png(5)[:200], "cannot be used")]  # a truncated PNG
    for data, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(srv, _messages(data))
        assert words in e.value.body["message"] and e.value.body["param"] == "messages.0.content.1"
    messages = _messages(random_png(6))
    messages[0]["content"][1]["image_url"]["url"] = "https://example.com/cat.png"
    with pytest.raises(openai.BadRequestError) as e:
        _chat(srv, messages)
    assert "--allowed-media-domains" in e.value.body["message"]
    claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="tiny-llava", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
    assert e.value.body["type"] == "error" and "cannot be used" in e.value.body["error"]["message"]
    assert _chat(srv, _messages(random_png(7))).choices[0].message.content is not None  # the server goes on


def test_a_text_model_refuses_images_in_every_api(api_server, api_client):
    png = random_png(8)
    with pytest.raises(openai.BadRequestError) as e:
        api_client.chat.completions.create(model="smollm2-135m-instruct", messages=_messages(png), max_tokens=2)
    assert "takes no images" in e.value.body["message"] and e.value.body["param"] == "messages.0.content.1"
    with pytest.raises(openai.BadRequestError) as e:
        api_client.responses.create(model="smollm2-135m-instruct", max_output_tokens=16, input=[{
            "role": "user", "content": [{"type": "input_image", "image_url": f"data:image/png;base64,{png}",
                                         "detail": "auto"}]}])
    assert "takes no images" in e.value.body["message"]
    claude = anthropic.Anthropic(base_url=api_server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model="smollm2-135m-instruct", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}])
    assert "takes no images" in e.value.body["error"]["message"]


def test_chat_page_takes_a_dropped_image(llava):
    from test_chat_ux import CHROMIUM, _browser

    _, srv = llava
    png = random_png(9)
    with _browser() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.goto(srv.url + "/")
            page.wait_for_function("document.getElementById('model').textContent.includes('tiny-llava')")
            dropped = page.evaluate_handle("""(b64) => {
                const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
                const dt = new DataTransfer();
                dt.items.add(new File([bytes], "shot.png", { type: "image/png" }));
                return dt; }""", png)
            page.dispatch_event("#chat", "drop", {"dataTransfer": dropped})
            page.locator("#pending img").wait_for()
            page.fill("#temperature", "0")
            page.fill("#maxtokens", str(MAX_TOKENS))
            page.fill("#input", AFTER)
            page.keyboard.press("Enter")
            page.wait_for_function("document.querySelector('.stats')?.textContent.includes('tokens')", timeout=60_000)
            assert page.locator(".msg.user img").count() == 1 and page.locator("#pending img").count() == 0
            expected = _chat(srv, [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                {"type": "text", "text": AFTER.strip()}]}]).choices[0].message.content  # the page trims its input
            assert page.text_content(".msg.assistant") == expected
        finally:
            browser.close()


IDEFICS3_TOKENS = ["<fake_token_around_image>", "<global-img>"] + [f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]
IDEFICS3_VOCAB = Vocab(VOCAB.tokens + IDEFICS3_TOKENS, VOCAB.types + [3] * len(IDEFICS3_TOKENS), EOS_ID)


@pytest.fixture(scope="module")
def smolvlm(tmp_path_factory):
    """A tiny Idefics3 (SmolVLM's family): SigLIP, pixel shuffle, images over 32 px cut into tiles."""
    from transformers import (
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3VisionConfig,
    )

    text = tiny_hf_model("llama", vocab=IDEFICS3_VOCAB)
    vision = Idefics3VisionConfig(image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=32,
                                  intermediate_size=40, num_attention_heads=2)
    hf = Idefics3ForConditionalGeneration(Idefics3Config(vision_config=vision, text_config=text.config, scale_factor=2,
                                                         image_token_id=IMAGE_TOKEN)).eval()
    with_text_model(hf, text, seed=4)
    where = tmp_path_factory.mktemp("smolvlm")
    srv = ServerProcess("--model", str(write_gguf(text, where / "tiny-smolvlm.gguf", vocab=IDEFICS3_VOCAB)),
                        "--mmproj", str(write_mmproj(hf, where / "projector.gguf")),
                        "--inference-precision", "f32", "--kv-cache-precision", "f32", "--kv-cache-size", "0.1",
                        log_path=where / "server.log").wait_ready()
    yield hf, srv
    assert srv.terminate() == 0


def test_smolvlm_tiles_an_image_as_transformers_does(smolvlm):
    from transformers import Idefics3ImageProcessorPil

    hf, srv = smolvlm
    png = random_png(10, (60, 45))  # over 32 px: a 2 x 2 grid of tiles and the whole image
    ids = _tokens(srv, png)
    assert ids.count(IMAGE_TOKEN) == 5 * 4  # five frames of (32 / 8 / 2)^2 rows
    image = Image.open(io.BytesIO(base64.b64decode(png)))
    inputs = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                       image_mean=[0.5] * 3, image_std=[0.5] * 3)(image, return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=inputs.pixel_values,
                          pixel_attention_mask=inputs.pixel_attention_mask, max_new_tokens=MAX_TOKENS, do_sample=False)
    expected = httpx.post(f"{srv.url}/detokenize", json={"tokens": out[0, len(ids):].tolist()}).json()["prompt"]
    reply = _chat(srv, _messages(png), "tiny-smolvlm", extra_body={"ignore_eos": True})
    assert reply.choices[0].message.content == expected


def test_smolvlm_takes_two_tiled_images_in_one_message_as_transformers_does(smolvlm):
    """Compared by logprobs (see test_two_images_in_one_message_equal_transformers)."""
    from transformers import Idefics3ImageProcessorPil

    hf, srv = smolvlm
    pngs = random_png(11, (60, 45)), random_png(12, (40, 70))
    content = [{"type": "text", "text": BEFORE}]
    for png in pngs:
        content += [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                    {"type": "text", "text": AFTER}]
    messages = [{"role": "user", "content": content}]
    ids = httpx.post(f"{srv.url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert ids.count(IMAGE_TOKEN) == 2 * 5 * 4  # each: 2 x 2 tiles and the whole, 4 rows a frame
    inputs = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32},
                                       image_mean=[0.5] * 3, image_std=[0.5] * 3)(
        [[Image.open(io.BytesIO(base64.b64decode(p))) for p in pngs]], return_tensors="pt")
    with torch.no_grad():
        out = hf.generate(input_ids=torch.tensor([ids]), pixel_values=inputs.pixel_values,
                          pixel_attention_mask=inputs.pixel_attention_mask, max_new_tokens=MAX_TOKENS, do_sample=False,
                          output_logits=True, return_dict_in_generate=True)
    expected = _logprobs(out, len(ids))
    reply = _chat(srv, messages, "tiny-smolvlm", logprobs=True, extra_body={"ignore_eos": True})
    np.testing.assert_allclose([t.logprob for t in reply.choices[0].logprobs.content], expected, rtol=0, atol=1e-3)
