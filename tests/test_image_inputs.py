"""A request's images at the front door, without engines: data: URLs, which URLs may be fetched,
the bounds on a file, and where a chat message's images go in its text (vLLM's own function is
the oracle). The same paths on a running deployment: test_vision_language.py."""

from __future__ import annotations

import base64
import io

import pytest
from PIL import Image

from duet.config import ImagesConfig
from duet.router.image_inputs import check_image, data_url_bytes, fetchable
from duet.router.openai_protocol import ChatMessage, chat_conversation
from duet.router.validation import InvalidRequest
from duet.worker_runtime.images import engine_prompt, image_digest


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(out, format="PNG")
    return out.getvalue()


def test_a_data_url_gives_its_bytes_and_a_bad_one_names_the_field():
    data = _png(4, 4)
    assert data_url_bytes("data:image/png;base64," + base64.b64encode(data).decode(), "f") == data
    for url, says in [("data:image/png,abc", "base64"), ("data:image/png;base64,@@", "base64"), ("image/png;base64,AA", "data:")]:
        with pytest.raises(InvalidRequest) as refused:
            data_url_bytes(url, "messages.0.content.1")
        assert refused.value.field == "messages.0.content.1" and says in refused.value.problem


def test_only_hosts_the_config_names_are_fetched():
    limits = ImagesConfig(fetch_domains=["images.example.com", "*.cdn.example.com"])
    assert fetchable("https://images.example.com/a.png", limits)
    assert fetchable("http://eu.cdn.example.com/a.png", limits)
    for url in ["https://example.com/a.png", "https://cdn.example.com.evil.org/a.png", "file:///etc/passwd",
                "ftp://images.example.com/a.png", "https:///a.png", "https://IMAGES.example.com.:80@evil.org/"]:
        assert not fetchable(url, limits), url
    assert not fetchable("https://images.example.com/a.png", ImagesConfig()), "nothing is fetched by default"


def test_an_image_is_bounded_in_bytes_and_pixels_before_it_is_decoded():
    limits = ImagesConfig(max_bytes=2000, max_pixels=100 * 100)
    assert check_image(_png(100, 100), "images.0", limits).size == (100, 100)
    cases = [(_png(101, 100), "max_pixels"), (b"x" * 2001, "max_bytes"), (b"not an image at all", "not an image"), (b"", "empty")]
    for data, says in cases:
        with pytest.raises(InvalidRequest) as refused:
            check_image(data, "images.3", limits)
        assert refused.value.field == "images.3" and says in refused.value.problem, refused.value


def test_images_travel_as_files_keyed_by_their_digest():
    red, blue = _png(8, 8), _png(9, 9)
    prompt = engine_prompt([1, 2, 3], (red, blue))
    assert prompt["prompt_token_ids"] == [1, 2, 3]
    assert [image.size for image in prompt["multi_modal_data"]["image"]] == [(8, 8), (9, 9)]
    assert prompt["multi_modal_uuids"] == {"image": [image_digest(red), image_digest(blue)]}
    assert engine_prompt([1], ()) == {"prompt_token_ids": [1]}


def _message(*parts: dict) -> ChatMessage:
    return ChatMessage.model_validate({"role": "user", "content": list(parts)})


TEXT = {"type": "text", "text": "what is it"}
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}


@pytest.mark.parametrize("parts", [
    [IMAGE, TEXT], [TEXT, IMAGE], [IMAGE], [IMAGE, IMAGE, TEXT, TEXT], [TEXT, TEXT],
    [{"type": "text", "text": "look: <image> here"}, IMAGE], [{"type": "text", "text": "<image><image>"}, IMAGE, IMAGE, IMAGE],
])
def test_a_messages_images_go_where_vllm_puts_them(parts):
    """For a template that reads content as text: vLLM's _get_full_multimodal_text_prompt."""
    from vllm.renderers.chat_utils import _get_full_multimodal_text_prompt

    texts = [part["text"] for part in parts if part["type"] == "text"]
    images = sum(part["type"] == "image_url" for part in parts)
    expected = _get_full_multimodal_text_prompt({"image": ["<image>"] * images}, texts, False) if images else "\n".join(texts)
    (rendered,) = chat_conversation([_message(*parts)], "string", "<image>")
    assert rendered["content"] == expected


def test_parts_for_a_template_that_iterates_them_and_images_refused_where_not_taken():
    (rendered,) = chat_conversation([_message(TEXT, IMAGE)], "openai", "<image>")
    assert rendered["content"] == [{"type": "text", "text": "what is it"}, {"type": "image"}]
    tool = ChatMessage.model_validate({"role": "tool", "content": [TEXT, TEXT]})
    assert chat_conversation([tool], "openai")[0]["content"] == "what is it\nwhat is it"
    with pytest.raises(InvalidRequest) as refused:
        chat_conversation([_message(TEXT), _message(TEXT, IMAGE)], "string")
    assert refused.value.field == "messages.1.content.1"
    with pytest.raises(InvalidRequest) as refused:
        chat_conversation([_message({"type": "text", "text": "<image> <image>"}, IMAGE)], "string", "<image>")
    assert refused.value.field == "messages"


def test_images_are_decoded_as_vllms_server_decodes_them():
    """Transparency on white, EXIF orientation applied, and only the formats vLLM serves (an
    EPS file would reach Ghostscript): vLLM's own loader is the oracle."""
    from vllm.multimodal.media.image import ImageMediaIO

    from duet.worker_runtime.images import BadImage, open_image

    transparent = io.BytesIO()
    Image.new("RGBA", (6, 4), (200, 10, 10, 80)).save(transparent, format="PNG")
    rotated = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    Image.new("RGB", (8, 3), (10, 200, 30)).save(rotated, format="JPEG", exif=exif)
    palette = io.BytesIO()
    Image.new("P", (5, 5), 0).save(palette, format="PNG", transparency=0)
    for data in (transparent.getvalue(), rotated.getvalue(), palette.getvalue()):
        ours, theirs = open_image(data), ImageMediaIO(image_mode="RGB").load_bytes(data).media
        assert (ours.mode, ours.size, ours.tobytes()) == (theirs.mode, theirs.size, theirs.tobytes())
    assert open_image(rotated.getvalue()).size == (3, 8)
    with pytest.raises(BadImage, match="not an image"):
        open_image(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nshowpage\n")
