"""Images in: vision towers, and image features spliced into a forward (image inputs checked,
decoded and rendered into prompts, without torch: images.py).

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
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfigError
from .images import ImageLayout, load_image

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

