"""Images on the prompt side, without torch: image inputs checked and decoded, their cache keys,
the `ImageLayout` a model lays them out by, and chat prompts rendered with them.

The environment actor and the gateway render and check prompts here and never run a tower, so the
environment's process does not import torch; vision.py holds the towers, `ImageRows`, the built-in
layout and the design note (an image is a run of placeholder tokens).

Image input invariants (`load_image`): the bytes decode completely as PNG, JPEG, GIF, BMP or WebP;
the image has at most `MAX_IMAGE_PIXELS` pixels, checked from the header before any decoding;
anything else is an `ImageInputError` that says what was wrong.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from postrain.core.errors import PostrainError

if TYPE_CHECKING:
    import numpy as np
    import torch


MAX_IMAGE_PIXELS = 64_000_000          # 8000 x 8000; a larger image is refused before decoding
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "BMP", "WEBP")
DATA_URL_PREFIX = "data:image/"


class ImageInputError(PostrainError, ValueError):
    """An image that cannot be used: empty, truncated, too large, of an unsupported format, or
    given to a model that reads text only."""


ImageLike = Any   # bytes | str (a data URL) | PIL.Image.Image


def image_bytes(image: ImageLike) -> bytes:
    """The file bytes of an image given as bytes, a base64 data URL, or a PIL image (saved as PNG)."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, str):
        if not image.startswith(DATA_URL_PREFIX) or ";base64," not in image:
            raise ImageInputError(f"an image string must be a base64 data URL ({DATA_URL_PREFIX}png;base64,...), "
                                  f"got {image[:40]!r}; fix: inline the image's bytes as a data URL")
        try:
            return base64.b64decode(image.split(";base64,", 1)[1], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageInputError(f"the image data URL's base64 does not decode ({exc}); fix: encode the "
                                  "file's bytes with base64") from None
    from PIL import Image

    if isinstance(image, Image.Image):
        out = io.BytesIO()
        image.save(out, format="PNG")
        return out.getvalue()
    raise ImageInputError(f"an image must be bytes, a data URL or a PIL image, got {type(image).__name__}")


def load_image(image: ImageLike):
    """The image as an RGB PIL image, checked (module docstring); ImageInputError otherwise."""
    from PIL import Image

    data = image_bytes(image)
    if not data:
        raise ImageInputError("the image is empty (0 bytes); fix: pass the file's contents")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)      # refused below, by our limit
            with Image.open(io.BytesIO(data)) as probe:                         # reads the header only
                fmt, (width, height) = probe.format, probe.size
    except Image.DecompressionBombError as exc:   # PIL's own limit, above MAX_IMAGE_PIXELS
        raise ImageInputError(f"the image is too large ({exc}); at most {MAX_IMAGE_PIXELS:,} pixels are accepted; "
                              "fix: downscale it") from None
    except Exception as exc:   # PIL raises several types for unreadable headers
        raise ImageInputError(f"the image's {len(data)} bytes are not an image file PIL can read ({exc}); "
                              f"fix: send a {', '.join(IMAGE_FORMATS)} file") from None
    if fmt not in IMAGE_FORMATS:
        raise ImageInputError(f"image format {fmt} is not supported; fix: convert it to PNG or JPEG")
    if width * height > MAX_IMAGE_PIXELS or width < 1 or height < 1:
        raise ImageInputError(f"the image is {width} x {height} pixels; at most {MAX_IMAGE_PIXELS:,} pixels "
                              "are accepted; fix: downscale it")
    try:
        with Image.open(io.BytesIO(data)) as decoded:
            decoded.load()                                   # raises on a truncated file
            return decoded.convert("RGB")
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageInputError(f"the {fmt} image ({width} x {height}) does not decode completely ({exc}); "
                              "fix: send the whole file") from None


def image_key(rgb) -> str:
    """The content hash an image is cached and prefix-matched by: sha256 of a decoded RGB image's
    pixels and size (`load_image`'s result: the same picture as PNG bytes, a data URL or a PIL
    image has the same key)."""
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def images_salt(keys: list[str]) -> int:
    """A prefix-cache salt (an int in [0, 2**64)) of a prompt's image keys, in order; 0 for none."""
    if not keys:
        return 0
    return int.from_bytes(hashlib.sha256("|".join(keys).encode()).digest()[:8], "little") or 1


def content_parts_for_template(messages: list[dict]) -> tuple[list[dict], list[str]]:
    """Messages with OpenAI `image_url` content parts as `{"type": "image"}` (what chat templates
    render as the image marker), and the images' URLs in order: (messages, images)."""
    out: list[dict] = []
    images: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, dict) and part.get("type") == "image_url":
                    images.append(part["image_url"]["url"])
                    parts.append({"type": "image"})
                else:
                    parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, images


class ImageLayout:
    """How a model lays an image out in its prompt, and its pixel values: what the tower's config
    alone decides, so the environment actor (no weights) renders prompts as the model does. A family
    subclasses it; `layout_of(vision)` builds one from a model config's `vision` table."""

    def __init__(self, vision: dict):
        self.vision = vision
        self.image_token_id = int(vision["image_token_id"])   # the placeholder id of one feature row
        self.marker = str(vision["marker"])                   # the chat template's text for an image

    def image_token_run(self, image) -> list[int]:
        """The token ids that stand for `image` (an RGB PIL image) in the prompt."""
        raise NotImplementedError

    def pixel_values(self, image) -> torch.Tensor:
        """The tower's input for an RGB PIL image (resized, normalised)."""
        raise NotImplementedError

    def expand_text(self, text: str) -> str:
        """The rendered prompt's text as it is tokenized: unchanged here. A layout whose processor
        writes each image's run as text around the marker (Gemma 3) replaces every marker with it,
        so the run tokenizes with its neighbours as the processor's text does; its `expand` then
        finds the runs in place."""
        return text

    multimodal_rope = False   # True: the model's rotary reads `rope_positions` (three per token, Qwen2.5-VL)

    def rope_positions(self, ids: Sequence[int], images: list) -> np.ndarray:
        """(3, len(ids)) int64 multimodal rotary positions of a sequence showing `images` (RGB PIL
        images, in order); only a layout with `multimodal_rope` has them."""
        raise NotImplementedError(f"{type(self).__name__} has no multimodal rotary positions")

    def expand(self, ids: list[int], marker_id: int, images: list) -> list[int]:
        """ids with the k-th `marker_id` replaced by the k-th image's token run; the count of markers
        must equal the count of images."""
        out: list[int] = []
        k = 0
        for token in ids:
            if token == marker_id:
                if k >= len(images):
                    raise ImageInputError(f"the prompt has more image markers than its {len(images)} image(s)")
                out.extend(self.image_token_run(load_image(images[k])))
                k += 1
            else:
                out.append(token)
        if k != len(images):
            raise ImageInputError(f"{len(images)} image(s) given but the prompt has {k} image marker(s); "
                                  "fix: one image content part per image")
        return out


def render_prompt(tokenizer, layout: ImageLayout | None, messages: list[dict],
                  add_generation_prompt: bool = True) -> tuple[list[int], list[bytes]]:
    """(token ids, image file bytes) of chat messages whose contents may hold image content parts:
    the chat template renders each image as the layout's marker, which becomes the image's token
    run (in the text before tokenizing where the layout's processor writes it so: `expand_text`).
    ImageInputError for an image given to a text-only model (layout None) or a broken image."""
    rendered, urls = content_parts_for_template(messages)
    if urls and layout is None:
        raise ImageInputError(f"the messages hold {len(urls)} image(s), but the model reads text only; "
                              "fix: use a vision-language model, or send text")
    text = tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt)
    if not urls:
        return tokenizer.encode(text), []
    assert layout is not None
    images = [image_bytes(url) for url in urls]
    marker_id = tokenizer.hf.token_to_id(layout.marker)
    if marker_id is None:
        raise ImageInputError(f"the tokenizer has no token {layout.marker!r} (the image marker); "
                              "fix: a tokenizer with the vision model's special tokens")
    return layout.expand(tokenizer.encode(layout.expand_text(text)), marker_id, images), images
