"""A request's images, checked at the front door before any worker sees them.

Both APIs take images for a vision-language model: the OpenAI chat API as ``image_url`` content
parts (``data:`` URLs; ``http(s)`` URLs only from the hosts ``api.images.fetch_domains`` names),
the gRPC API as bytes. Each image is bounded in count, bytes and pixels (``api.images``), opened
to prove it is one, and counted against the prompt's image placeholders; the prompt is then
expanded as the engine will expand it, each placeholder into the image's tokens, by vLLM's own
processor: its length is what the context must hold and what usage counts. A bad image is
refused naming it (``images.1``, ``messages.0.content.2``), as any other bad field is.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import fnmatch
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit

from duet.config import ImagesConfig
from duet.router.validation import InvalidRequest
from duet.worker_runtime.images import BadImage, image_digest, open_image


class ImagePrompts(Protocol):
    """How the served model takes images (a vLLM engine's front end answers it:
    :class:`EngineImagePrompts`)."""

    placeholder: str  # the text that stands for one image in a prompt ("<image>")
    placeholder_ids: list[int]  # its token ids

    def expand(self, prompt_token_ids: list[int], images: list[Any], digests: list[str]) -> list[int]:
        """The prompt as the engine computes it, each placeholder expanded into its image's tokens."""
        ...


def check_image(data: bytes, field: str, limits: ImagesConfig) -> Any:
    """The image ``data`` holds, opened; InvalidRequest naming ``field`` if it is too large or
    not an image."""
    if len(data) > limits.max_bytes:
        raise InvalidRequest(field, f"{len(data):,} bytes; at most {limits.max_bytes:,} (api.images.max_bytes)")
    if not data:
        raise InvalidRequest(field, "is empty")
    try:
        return open_image(data, limits.max_pixels)
    except BadImage as error:
        raise InvalidRequest(field, str(error)) from None


@dataclass(frozen=True)
class ImageChecker:
    """Validation's check of a prompt's images (``ImageCheck``) for one served model: its image
    handling and the config's bounds."""

    prompts: ImagePrompts
    limits: ImagesConfig

    def __call__(self, prompt_ids: list[int], images: list[bytes]) -> list[int]:
        """Check a prompt's ``images`` (gRPC field names: ``images.N``) against the prompt;
        returns the prompt as the engine computes it."""
        limits, prompts = self.limits, self.prompts
        if len(images) > limits.max_per_request:
            raise InvalidRequest("images", f"{len(images)} images; at most {limits.max_per_request} (api.images.max_per_request)")
        opened = [check_image(data, f"images.{index}", limits) for index, data in enumerate(images)]
        found = _occurrences(prompt_ids, prompts.placeholder_ids)
        if found != len(images):
            raise InvalidRequest(
                "images",
                f"{len(images)} image(s) but the prompt has {found} {prompts.placeholder!r} placeholder(s): one per image, in order",
            )
        try:
            return prompts.expand(prompt_ids, opened, [image_digest(data) for data in images])
        except (ValueError, RuntimeError) as error:  # vLLM's processor refused the pair
            raise InvalidRequest("images", f"the model's processor refused them: {error}") from None


def _occurrences(ids: list[int], sequence: list[int]) -> int:
    """How often ``sequence`` occurs in ``ids``, without overlaps."""
    if not sequence:
        return 0
    if len(sequence) == 1:
        return ids.count(sequence[0])
    count = index = 0
    while index <= len(ids) - len(sequence):
        if ids[index:index + len(sequence)] == sequence:
            count, index = count + 1, index + len(sequence)
        else:
            index += 1
    return count


def data_url_bytes(url: str, field: str) -> bytes:
    """The bytes of a ``data:[<type>];base64,<data>`` URL (RFC 2397, as OpenAI's clients send
    images)."""
    header, comma, payload = url.partition(",")
    if not comma or not header.startswith("data:"):
        raise InvalidRequest(field, "a data: URL must look like data:image/png;base64,<data>")
    if not header.endswith(";base64"):
        raise InvalidRequest(field, "a data: URL must be base64 (data:image/png;base64,<data>)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(field, "the data: URL's base64 is not valid") from None


def fetchable(url: str, limits: ImagesConfig) -> bool:
    """Whether ``url`` is an http(s) URL on a host the config lets front doors fetch from."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    return parts.scheme in ("http", "https") and bool(host) and any(
        fnmatch.fnmatchcase(host, pattern.lower()) for pattern in limits.fetch_domains
    )


async def image_url_bytes(url: str, field: str, limits: ImagesConfig) -> bytes:
    """The image an ``image_url`` part names: a ``data:`` URL's bytes, or an allowed URL's body,
    fetched within ``fetch_timeout_s`` and ``max_bytes``."""
    if url.startswith("data:"):
        return data_url_bytes(url, field)
    if not fetchable(url, limits):
        parts = urlsplit(url)
        if not limits.fetch_domains:
            raise InvalidRequest(field, "this server fetches no image URLs: send the image as a data: URL (api.images.fetch_domains)")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest(field, "must be a data: URL or an http(s) URL on a host api.images.fetch_domains names")
        raise InvalidRequest(field, f"{parts.hostname!r} is not a host this server fetches images from (api.images.fetch_domains)")
    return await _fetch(url, field, limits)


async def _fetch(url: str, field: str, limits: ImagesConfig) -> bytes:
    import httpx

    try:
        async with asyncio.timeout(limits.fetch_timeout_s), httpx.AsyncClient(follow_redirects=False, trust_env=False) as http:
            async with http.stream("GET", url) as response:
                if response.status_code != 200:
                    raise InvalidRequest(field, f"fetching {url} answered HTTP {response.status_code}")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > limits.max_bytes:
                        raise InvalidRequest(field, f"{url} is over {limits.max_bytes:,} bytes (api.images.max_bytes)")
                return bytes(body)
    except (TimeoutError, httpx.TimeoutException):
        raise InvalidRequest(field, f"{url} did not answer within {limits.fetch_timeout_s:g} s (api.images.fetch_timeout_s)") from None
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        raise InvalidRequest(field, f"{url} could not be fetched: {error}") from None


class EngineImagePrompts:
    """:class:`ImagePrompts` of a vLLM engine's front end (``vllm.AsyncLLM``): its model's image
    placeholder, and its own multimodal processor to expand a prompt. The processor runs with
    its processor-only cache, never the cache it shares with the engine core, which would then
    believe the core holds images it was never sent."""

    def __init__(self, engine: Any) -> None:
        from vllm.model_executor.model_loader import get_model_cls

        self._renderer = engine.renderer
        self.placeholder = get_model_cls(engine.model_config).get_placeholder_str("image", 1)
        self.placeholder_ids = list(self._renderer.get_tokenizer().encode(self.placeholder, add_special_tokens=False))

    @classmethod
    def of(cls, engine: Any) -> "EngineImagePrompts | None":
        """The engine's image handling; None if its model takes no images (a text model, or a
        multimodal one without images, such as an audio model)."""
        if not engine.model_config.is_multimodal_model:
            return None
        try:
            return cls(engine)
        except ValueError:  # the model has no image placeholder
            return None

    def expand(self, prompt_token_ids: list[int], images: list[Any], digests: list[str]) -> list[int]:
        """Blocks until done: call it off the event loop. It runs on the renderer's one
        multimodal thread, as the engine's own input processing does, since vLLM's processor
        must never run twice at once."""
        renderer = self._renderer
        processed = renderer._mm_executor.submit(
            renderer._process_multimodal, list(prompt_token_ids), {"image": images}, {"image": digests}, None,
            skip_mm_cache=True,
        ).result()
        return list(processed["prompt_token_ids"])
