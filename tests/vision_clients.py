"""What the vision server tests send: random PNG images, and one image between two texts through
the Responses API (openai SDK) and Anthropic's Messages API (anthropic SDK) to a served vision
model, greedy, to compare with the chat reply."""
from __future__ import annotations

import base64
import io

import anthropic
import numpy as np
import openai
from PIL import Image


def random_png(seed: int, size: tuple[int, int] = (50, 37)) -> str:
    """A PNG of random pixels, (width, height), base64."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def other_clients(url: str, model: str, png: str, before: str, after: str, max_tokens: int):
    """(the Responses API's response, the Messages API's message) for the same prompt."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    response = client.responses.create(model=model, max_output_tokens=max_tokens, temperature=0, input=[{
        "role": "user", "content": [{"type": "input_text", "text": before},
                                    {"type": "input_image", "image_url": f"data:image/png;base64,{png}",
                                     "detail": "auto"},
                                    {"type": "input_text", "text": after}]}])
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    message = claude.messages.create(model=model, max_tokens=max_tokens, extra_body={"temperature": 0}, messages=[{
        "role": "user", "content": [{"type": "text", "text": before},
                                    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                 "data": png}},
                                    {"type": "text", "text": after}]}])
    return response, message
