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
from vinoserve.model.vision import PreparedImage, VisionModel, decode_image, image_token
from vinoserve.scheduler.media import ImageSpan
from vinoserve.server.errors import APIError
from vinoserve.server.media import MediaPolicy, image_bytes
from vinoserve.server.vision_pacing import Pacing, encode_paced

# Where an image part stood in a message: per process and unguessable, so text a user sends cannot
# pose as an image.
MARKER = f"<__vinoserve_image_{uuid.uuid4().hex[:12]}__>"


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
                       policy: MediaPolicy, encode: bool = True, pacing: Pacing = Pacing()) -> ImagePrompt:
    """The rendered prompt `text` (holding one MARKER per ref) as token ids and image spans: the
    images fetched, decoded, prepared and encoded (batched, off the event loop, paced beside
    decoding by `pacing`). Without `encode` (counting tokens), the ids alone: no spans."""
    if len(refs) > policy.max_images:
        raise APIError(400, f"the request holds {len(refs)} images; this server takes at most "
                            f"{policy.max_images}", refs[-1].param)
    pieces = text.split(MARKER)
    if len(pieces) != len(refs) + 1:
        raise APIError(400, f"the chat template kept {len(pieces) - 1} of the request's {len(refs)} images",
                       "messages")
    prepared = await asyncio.gather(*(_prepare(ref, vision, policy) for ref in refs))
    rows = await asyncio.to_thread(encode_paced, vision, prepared, pacing) if encode else [None] * len(prepared)
    # The prompt as text between runs of image rows: each image's layout set into the text.
    parts: list[str | int] = [pieces[0]]
    for image, after in zip(prepared, pieces[1:]):
        parts += [*vision.layout(image), after]
    ids, starts = _tokenized(parts, tokenizer, vision.projector)
    spans: list[ImageSpan] = []
    for image, image_rows in zip(prepared, rows):
        runs = [p for p in vision.layout(image) if isinstance(p, int)]
        used = 0
        for run, n in enumerate(runs):
            at = starts.pop(0)
            if image_rows is not None:
                key = hashlib.blake2b(image.key + run.to_bytes(4, "little"), digest_size=16).digest()
                spans.append(ImageSpan(at, np.ascontiguousarray(image_rows[used:used + n]), key,
                                       grid=image.rope_grid))
            used += n
    return ImagePrompt(ids, tuple(spans))


def _tokenized(parts: list[str | int], tokenizer: Tokenizer, projector: str) -> tuple[list[int], list[int]]:
    """Token ids of text pieces and runs of image rows, and where each run starts. Where the family's
    image token is a special token, the prompt is tokenized whole with the runs written as it, as
    its HF processor does (so text on either side tokenizes as there); else piece by piece, as
    llama.cpp's mtmd does, with token 0 under the rows."""
    token = image_token(projector)
    one = tokenizer.encode(token, add_special_tokens=False) if token else []
    special = len(one) == 1 and one[0] in tokenizer.special_token_ids
    if special:
        text = "".join(p if isinstance(p, str) else token * p for p in parts)
        ids = tokenizer.encode(text, add_special_tokens=False)
        want, starts, i = [p for p in parts if isinstance(p, int)], [], 0
        if ids.count(one[0]) == sum(want):  # else the text names the token too: runs are ambiguous
            for n in want:  # runs of the image token in order (two images side by side: one long run)
                i = ids.index(one[0], i)
                starts.append(i)
                i += n
            if all(ids[a:a + n].count(one[0]) == n for a, n in zip(starts, want)):
                return ids, starts
        raise APIError(400, f"the prompt's text holds the image token {token}: write it otherwise", "messages")
    ids, starts = [], []
    for part in parts:
        if isinstance(part, str):
            ids += tokenizer.encode(part, add_special_tokens=False) if part else []
        else:
            starts.append(len(ids))
            ids += [0] * part
    return ids, starts


async def _prepare(ref: ImageRef, vision: VisionModel, policy: MediaPolicy) -> PreparedImage:
    data = await image_bytes(ref.url, policy, ref.param)

    def prepare() -> PreparedImage:
        return vision.prepare(decode_image(data, max_pixels=policy.max_image_pixels))
    try:
        return await asyncio.to_thread(prepare)
    except ValueError as e:
        raise APIError(400, f"the image cannot be used: {e}", ref.param) from e
