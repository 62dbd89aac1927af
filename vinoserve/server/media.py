"""An image a request names, as bytes: a `data:` URL decoded, or an http(s) URL fetched where the
server allows its host (`--allowed-media-domains`, vLLM's flag), under a size and a time limit.
Every failure is a 400 naming the request's field, never a 500: a URL is the client's input.
"""
from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urlsplit

import httpx

from vinoserve.server.errors import APIError


@dataclass(frozen=True)
class MediaPolicy:
    """What the server fetches and accepts, each a `vinoserve serve` flag."""

    allowed_domains: frozenset[str] = frozenset()  # hosts whose http(s) images are fetched; none by default
    max_image_bytes: int = 20 * 2**20  # an encoded image, as sent or fetched
    max_image_pixels: int = 40_000_000  # decoded width x height: bounds a decompression bomb's memory
    max_images: int = 8  # a request's images in all: each costs an encoder run and its tokens
    fetch_timeout_s: float = 10.0

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or host.endswith("." + d) for d in self.allowed_domains)


async def image_bytes(url: str, policy: MediaPolicy, param: str) -> bytes:
    """The bytes `url` names (a data: URL or an allowed http(s) one); APIError 400 naming `param`."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url(url, param)
    elif scheme in ("http", "https"):
        data = await _fetch(url, policy, param)
    else:
        raise APIError(400, "an image URL must be a data: URL (data:image/png;base64,...) or an http(s) URL", param)
    if len(data) > policy.max_image_bytes:
        raise APIError(400, f"the image is {len(data)} bytes; this server takes at most {policy.max_image_bytes}",
                       param)
    return data


def _data_url(url: str, param: str) -> bytes:
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise APIError(400, "a data: URL needs a comma before its data", param)
    media_type = header.split(";", 1)[0].strip().lower()
    if media_type and not media_type.startswith("image/"):
        raise APIError(400, f"the data: URL holds {media_type}, not an image", param)
    if header.lower().endswith(";base64"):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise APIError(400, f"the data: URL's base64 does not decode: {e}", param) from e
    return unquote_to_bytes(payload)


async def _fetch(url: str, policy: MediaPolicy, param: str) -> bytes:
    host = urlsplit(url).hostname or ""
    if not policy.allowed_domains:
        raise APIError(400, "this server fetches no image URLs: send the image as a data: URL, or start the "
                            "server with --allowed-media-domains", param)
    if not policy.allows(host):
        raise APIError(400, f"this server does not fetch images from {host or 'that URL'} "
                            "(--allowed-media-domains)", param)
    try:
        # Redirects are not followed: one could lead off the allowed hosts.
        async with httpx.AsyncClient(timeout=policy.fetch_timeout_s, follow_redirects=False) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise APIError(400, f"fetching the image gave HTTP {response.status_code}", param)
                data = bytearray()
                async for chunk in response.aiter_bytes():
                    data += chunk
                    if len(data) > policy.max_image_bytes:
                        raise APIError(400, f"the image is larger than this server's {policy.max_image_bytes} "
                                            "bytes", param)
                return bytes(data)
    except httpx.HTTPError as e:
        raise APIError(400, f"fetching the image failed: {type(e).__name__}: {e}", param) from e
