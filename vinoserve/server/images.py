"""Images in a chat prompt (issue 58), llama.cpp's way (tools/mtmd): each image part of a message
becomes a marker in its text, the chat template renders the text, and the rendered prompt is cut at
the markers; each image then takes its family's place in the prompt (`VisionModel.layout`: wrapper
text such as Gemma 3's <start_of_image>, and runs of rows its vision tower computes). The rows reach
the engine as ImageSpans at their prompt positions, over placeholder tokens, keyed by the image's
pixels so that a later turn with the same image reuses its cached blocks.
"""
from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from vinoserve.model.tokenizer import Tokenizer
from vinoserve.model.vision import PreparedImage, VisionModel, decode_image
from vinoserve.scheduler.media import ImageSpan
from vinoserve.server.errors import APIError
from vinoserve.server.media import MediaPolicy, image_bytes

# Where an image part stood in a message: per process and unguessable, so text a user sends cannot
# pose as an image.
MARKER = f"<__vinoserve_image_{uuid.uuid4().hex[:12]}__>"
# The token each family's processor puts where image rows go (HF's image_token): the rows replace
# it, but a repetition penalty counts it as HF's does. Absent from the vocabulary: token 0.
_PLACEHOLDER = {"mlp": "<image>", "gemma3": "<image_soft_token>", "idefics3": "<image>"}


@dataclass(frozen=True)
class ImageRef:
    url: str
    param: str  # where the request holds it: messages.N.content.K


@dataclass(frozen=True)
class ImagePrompt:
    ids: list[int]
    images: tuple[ImageSpan, ...]


def take_images(messages: list[dict], allowed: bool) -> list[ImageRef]:
    """Replaces each image part of `messages` (as dicts, in place) by MARKER within its message's
    text and returns the images in prompt order; 400 where images are not allowed or misplaced."""
    found: list[ImageRef] = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("content"), list):
            continue
        text = []
        for k, part in enumerate(m["content"]):
            if part.get("type") != "image_url":
                text.append(part.get("text") or "")
                continue
            param = f"messages.{i}.content.{k}"
            if not allowed:
                raise APIError(400, "this model takes no images: serve a vision model with its projector "
                                    "(--mmproj)", param)
            if m["role"] != "user":
                raise APIError(400, f"only user messages may hold images, not {m['role']} messages", param)
            found.append(ImageRef(part["image_url"]["url"], param))
            text.append(MARKER)
        m["content"] = "".join(text)
    return found


async def image_prompt(text: str, refs: Sequence[ImageRef], vision: VisionModel, tokenizer: Tokenizer,
                       policy: MediaPolicy, encode: bool = True) -> ImagePrompt:
    """The rendered prompt `text` (holding one MARKER per ref) as token ids and image spans: the
    images fetched, decoded, prepared and encoded (batched, off the event loop). Without `encode`
    (counting tokens), the ids alone: no spans."""
    if len(refs) > policy.max_images:
        raise APIError(400, f"the request holds {len(refs)} images; this server takes at most "
                            f"{policy.max_images}", refs[-1].param)
    pieces = text.split(MARKER)
    if len(pieces) != len(refs) + 1:
        raise APIError(400, f"the chat template kept {len(pieces) - 1} of the request's {len(refs)} images",
                       "messages")
    prepared = await asyncio.gather(*(_prepare(ref, vision, policy) for ref in refs))
    rows = await asyncio.to_thread(vision.encode, prepared) if encode else [None] * len(prepared)
    ids = tokenizer.encode(pieces[0], add_special_tokens=False)
    spans: list[ImageSpan] = []
    placeholder = _placeholder_id(tokenizer, vision.projector)
    for image, image_rows, after in zip(prepared, rows, pieces[1:]):
        used = 0
        for run, piece in enumerate(vision.layout(image)):
            if isinstance(piece, str):
                ids += tokenizer.encode(piece, add_special_tokens=False)
                continue
            key = image.key if run == 0 else hashlib.blake2b(image.key + run.to_bytes(4, "little"),
                                                            digest_size=16).digest()
            if image_rows is not None:
                spans.append(ImageSpan(len(ids), np.ascontiguousarray(image_rows[used:used + piece]), key))
            ids += [placeholder] * piece
            used += piece
        ids += tokenizer.encode(after, add_special_tokens=False)
    return ImagePrompt(ids, tuple(spans))


async def _prepare(ref: ImageRef, vision: VisionModel, policy: MediaPolicy) -> PreparedImage:
    data = await image_bytes(ref.url, policy, ref.param)

    def prepare() -> PreparedImage:
        return vision.prepare(decode_image(data, max_pixels=policy.max_image_pixels))
    try:
        return await asyncio.to_thread(prepare)
    except ValueError as e:
        raise APIError(400, f"the image cannot be used: {e}", ref.param) from e


def _placeholder_id(tokenizer: Tokenizer, projector: str) -> int:
    ids = tokenizer.encode(_PLACEHOLDER.get(projector, ""), add_special_tokens=False) if projector in _PLACEHOLDER \
        else []
    return ids[0] if len(ids) == 1 else 0
