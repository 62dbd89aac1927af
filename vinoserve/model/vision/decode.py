"""Image bytes from a client -> a decoded Pillow image, refusing what should not be decoded: data
that is no image, formats a chat API does not take, and sizes past the server's limit, which is
checked from the header before any pixel is decoded (Image.open only reads the header), so a
small file declaring a huge canvas (a decompression bomb) costs nothing."""
from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


def decode_image(data: bytes, *, max_pixels: int) -> Image.Image:
    """The first frame, fully decoded. ValueError naming the problem otherwise."""
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ValueError("the image data is not an image Pillow can identify (corrupt, or not an image)") from None
    except Image.DecompressionBombError as e:  # Pillow's own hard limit, past any max_pixels a server sets
        raise ValueError(f"the image declares too many pixels ({e})") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"the image header cannot be read: {e}") from None
    if image.format not in FORMATS:
        raise ValueError(f"image format {image.format} is not supported (supported: {', '.join(FORMATS)})")
    width, height = image.size
    if width <= 0 or height <= 0 or width * height > max_pixels:
        raise ValueError(f"the image is {width}x{height} = {width * height} pixels; the limit is {max_pixels}")
    try:
        image.load()
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated or damaged pixel data
        raise ValueError(f"the {image.format} image cannot be decoded: {e}") from None
    return image
