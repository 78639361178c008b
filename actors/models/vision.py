"""Images in: image inputs checked and decoded, vision towers, and image features spliced into a forward.

    image = load_image(data)                 # bytes | data URL | PIL.Image -> RGB PIL.Image (ImageInputError)
    tower = model.vision                     # a VisionTower, or None for a text-only model
    ids = tower.expand(ids, images)          # each image marker token -> the image's token run
    rows = tower.encode_images(images)       # (N, hidden): one row per image token, in order
    logits = model(ids[None], images=ImageRows(rows, mask=ids[None] == tower.image_token_id))

Design note: an image is a run of placeholder tokens (`tower.image_token_id`) in the token ids, so
everything that moves token ids (the engine's scheduler and KV accounting, the learner's batches,
samples) moves images for free; the pixels travel beside the ids as the image files' bytes (`images`,
in the order their markers appear). A forward takes `images` (`ImageRows`): the tower's features,
one row per image placeholder position in row-major order, spliced over those positions' token
embeddings. The chat template renders an image content part as the tower's `marker` text,
a single token that `expand` replaces with the image's run (its length may depend on the image's
size). The tower, the projector included, belongs to the model (`model.vision`), so the generator's
features and the learner's are the same numbers.

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
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from postrain.core.errors import PostrainError

from .config import ModelConfigError

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


@dataclass(frozen=True)
class ImageRows:
    """Image feature rows for one forward: `rows` (N, H) replace the token embeddings at the N
    positions `mask` (B, T) marks, in row-major order. A sequence's images fill its FIRST image
    placeholders, as many as their rows (its images sit in the prompt, before anything sampled): a
    placeholder id the policy sampled later is a token like any other, never an image (the engine's
    generator/images.py and the learner's learner/images.py both follow this rule)."""

    rows: torch.Tensor
    mask: torch.Tensor
    rope_positions: torch.Tensor | None = None   # (3, B, T): every token's multimodal rotary positions, for a
                                                 # layout with `multimodal_rope` (Qwen2.5-VL); None: the plain ones

    def splice(self, embeddings: torch.Tensor) -> torch.Tensor:
        """The (B, T, H) embeddings with the marked rows replaced; differentiable in both."""
        count = int(self.mask.sum())
        if count != self.rows.shape[0]:
            raise ValueError(f"{count} image placeholder positions but {self.rows.shape[0]} image feature "
                             "rows; every image placeholder needs its row")
        return embeddings.masked_scatter(self.mask[..., None], self.rows.to(embeddings.dtype))

    def runs_mask(self) -> torch.Tensor:
        """(B, T, T) bool: positions t and s lie in one run of consecutive marked positions (one
        image's placeholders): the pairs that see each other both ways in a model whose tower says
        `bidirectional` (Gemma 3; transformers' token_type_ids mask)."""
        starts = self.mask & ~F.pad(self.mask, (1, 0))[:, :-1]
        run = torch.where(self.mask, starts.long().cumsum(-1), 0)            # 1, 2, ... per run; 0: text
        return (run[:, :, None] == run[:, None, :]) & (run[:, :, None] > 0)


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


class VisionTower(nn.Module):
    """A vision tower and its projector: `forward(pixel_values)` -> feature rows (n, hidden), n = the
    placeholders in the image's run, `hidden` the text model's width. A family subclasses it."""

    layout: Any        # the family's ImageLayout subclass
    hidden_size: int
    bidirectional = False   # True: an image's placeholders attend to each other both ways (Gemma 3), so
                            # the learner's mask (llama.py) and the engine's chunks (generator/images.py) do

    @property
    def image_token_id(self) -> int:
        return self.layout.image_token_id

    def encode_images(self, images: list) -> torch.Tensor:
        """The feature rows of every image, concatenated in order (N, hidden)."""
        device = next(self.parameters()).device
        rows = self.encode_many([self.layout.pixel_values(load_image(image)).to(device) for image in images])
        if not rows:
            return torch.zeros(0, self.hidden_size, device=device)
        return torch.cat(rows)

    def encode_many(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's feature rows, as `forward` gives them one by one; a family whose tower
        reads several images in one pass overrides it (fewer, larger matmuls: Qwen2.5-VL, and
        `encode_tiles_together` for towers of equal tiles)."""
        return [self(values) for values in pixel_values]


def encode_tiles_together(tower: VisionTower, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
    """`encode_many` of a tower whose forward reads a stack of tiles (n, 3, H, W), each tile on its
    own into the same number of rows (Idefics3's, Gemma 3's): one forward over every image's
    tiles when they have one size, split back per image."""
    if len(pixel_values) < 2 or len({tuple(v.shape[1:]) for v in pixel_values}) > 1:
        return [tower(values) for values in pixel_values]
    rows = tower(torch.cat(pixel_values))
    per_tile = len(rows) // sum(len(v) for v in pixel_values)
    return list(rows.split([len(v) * per_tile for v in pixel_values]))


class EncoderLayer(nn.Module):
    """A pre-norm ViT layer: bidirectional attention over the patches, then a GELU MLP."""

    def __init__(self, width: int, heads: int, mlp: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(width, eps=1e-6)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width, eps=1e-6)
        self.fc1 = nn.Linear(width, mlp)
        self.fc2 = nn.Linear(mlp, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:        # (P, W)
        num, width = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(num, 3, self.heads, width // self.heads).permute(1, 2, 0, 3)
        attn = F.scaled_dot_product_attention(q, k, v)          # (heads, P, d)
        x = x + self.proj(attn.transpose(0, 1).reshape(num, width))
        return x + self.fc2(F.gelu(self.fc1(self.mlp_norm(x)), approximate="tanh"))


class PatchLayout(ImageLayout):
    """The built-in layout (kind "patch"): every image resized to a fixed `image_size` (height,
    width), `num_image_tokens` placeholders."""

    def __init__(self, vision: dict):
        super().__init__(vision)
        self.image_size = tuple(vision["image_size"])            # (height, width) in pixels
        self.patch = int(vision["patch_size"])
        self.merge = int(vision.get("merge", 2))
        height, width = self.image_size
        step = self.patch * self.merge
        if height % step or width % step:
            raise ValueError(f"vision image_size {self.image_size} must be a multiple of patch_size * merge = {step}")
        self.grid = (height // self.patch, width // self.patch)
        self.num_image_tokens = self.grid[0] * self.grid[1] // self.merge ** 2

    def image_token_run(self, image) -> list[int]:
        return [self.image_token_id] * self.num_image_tokens

    def pixel_values(self, image) -> torch.Tensor:
        """(3, height, width) float32 in [-1, 1]: bicubic resize, x / 127.5 - 1."""
        from PIL import Image

        height, width = self.image_size
        resized = image.resize((width, height), Image.Resampling.BICUBIC)
        array = np.asarray(resized, dtype=np.float32) / 127.5 - 1.0
        return torch.from_numpy(array).permute(2, 0, 1).contiguous()


class PatchTower(VisionTower):
    """The built-in tower: the `PatchLayout` image cut into square patches, a small ViT over them,
    neighbouring merge x merge patches joined, projected to the text width by a GELU MLP."""

    def __init__(self, vision: dict, hidden_size: int):
        super().__init__()
        self.layout = layout = PatchLayout(vision)
        self.hidden_size = hidden_size
        width_v, heads = int(vision["width"]), int(vision["heads"])
        self.patch_embed = nn.Linear(3 * layout.patch * layout.patch, width_v)
        self.pos_embed = nn.Parameter(torch.zeros(layout.grid[0] * layout.grid[1], width_v))
        self.layers = nn.ModuleList(EncoderLayer(width_v, heads, int(vision["mlp"]))
                                    for _ in range(int(vision["layers"])))
        self.post_norm = nn.LayerNorm(width_v, eps=1e-6)
        self.merger_fc1 = nn.Linear(width_v * layout.merge ** 2, hidden_size)
        self.merger_fc2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        p, m = self.layout.patch, self.layout.merge
        gh, gw = self.layout.grid
        x = pixel_values.to(self.patch_embed.weight.dtype)
        # (3, gh*p, gw*p) -> patches in merge-group order: (gh/m, gw/m, m, m) groups of (3, p, p)
        x = x.view(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6).reshape(gh * gw, 3 * p * p)
        pos = self.pos_embed.view(gh // m, m, gw // m, m, -1).permute(0, 2, 1, 3, 4).reshape(gh * gw, -1)
        x = self.patch_embed(x) + pos
        for layer in self.layers:
            x = layer(x)
        x = self.post_norm(x).reshape(gh * gw // m ** 2, -1)        # each merge group's m*m patches, joined
        return self.merger_fc2(F.gelu(self.merger_fc1(x), approximate="tanh"))


# a tower kind (a model config's vision["kind"]) -> (its ImageLayout, its VisionTower)
TOWER_KINDS: dict[str, tuple[type[ImageLayout], type]] = {"patch": (PatchLayout, PatchTower)}


def _kind(vision: dict) -> tuple[type[ImageLayout], type]:
    kind = vision.get("kind", "patch")
    if kind not in TOWER_KINDS:
        raise ValueError(f"unknown vision tower kind {kind!r}; known: {sorted(TOWER_KINDS)}")
    return TOWER_KINDS[kind]


def layout_of(vision: dict) -> ImageLayout:
    """The image layout of a model config's `vision` table (no weights)."""
    return _kind(vision)[0](vision)


def build_tower(vision: dict, hidden_size: int) -> VisionTower:
    """The tower of a model config's `vision` table (its "kind" picks the class)."""
    return _kind(vision)[1](vision, hidden_size)


def batch_rope_positions(layout: ImageLayout, input_ids: torch.Tensor, images: list[list],
                         attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """(3, B, T) int64 multimodal rotary positions of a padded batch whose row b shows images[b]
    (RGB PIL images, in order), each row's real tokens (attention_mask; all without it) laid out by
    `layout.rope_positions` and its padding at 0; None for a layout without `multimodal_rope`."""
    if not layout.multimodal_rope:
        return None
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    out = torch.zeros((3, *input_ids.shape), dtype=torch.long)
    for b, (ids, keep) in enumerate(zip(input_ids.cpu(), real.cpu())):
        out[:, b, keep] = torch.from_numpy(layout.rope_positions(ids[keep].tolist(), images[b]))
    return out.to(input_ids.device)


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


def folder_processor_fields(hf: dict, folder, read_table) -> dict:
    """A vision family's `folder_config_fields`: what its folder's processor and tokenizer files add to
    config.json (`read_table(hf, folder)`), none where config.json keeps postrain's own table."""
    return {} if "postrain_vision" in hf else {"postrain_processor": read_table(hf, folder)}


def processor_table(hf: dict) -> dict:
    """The processor settings `folder_processor_fields` read; ModelConfigError when config.json was
    read without its folder."""
    processor = hf.get("postrain_processor")
    if processor is None:
        raise ModelConfigError("the image layout's settings come from the model folder (its processor config "
                               "and tokenizer files); load the folder, not its config.json alone")
    return processor

