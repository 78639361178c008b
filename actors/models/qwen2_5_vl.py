"""Qwen2.5-VL (HF `model_type` "qwen2_5_vl"): a windowed ViT with 2-D rotary, a patch merger and a
Qwen2 decoder whose rotary reads three positions per token (transformers'
Qwen2_5_VLForConditionalGeneration).

    model, tokenizer = load_model("/ckpt/Qwen2.5-VL-3B-Instruct")
    ids, images = render_prompt(tokenizer, model.vision.layout, messages)     # models/vision.py
    ids = torch.tensor([ids])
    rows = model.vision.encode_images(images)                                # (N, hidden)
    rope = batch_rope_positions(model.vision.layout, ids, [[load_image(i) for i in images]])   # (3, 1, T)
    logits = model(ids, images=ImageRows(rows, ids == model.vision.image_token_id, rope))

The parts, and their Hugging Face names:
- the decoder: `LlamaModel` over the Qwen2 text config (bias on q/k/v; config.json's `text_config`, or
  its top level in transformers 4's layout); `model.*` and `lm_head.weight` as is
  (`model.language_model.*` read as `model.*`);
- the multimodal rotary (mrope): every token has three positions (temporal, height, width); the
  rotary's frequencies are split by `mrope_section` (sizes summing to head_dim / 2), the i-th part
  rotated by axis i % 3. A text token's three positions are equal (so a text-only forward is the
  plain rotary, same numbers); an image's tokens get its (t, h, w) merged-grid indices offset by
  the position after the text before it; the text after it continues from that offset + max(h, w).
  `Qwen2_5_VLLayout.rope_positions` computes them from the ids and the images' sizes; a forward
  reads them from `ImageRows.rope_positions` (3, B, T) (the generator's images.py and the
  learner's images.py build them; positions past a prompt are p + the prompt's rope delta);
- the tower (`Qwen2_5_VLTower`, `model.vision`, kind "qwen2_5_vl"; `visual.*` -> `vision.*`): a
  linear patch embedding of temporal_patch_size x patch x patch (transformers' Conv3d), blocks of
  RMSNorm, attention with a 2-D rotary (height, width) and a SwiGLU MLP; the blocks of
  `fullatt_block_indexes` attend over the whole image, the others within windows of
  window_size pixels; then the merger (RMSNorm, merge x merge patches joined, a GELU MLP to
  the text width): one row per `<|image_pad|>`, in raster order of the merged grid;
- the layout (`Qwen2_5_VLLayout`): Qwen2VLImageProcessor's pixels (smart_resize to multiples of
  patch x merge within [min_pixels, max_pixels], PIL bicubic, rescale, normalise; `patches` is its
  flat patch layout) and the prompt's run for an image: grid_h * grid_w / merge^2 `<|image_pad|>`
  tokens (the chat template writes `<|vision_start|>` and `<|vision_end|>` around the marker).

Where the settings come from: config.json (text_config, vision_config, image_token_id, ...), the
image processor's files (preprocessor_config.json, or transformers 5's processor_config.json with
it nested; transformers' defaults where absent) and the tokenizer's id of `<|image_pad|>`;
`folder_config_fields` reads them at load into `config.vision`. postrain's exports keep that
table in config.json (`postrain_vision`) and write preprocessor_config.json, so a saved folder
loads in transformers and in postrain.

Refused, naming the field: a rope type other than default / mrope, an mrope_section that does
not sum to head_dim / 2, use_sliding_window, a vision hidden_act other than silu, do_resize
false, a processor whose patch, merge or temporal size differs from the tower's, a window
smaller than one merged patch, an out_hidden_size other than the text width, a tokenizer whose
`<|image_pad|>` is not config.json's image_token_id. Videos are not supported.
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .blocks import RMSNorm, rotate_half
from .config import ModelConfig, ModelConfigError
from .llama import LlamaModel
from .images import ImageInputError, ImageLayout
from .vision import TOWER_KINDS, folder_processor_fields, ImageRows, processor_table, VisionTower

# transformers' Qwen2_5_VLVisionConfig defaults (released config.json files omit some)
VISION_DEFAULTS = {"depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420,
                   "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "tokens_per_second": 4, "window_size": 112, "out_hidden_size": 3584,
                   "fullatt_block_indexes": [7, 15, 23, 31]}
# transformers' Qwen2_5_VLTextConfig defaults that differ from postrain's generic ones
TEXT_DEFAULTS = {"rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0, "max_position_embeddings": 32768}
MROPE_SECTION = [16, 24, 24]   # transformers' default
TOKEN_DEFAULTS = {"image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
                  "vision_end_token_id": 151653}
# Qwen2VLImageProcessor's defaults (resample 3: BICUBIC; OpenAI CLIP's mean and std)
PROCESSOR_DEFAULTS = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280, "patch_size": 14,
                      "temporal_patch_size": 2, "merge_size": 2, "do_resize": True, "resample": 3,
                      "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                      "image_mean": [0.48145466, 0.4578275, 0.40821073],
                      "image_std": [0.26862954, 0.26130258, 0.27577711]}
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")   # read in this order
MARKER = "<|image_pad|>"
MAX_ASPECT_RATIO = 200          # transformers' smart_resize refuses a longer side over 200 x the shorter


# ----------------------------------------------------------------------------- the layout


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize: (height, width) multiples of `factor`, the pixel count within
    [min_pixels, max_pixels], the aspect ratio kept as closely as that allows."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageInputError(f"the image is {width} x {height} pixels: an aspect ratio over {MAX_ASPECT_RATIO} "
                              "(Qwen2.5-VL's limit); fix: crop or pad it")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class Qwen2_5_VLLayout(ImageLayout):
    """Qwen2VLImageProcessor's pixels and the processor's token run of an image (module
    docstring); config-only (`config.vision`)."""

    multimodal_rope = True

    def __init__(self, vision: dict):
        super().__init__(vision)
        self.patch, self.temporal = int(vision["patch_size"]), int(vision["temporal_patch_size"])
        self.merge = int(vision["merge_size"])
        self.min_pixels, self.max_pixels = int(vision["min_pixels"]), int(vision["max_pixels"])
        self.resample = int(vision["resample"])
        self.rescale_factor = float(vision["rescale_factor"]) if vision["do_rescale"] else None
        self.normalize = ((np.asarray(vision["image_mean"], dtype=np.float32),
                           np.asarray(vision["image_std"], dtype=np.float32)) if vision["do_normalize"] else None)

    def size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) in pixels after the resize."""
        return smart_resize(height, width, self.patch * self.merge, self.min_pixels, self.max_pixels)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of patches of an image of this size (image_grid_thw's h and w; t is 1)."""
        resized = self.size(height, width)
        return resized[0] // self.patch, resized[1] // self.patch

    def image_token_run(self, image) -> list[int]:
        rows, cols = self.grid(image.height, image.width)
        return [self.image_token_id] * (rows * cols // self.merge ** 2)

    def pixel_values(self, image) -> torch.Tensor:
        """(3, height, width) float32: resized, rescaled and normalised as transformers' PIL backend
        does (float64 rescale cast to float32, then (x - mean) / std in float32)."""
        from PIL import Image

        height, width = self.size(image.height, image.width)
        x = np.asarray(image.resize((width, height), Image.Resampling(self.resample)))     # (H, W, 3) uint8
        if self.rescale_factor is not None:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.normalize is not None:
            mean, std = self.normalize
            x = (x.astype(np.float32) - mean) / std
        return torch.from_numpy(x.astype(np.float32)).permute(2, 0, 1).contiguous()

    def patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(grid_h * grid_w, 3 * temporal * patch * patch): transformers' flat pixel_values of one
        image (patches in merge-block order, the frame repeated temporal_patch_size times)."""
        p, m = self.patch, self.merge
        channels, height, width = pixel_values.shape
        gh, gw = height // p, width // p
        x = pixel_values.reshape(channels, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        x = x[:, :, :, :, :, None].expand(*x.shape[:5], self.temporal, p, p)
        return x.reshape(gh * gw, channels * self.temporal * p * p)

    def rope_positions(self, ids: Sequence[int], images: list) -> np.ndarray:
        """(3, len(ids)) int64 positions (module docstring): the k-th image (an RGB PIL image) takes
        the next grid_h * grid_w / merge^2 image placeholders, which must be one run. ImageInputError
        when the placeholders run out or an image's are split."""
        out = np.empty((3, len(ids)), dtype=np.int64)
        placeholders = np.flatnonzero(np.asarray(ids, dtype=np.int64) == self.image_token_id)
        position = token = used = 0         # next text position, next token, placeholders taken
        for k, image in enumerate(images):
            rows, cols = (n // self.merge for n in self.grid(image.height, image.width))
            count = rows * cols
            if used + count > len(placeholders) or placeholders[used + count - 1] - placeholders[used] != count - 1:
                raise ImageInputError(f"image {k} needs a run of {count} image placeholders and the prompt does not "
                                      "have it there; render the prompt with the model's layout (render_prompt)")
            start = int(placeholders[used])
            out[:, token:start] = position + np.arange(start - token)
            position += start - token
            out[0, start:start + count] = position
            out[1, start:start + count] = position + np.repeat(np.arange(rows), cols)
            out[2, start:start + count] = position + np.tile(np.arange(cols), rows)
            position += max(rows, cols)
            token, used = start + count, used + count
        out[:, token:] = position + np.arange(len(ids) - token)
        return out


# ----------------------------------------------------------------------------- the tower


class PatchEmbed(nn.Module):
    """transformers' Conv3d patch embedding (kernel = stride = temporal x patch x patch, no bias),
    applied to flat patches as the matrix product it is."""

    def __init__(self, channels: int, temporal: int, patch: int, width: int):
        super().__init__()
        self.proj = nn.Conv3d(channels, width, (temporal, patch, patch), (temporal, patch, patch), bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1))


class VisionAttention(nn.Module):
    """Bidirectional attention with the 2-D rotary, within the given groups of rows."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                groups: list[torch.Tensor]) -> torch.Tensor:
        """x (N, W); cos, sin (N, 1, d); groups: (windows, L) row indices, every row in one window."""
        num = x.shape[0]
        q, k, v = self.qkv(x).view(num, 3, self.heads, -1).unbind(1)                # (N, heads, d)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        outs = [F.scaled_dot_product_attention(*(t[index].transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
                for index in groups]                                                # (windows, L, heads, d) each
        order = torch.cat([index.reshape(-1) for index in groups])
        out = torch.cat([o.reshape(-1, *o.shape[2:]) for o in outs])[torch.argsort(order)]
        return self.proj(out.reshape(num, -1))


class VisionMLP(nn.Module):
    def __init__(self, width: int, inner: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(width, inner), nn.Linear(width, inner)
        self.down_proj = nn.Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, width: int, heads: int, inner: int):
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(width, 1e-6), RMSNorm(width, 1e-6)
        self.attn = VisionAttention(width, heads)
        self.mlp = VisionMLP(width, inner)

    def forward(self, x, cos, sin, groups):
        x = x + self.attn(self.norm1(x), cos, sin, groups)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, width: int, merge: int, hidden_size: int):
        super().__init__()
        self.joined = joined = width * merge ** 2
        self.ln_q = RMSNorm(width, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(joined, joined), nn.GELU(), nn.Linear(joined, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.joined))


class Qwen2_5_VLTower(VisionTower):
    """The windowed ViT and the merger: `forward(pixel_values (3, H, W))` -> rows (grid_h *
    grid_w / merge^2, text hidden) in raster order of the merged grid. Module names are
    transformers' (`visual.*`), so the state maps by prefix only."""

    def __init__(self, vision: dict, hidden_size: int):
        super().__init__()
        self.layout = layout = Qwen2_5_VLLayout(vision)
        self.hidden_size = hidden_size
        width, heads = int(vision["hidden_size"]), int(vision["num_heads"])
        self.head_dim = width // heads
        self.rope_theta = float(vision["rope_theta"])
        self.window = int(vision["window_size"]) // layout.merge // layout.patch   # in merged patches
        self.full = {int(i) for i in vision["fullatt_block_indexes"]}
        self.patch_embed = PatchEmbed(3, layout.temporal, layout.patch, width)
        self.blocks = nn.ModuleList(VisionBlock(width, heads, int(vision["intermediate_size"]))
                                    for _ in range(int(vision["depth"])))
        self.merger = PatchMerger(width, layout.merge, hidden_size)

    def windows(self, rows: int, cols: int) -> tuple[torch.Tensor, list[int]]:
        """(the merged patches in window order (rows * cols,), each window's length in merged
        patches): windows of self.window x self.window merged patches, raster order, as
        transformers' get_vision_window_index."""
        index = torch.arange(rows * cols).view(rows, cols)
        order, lengths = [], []
        for r in range(0, rows, self.window):
            for c in range(0, cols, self.window):
                block = index[r:r + self.window, c:c + self.window].reshape(-1)
                order.append(block)
                lengths.append(len(block))
        return torch.cat(order), lengths

    def rotary(self, rows: int, cols: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (gh * gw, head_dim) of every patch in merge-block order: the 2-D rotary (half the
        rotated pairs turn with the patch's row, the other half with its column)."""
        m = self.layout.merge
        half = self.head_dim // 2
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float, device=device) / half))
        h = torch.arange(rows * m, device=device)[:, None].expand(-1, cols * m)
        w = torch.arange(cols * m, device=device)[None, :].expand(rows * m, -1)
        h, w = (t.reshape(rows, m, cols, m).transpose(1, 2).reshape(-1) for t in (h, w))
        freqs = torch.cat([h[:, None].float() * inv_freq, w[:, None].float() * inv_freq], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.encode_many([pixel_values])[0]

    def encode_many(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each image's rows from one pass over all their patches, as transformers' tower reads a
        batch: every image's patches in window order, one after another; a window, and a
        full-attention block, attend within one image only."""
        if not pixel_values:
            return []
        m, unit = self.layout.merge, self.layout.merge ** 2
        device = pixel_values[0].device
        xs, cos, sin, orders, lengths = [], [], [], [], []
        for values in pixel_values:
            rows, cols = values.shape[1] // (self.layout.patch * m), values.shape[2] // (self.layout.patch * m)
            x = self.patch_embed(self.layout.patches(values))                     # (N, W), merge-block order
            order, window_lengths = self.windows(rows, cols)
            order = order.to(device)
            patch_order = (order[:, None] * unit + torch.arange(unit, device=device)).reshape(-1)
            xs.append(x[patch_order])                                              # window order
            c, s = self.rotary(rows, cols, device)
            cos.append(c[patch_order])
            sin.append(s[patch_order])
            orders.append(order)
            lengths += [n * unit for n in window_lengths]
        x = torch.cat(xs)
        cos_all, sin_all = torch.cat(cos)[:, None, :], torch.cat(sin)[:, None, :]
        window_groups = self._groups(lengths, device)
        wholes = self._groups([len(one) for one in xs], device)            # each image whole
        for idx, block in enumerate(self.blocks):
            x = block(x, cos_all, sin_all, wholes if idx in self.full else window_groups)
        merged = self.merger(x)                                         # (N / unit, hidden), window order
        out, start = [], 0
        for order in orders:
            out.append(merged[start:start + len(order)][torch.argsort(order)])
            start += len(order)
        return out

    @staticmethod
    def _groups(lengths: list[int], device) -> list[torch.Tensor]:
        """The windows of these consecutive lengths as (windows, L) row indices, one tensor per length."""
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        by_length: dict[int, list[int]] = {}
        for start, length in zip(starts.tolist(), lengths):
            by_length.setdefault(length, []).append(start)
        return [torch.tensor(firsts, device=device)[:, None] + torch.arange(length, device=device)[None]
                for length, firsts in by_length.items()]


TOWER_KINDS["qwen2_5_vl"] = (Qwen2_5_VLLayout, Qwen2_5_VLTower)


# ----------------------------------------------------------------------------- config and state


def _processor_table(hf: dict, folder: Path) -> dict:
    """The layout's settings from the folder's image processor files (transformers' defaults where
    absent) and the id of `<|image_pad|>` from its tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer

    from .hf_config import CheckpointError

    settings: dict[str, Any] = dict(PROCESSOR_DEFAULTS)
    for name in PROCESSOR_FILES:
        if (folder / name).is_file():
            data = json.loads((folder / name).read_text())
            data = data.get("image_processor") or data                  # nested in transformers 5's layout
            size = data.get("size") or {}
            settings.update({k: v for k, v in data.items() if k != "size"})
            for key, names in (("min_pixels", ("shortest_edge", "min_pixels")),
                               ("max_pixels", ("longest_edge", "max_pixels"))):
                found = [size[n] for n in names if size.get(n)]
                if key not in data and found:         # a top-level min_pixels / max_pixels wins, as in transformers
                    settings[key] = found[0]
    if not settings["do_resize"]:
        raise CheckpointError(f"{folder}: the image processor's do_resize=false is not supported (the patch grid "
                              "would depend on the raw size); set it to true, as the released models do")
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"{folder} has no tokenizer.json; the id of a qwen2_5_vl model's {MARKER} comes "
                              "from it: copy the model's tokenizer files into the folder")
    tokenizer = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    keys = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "resample")
    return {"marker": MARKER, "marker_id": tokenizer.token_to_id(MARKER),
            **{key: int(settings[key]) for key in keys},
            "do_rescale": bool(settings["do_rescale"]), "rescale_factor": float(settings["rescale_factor"]),
            "do_normalize": bool(settings["do_normalize"]),
            "image_mean": [float(v) for v in settings["image_mean"]],
            "image_std": [float(v) for v in settings["image_std"]]}


def _text_fields(hf: dict) -> dict:
    """The decoder's config.json fields: `text_config` over the top level (transformers 4's
    layout keeps them there), with transformers' defaults for this family."""
    top = {k: v for k, v in hf.items() if k not in ("text_config", "vision_config", "postrain_processor")}
    return {**TEXT_DEFAULTS, **top, **(hf.get("text_config") or {})}


def _rope(text: dict, head_dim: int) -> tuple[float, list[int]]:
    """(rope_theta, mrope_section) of the decoder's fields; ModelConfigError for another rope."""
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ModelConfigError(f"rope type {kind!r} is not supported for qwen2_5_vl; use the default (mrope) rotary")
    section = [int(s) for s in rope.get("mrope_section", MROPE_SECTION)]
    if len(section) != 3 or sum(section) != head_dim // 2:
        raise ModelConfigError(f"mrope_section {section} must be 3 sizes summing to head_dim / 2 = {head_dim // 2}; "
                               "fix mrope_section in rope_parameters")
    return float(rope.get("rope_theta") or text["rope_theta"]), section


def _vision_table(hf: dict, section: list[int]) -> dict:
    """config.vision of a Qwen2.5-VL config.json whose folder's files were read."""
    processor = processor_table(hf)
    vision_hf = {**VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    if vision_hf["hidden_act"] != "silu":
        raise ModelConfigError(f"vision_config.hidden_act={vision_hf['hidden_act']!r} is not supported; "
                               "supported: silu")
    tokens = {key: int(hf.get(key, default)) for key, default in TOKEN_DEFAULTS.items()}
    if processor["marker_id"] != tokens["image_token_id"]:
        raise ModelConfigError(f"the tokenizer's {MARKER} is id {processor['marker_id']} but config.json's "
                               f"image_token_id is {tokens['image_token_id']}; fix: use the model's own tokenizer")
    for ours, theirs in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                         ("temporal_patch_size", "temporal_patch_size")):
        if processor[ours] != int(vision_hf[theirs]):
            raise ModelConfigError(f"the image processor's {ours}={processor[ours]} but vision_config.{theirs}="
                                   f"{vision_hf[theirs]}; fix the processor's file to match the tower")
    theta = (vision_hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return {
        "kind": "qwen2_5_vl", **tokens, **{k: v for k, v in processor.items() if k != "marker_id"},
        "depth": int(vision_hf["depth"]), "hidden_size": int(vision_hf["hidden_size"]),
        "intermediate_size": int(vision_hf["intermediate_size"]), "num_heads": int(vision_hf["num_heads"]),
        "window_size": int(vision_hf["window_size"]), "out_hidden_size": int(vision_hf["out_hidden_size"]),
        "fullatt_block_indexes": [int(i) for i in vision_hf["fullatt_block_indexes"]],
        "tokens_per_second": vision_hf["tokens_per_second"], "rope_theta": float(theta),
        "mrope_section": section,
    }


def _check_vision(vision: dict, hidden_size: int) -> None:
    if int(vision["out_hidden_size"]) != hidden_size:
        raise ModelConfigError(f"vision_config.out_hidden_size={vision['out_hidden_size']} but the text model's "
                               f"hidden_size is {hidden_size}; they must be equal")
    if int(vision["window_size"]) < int(vision["patch_size"]) * int(vision["merge_size"]):
        raise ModelConfigError(f"vision_config.window_size={vision['window_size']} is smaller than one merged patch "
                               f"({int(vision['patch_size']) * int(vision['merge_size'])} pixels); raise it")
    Qwen2_5_VLLayout(vision)


class Qwen2_5_VLModel(LlamaModel):
    """A Qwen2.5-VL model: the Qwen2 decoder with the multimodal rotary, `vision` a Qwen2_5_VLTower."""

    mrope_axis: torch.Tensor   # a buffer: the position axis (0, 1, 2) each rotary frequency turns with

    def __init__(self, config: ModelConfig):
        if not config.vision or config.vision.get("kind") != "qwen2_5_vl":
            raise ModelConfigError(f"a {config.architecture} model needs config.vision of kind 'qwen2_5_vl' "
                                   "(load it from its Hugging Face folder)")
        super().__init__(config)
        axis = [i % 3 for i, size in enumerate(config.vision["mrope_section"]) for _ in range(size)]
        self.register_buffer("mrope_axis", torch.tensor(axis, dtype=torch.long), persistent=False)

    def rotary_positions(self, positions: torch.Tensor, images: ImageRows | None) -> torch.Tensor:
        """The (3, B, T) positions the images carry (module docstring), else the plain (B, T) ones."""
        rope = None if images is None else images.rope_positions
        if rope is None:
            return positions
        if tuple(rope.shape) != (3, *positions.shape):
            raise ValueError(f"rope_positions has shape {tuple(rope.shape)}, the forward's tokens need "
                             f"(3, {', '.join(map(str, positions.shape))})")
        return rope

    def layer_rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin), each (B, T, 1, D): the plain rotary of (B, T) positions, or the multimodal one
        of (3, B, T) positions (frequency i turns with axis mrope_axis[i])."""
        if positions.dim() == 2:
            return super().layer_rotary(positions, dtype)
        freqs = positions.permute(1, 2, 0)[..., self.mrope_axis].float() * self.inv_freq.float()   # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(dtype)[:, :, None, :], emb.sin().to(dtype)[:, :, None, :]
        return [(cos, sin)] * self.config.num_layers

    @staticmethod
    def folder_config_fields(hf: dict, folder: Path) -> dict:
        """What the folder's other files add to config.json: the image processor's settings and the
        image token's id (none where config.json keeps postrain's own table)."""
        return folder_processor_fields(hf, folder, _processor_table)

    @staticmethod
    def text_config_from_hf(hf: dict) -> dict:
        """The decoder's config.json fields, with the vision table (the mrope section in it)."""
        text = _text_fields(hf)
        if text.get("use_sliding_window"):
            raise ModelConfigError("use_sliding_window=true is not supported (Qwen2's window on the upper layers); "
                                   "set it to false, as the released models do")
        if text.get("head_dim") and int(text["head_dim"]) != text["hidden_size"] // text["num_attention_heads"]:
            raise ModelConfigError(f"head_dim={text['head_dim']} is not hidden_size / num_attention_heads, which "
                                   "transformers' Qwen2.5-VL uses; remove head_dim")
        theta, section = _rope(text, text["hidden_size"] // text["num_attention_heads"])
        vision = hf.get("postrain_vision") or _vision_table(hf, section)
        _check_vision(vision, int(text["hidden_size"]))
        tied = bool(hf.get("tie_word_embeddings") or (hf.get("text_config") or {}).get("tie_word_embeddings"))
        return {**text, "model_type": "qwen2_5_vl", "rope_theta": theta, "rope_parameters": None,
                "rope_scaling": None, "head_dim": None, "postrain_vision": vision, "tie_word_embeddings": tied}

    @staticmethod
    def config_fields_from_hf(hf: dict) -> dict:
        """Qwen2's attention: bias on q/k/v, none on the output; no sliding window."""
        return {"qkv_bias": True, "o_bias": False, "sliding_window": None, "layer_types": None}

    @staticmethod
    def hf_config_from_text(text_hf: dict, config: ModelConfig) -> dict:
        """transformers' composite config.json around the decoder's fields (`text_config`)."""
        vision = config.vision or {}
        keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "hidden_act",
                "initializer_range", "bos_token_id", "eos_token_id")
        text = {key: text_hf[key] for key in keep}
        return {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
            "text_config": {**text, "model_type": "qwen2_5_vl_text", "use_sliding_window": False,
                            "tie_word_embeddings": config.tie_word_embeddings,
                            "rope_parameters": {"rope_type": "default", "mrope_section": vision["mrope_section"],
                                                "rope_theta": config.rope_theta}},
            "vision_config": {
                "model_type": "qwen2_5_vl_vision", "depth": vision["depth"], "hidden_size": vision["hidden_size"],
                "intermediate_size": vision["intermediate_size"], "num_heads": vision["num_heads"],
                "in_channels": 3, "patch_size": vision["patch_size"], "spatial_merge_size": vision["merge_size"],
                "temporal_patch_size": vision["temporal_patch_size"], "window_size": vision["window_size"],
                "out_hidden_size": vision["out_hidden_size"], "hidden_act": "silu",
                "fullatt_block_indexes": vision["fullatt_block_indexes"],
                "tokens_per_second": vision["tokens_per_second"],
                "rope_parameters": {"rope_type": "axial", "rope_theta": vision["rope_theta"]}},
            **{key: vision[key] for key in TOKEN_DEFAULTS},
            "tie_word_embeddings": config.tie_word_embeddings, "dtype": "float32",
            "postrain_vision": dict(vision),
        }

    @staticmethod
    def hf_folder_files(config: ModelConfig) -> dict[str, dict]:
        """preprocessor_config.json (the image processor's, as the released folders have it)."""
        vision = config.vision or {}
        keys = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "resample",
                "do_rescale", "rescale_factor", "do_normalize", "image_mean", "image_std")
        return {"preprocessor_config.json": {
            "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
            "do_resize": True, "do_convert_rgb": True,
            "size": {"shortest_edge": vision["min_pixels"], "longest_edge": vision["max_pixels"]},
            **{key: vision[key] for key in keys}}}

    @staticmethod
    def state_from_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """transformers' names -> ours (module docstring); other names pass (the loader names strays)."""
        return {_renamed(name, HF_TO_OURS): tensor for name, tensor in state.items()}

    @staticmethod
    def state_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_renamed(name, OURS_TO_HF): tensor for name, tensor in state.items()}


# name prefixes, transformers' -> ours (transformers 5 saves `visual.` and `model.`; 4.5x wrote these)
HF_TO_OURS = (("model.language_model.", "model."), ("model.visual.", "vision."), ("visual.", "vision."))
OURS_TO_HF = (("vision.", "visual."),)


def _renamed(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return name


MODEL_CLASS = Qwen2_5_VLModel
