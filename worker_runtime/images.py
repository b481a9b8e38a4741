"""A request's images as they travel: encoded files, opened where an engine takes the request.

An image crosses the cluster as the file its client sent (bytes cross Ray and msgpack, and are
the smallest form), identified by a digest of those bytes. The front door opens each one once
to check it (router/image_inputs.py); every engine the request touches (prefill, decode, a
move's target) opens it again, because each engine's own input processing (vLLM's, in the
front door's process) turns it into the model's pixel values.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
from typing import Any


class BadImage(ValueError):
    """Bytes that are not an image this server can read, or one too large."""


def image_digest(data: bytes) -> str:
    """The image's identifier across the cluster: vLLM keys its encoder and prefix caches by it
    (``multi_modal_uuids``), so the same file is the same image on every engine."""
    return hashlib.sha256(data).hexdigest()


def open_image(data: bytes, max_pixels: int | None = None) -> Any:
    """The image ``data`` holds, decoded as vLLM's server decodes one (``ImageMediaIO``): only
    the formats vLLM serves (an EPS file never reaches Ghostscript), turned by its EXIF
    orientation, in RGB with any transparency on white.

    The size is read from the header and checked against ``max_pixels`` before any pixel is
    decoded, so a small file that decompresses to a huge image costs nothing."""
    from PIL import Image, UnidentifiedImageError
    from vllm.multimodal.image import convert_image_mode, normalize_image
    from vllm.multimodal.image import open_image as open_allowed_format

    try:
        image = open_allowed_format(io.BytesIO(data))
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            raise BadImage(f"is {width}x{height} pixels; at most {max_pixels:,} (api.images.max_pixels)")
        image = normalize_image(image)
        image.load()
        return convert_image_mode(image, "RGB")
    except BadImage:
        raise
    except Image.DecompressionBombError as error:
        raise BadImage(f"is too large: {error}") from None
    except UnidentifiedImageError:
        raise BadImage("is not an image in a format served (PNG, JPEG, WebP, GIF, BMP...)") from None
    except (OSError, ValueError, SyntaxError) as error:  # truncated or damaged file
        raise BadImage(f"could not be decoded: {error}") from None


def engine_prompt(prompt_token_ids: list[int], images: tuple[bytes, ...]) -> dict[str, Any]:
    """vLLM's prompt for an engine: the token ids and, with images, each opened, under its
    digest (the prompt carries one image placeholder per image, which the engine expands)."""
    prompt: dict[str, Any] = {"prompt_token_ids": prompt_token_ids}
    if images:
        prompt["multi_modal_data"] = {"image": [open_image(data) for data in images]}
        prompt["multi_modal_uuids"] = {"image": [image_digest(data) for data in images]}
    return prompt


async def opened_prompt(prompt_token_ids: list[int], images: tuple[bytes, ...]) -> dict[str, Any]:
    """:func:`engine_prompt`, with the images opened off the event loop: the engines' front
    ends share the router's loop, and decoding a large image takes a while."""
    if not images:
        return engine_prompt(prompt_token_ids, images)
    return await asyncio.to_thread(engine_prompt, prompt_token_ids, images)
