"""Idefics3 and SmolVLM (HF `model_type` "idefics3", "smolvlm"): a SigLIP-style vision tower, a
pixel-shuffle connector and a Llama decoder (transformers' Idefics3ForConditionalGeneration and
SmolVLMForConditionalGeneration, which compute the same thing).

    model, tokenizer = load_model("/ckpt/SmolVLM-256M-Instruct")
    ids, images = render_prompt(tokenizer, model.vision.layout, messages)    # models/vision.py
    rows = model.vision.encode_images(images)                               # (N, hidden)
    ids = torch.tensor([ids])
    logits = model(ids, images=ImageRows(rows, ids == model.vision.image_token_id))

The parts, and their Hugging Face names:
- the decoder: `LlamaModel` over config.json's `text_config` (`model.text_model.*` -> `model.*`,
  `lm_head.weight` as is; tied where the top-level `tie_word_embeddings` says so, as transformers ties);
- the tower (`Idefics3Tower`, `model.vision`, kind "idefics3"; `model.vision_model.*` -> `vision.*`,
  `model.connector.*` -> `vision.connector.*`): per square tile, a patch conv, learned position
  embeddings indexed by transformers' bucketed position ids, pre-norm encoder layers (GELU MLP), a
  post layernorm, then the connector: pixel shuffle (each scale_factor x scale_factor block of
  patches joined into one row) and the modality projection to the text width: image_seq_len rows
  per tile;
- the layout (`Idefics3Layout`): Idefics3ImageProcessor's pixels, PIL resampling as transformers'
  PIL backend does it (longest edge to `longest_edge`, then to multiples of `max_image_size`, cut
  into tiles row-major plus the whole image as the global tile, rescale, normalise), and the
  processor's text for one `<image>`: per tile `<fake_token_around_image><row_r_col_c>` and
  image_seq_len `<image>` tokens, "\\n" after each row of tiles, then "\\n" and the global tile
  `<fake_token_around_image><global-img>` + image tokens + `<fake_token_around_image>` (an image
  that fits one tile: only the global part).

Where the settings come from: config.json (text_config, vision_config, scale_factor, image_token_id),
the processor's files (processor_config.json, transformers 5's layout with the image processor
nested, or preprocessor_config.json + processor_config.json in older folders; transformers'
defaults where absent) and the tokenizer's ids of the image tokens and of "\\n" / "\\n\\n"
(tokenizer.json): `folder_config_fields` reads them at load into `config.vision`. postrain's exports
keep that table in config.json (`postrain_vision`, which then wins) and write processor_config.json,
so a saved folder loads in transformers (model and processor) and in postrain.

Refused, naming the field: a text_config that is not a Llama, a vision hidden_act other than
gelu_pytorch_tanh / gelu, do_resize false, tiles that are not whole patches or whose patch grid
scale_factor does not divide, an image_seq_len other than the tower's rows per tile, a tokenizer
whose `<image>` is not config.json's image_token_id.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, ModelConfigError
from .llama import LlamaModel
from .images import ImageLayout
from .vision import TOWER_KINDS, VisionTower, encode_tiles_together, folder_processor_fields, processor_table

MAX_IMAGE_SIZE = 4096   # transformers' cap on the resized image's longest edge
# transformers' Idefics3VisionConfig / SmolVLMVisionConfig defaults (older config.json files omit defaults)
VISION_DEFAULTS = {"hidden_size": 1152, "intermediate_size": 3072, "num_hidden_layers": 12,
                   "num_attention_heads": 16, "image_size": 224, "patch_size": 32,
                   "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}
# Idefics3ImageProcessor's defaults (resample 1: LANCZOS)
PROCESSOR_DEFAULTS = {"size": {"longest_edge": 4 * 364}, "max_image_size": {"longest_edge": 364},
                      "do_resize": True, "do_image_splitting": True, "resample": 1, "do_rescale": True,
                      "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
                      "image_std": [0.5, 0.5, 0.5]}
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")   # read in this order
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}               # hidden_act -> F.gelu approximate
HF_CLASSES = {"idefics3": "Idefics3", "smolvlm": "SmolVLM"}               # model_type -> transformers' prefix


# ----------------------------------------------------------------------------- the layout


def _longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """transformers' first resize: the longest edge to `longest` (the other even), then under 4096."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """transformers' resize_for_vision_encoder: both edges up to multiples of `tile`."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


class Idefics3Layout(ImageLayout):
    """Idefics3ImageProcessor's tiles and the Idefics3/SmolVLM processor's token run of an image
    (module docstring); config-only (`config.vision`)."""

    def __init__(self, vision: dict):
        super().__init__(vision)
        self.longest_edge = int(vision["longest_edge"])
        self.tile = int(vision["max_image_size"])                 # a tile's side in pixels
        self.split = bool(vision["do_image_splitting"])
        self.resample = int(vision["resample"])
        self.rescale_factor = float(vision["rescale_factor"]) if vision["do_rescale"] else None
        self.normalize = ((np.asarray(vision["image_mean"], dtype=np.float32),
                           np.asarray(vision["image_std"], dtype=np.float32)) if vision["do_normalize"] else None)
        self.image_seq_len = int(vision["image_seq_len"])
        self.fake, self.global_img = list(vision["fake_image_ids"]), list(vision["global_image_ids"])
        self.row_col = vision["row_col_ids"]                      # [r][c]: the ids of <row_{r+1}_col_{c+1}>
        self.row_end, self.tiles_end = list(vision["row_end_ids"]), list(vision["tiles_end_ids"])
        patch, scale = int(vision["patch_size"]), int(vision["scale_factor"])
        if self.tile % patch or (self.tile // patch) % scale:
            raise ModelConfigError(f"max_image_size {self.tile} must be whole patches (patch_size {patch}) in "
                                   f"a grid scale_factor {scale} divides; fix max_image_size")
        rows_per_tile = (self.tile // patch) ** 2 // scale ** 2
        if self.image_seq_len != rows_per_tile:
            raise ModelConfigError(f"image_seq_len {self.image_seq_len} but a {self.tile}-pixel tile makes "
                                   f"{rows_per_tile} image rows (patch_size {patch}, scale_factor {scale}); "
                                   f"fix: image_seq_len = {rows_per_tile} in processor_config.json")

    def sizes(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
        """(height, width) after the longest-edge resize, and after the resize to whole tiles (None
        without splitting)."""
        first = _longest_edge_size(height, width, self.longest_edge)
        return first, (_tile_multiple_size(*first, self.tile) if self.split else None)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of tiles an image of this size is cut into; (0, 0): the global tile only."""
        return self._grid(self.sizes(height, width)[1])

    def _grid(self, resized: tuple[int, int] | None) -> tuple[int, int]:
        if resized is None or (resized[0] <= self.tile and resized[1] <= self.tile):
            return 0, 0
        return resized[0] // self.tile, resized[1] // self.tile

    def tiles(self, image) -> list:
        """The image's tiles (RGB PIL images, tile x tile), row-major, then the global one."""
        from PIL import Image

        resample, side = Image.Resampling(self.resample), self.tile
        first, second = self.sizes(image.height, image.width)
        image = image.resize(first[::-1], resample)
        if second is None:
            return [image.resize((side, side), resample)]
        image = image.resize(second[::-1], resample)
        rows, cols = self._grid(second)
        if rows == 0:
            return [image]
        crops = [image.crop((c * side, r * side, (c + 1) * side, (r + 1) * side))
                 for r in range(rows) for c in range(cols)]
        return crops + [image.resize((side, side), resample)]

    def pixel_values(self, image) -> torch.Tensor:
        """(num_tiles, 3, tile, tile) float32: the tiles rescaled and normalised as transformers does
        (float64 rescale cast to float32, then (x - mean) / std in float32)."""
        x = np.stack([np.asarray(tile) for tile in self.tiles(image)])          # (n, S, S, 3) uint8
        if self.rescale_factor is not None:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.normalize is not None:
            mean, std = self.normalize
            x = (x.astype(np.float32) - mean) / std
        return torch.from_numpy(x.astype(np.float32)).permute(0, 3, 1, 2).contiguous()

    def image_token_run(self, image) -> list[int]:
        rows, cols = self.grid(image.height, image.width)
        tile = [self.image_token_id] * self.image_seq_len
        whole = self.fake + self.global_img + tile + self.fake
        if rows == 0:
            return whole
        out: list[int] = []
        for r in range(rows):
            for c in range(cols):
                out += self.fake + list(self.row_col[r][c]) + tile
            out += self.row_end if r < rows - 1 else []
        return out + self.tiles_end + whole      # the last row's "\n" and the global tile's "\n"


# ----------------------------------------------------------------------------- the tower


class VisionAttention(nn.Module):
    """Bidirectional multi-head attention over one tile's patches (biases on q, k, v and out)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(width, width) for _ in range(3))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:                        # (n, P, W)
        n, num, width = x.shape
        q, k, v = (proj(x).view(n, num, self.heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)                          # (n, heads, P, d)
        return self.out_proj(out.transpose(1, 2).reshape(n, num, width))


class VisionMLP(nn.Module):
    def __init__(self, width: int, inner: int, approximate: str):
        super().__init__()
        self.approximate = approximate
        self.fc1, self.fc2 = nn.Linear(width, inner), nn.Linear(inner, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class VisionLayer(nn.Module):
    """A pre-norm SigLIP encoder layer (transformers' Idefics3EncoderLayer)."""

    def __init__(self, vision: dict):
        super().__init__()
        width, eps = int(vision["hidden_size"]), float(vision["layer_norm_eps"])
        self.layer_norm1 = nn.LayerNorm(width, eps=eps)
        self.self_attn = VisionAttention(width, int(vision["num_heads"]))
        self.layer_norm2 = nn.LayerNorm(width, eps=eps)
        self.mlp = VisionMLP(width, int(vision["intermediate_size"]), ACTIVATIONS[vision["hidden_act"]])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEmbeddings(nn.Module):
    def __init__(self, width: int, patch: int, positions: int):
        super().__init__()
        self.patch_embedding = nn.Conv2d(3, width, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding(positions, width)


class VisionEncoder(nn.Module):
    def __init__(self, vision: dict):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(vision) for _ in range(int(vision["num_layers"])))


class ModalityProjection(nn.Module):
    def __init__(self, width: int, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(width, hidden_size, bias=False)


class Connector(nn.Module):
    def __init__(self, width: int, hidden_size: int):
        super().__init__()
        self.modality_projection = ModalityProjection(width, hidden_size)


class Idefics3Tower(VisionTower):
    """The vision transformer and the connector: `forward(pixel_values (n, 3, S, S))` -> rows
    (n * image_seq_len, text hidden), tile by tile, each tile's rows in pixel-shuffle order (the
    order of its `<image>` placeholders). Module names are transformers' (the containers above
    stand for its classes), so the state maps by prefix only."""

    def __init__(self, vision: dict, hidden_size: int):
        super().__init__()
        self.layout = Idefics3Layout(vision)
        self.hidden_size = hidden_size
        width, patch = int(vision["hidden_size"]), int(vision["patch_size"])
        self.scale = int(vision["scale_factor"])
        self.side = int(vision["image_size"]) // patch          # position embeddings per side
        self.embeddings = VisionEmbeddings(width, patch, self.side ** 2)
        self.encoder = VisionEncoder(vision)
        self.post_layernorm = nn.LayerNorm(width, eps=float(vision["layer_norm_eps"]))
        self.connector = Connector(width * self.scale ** 2, hidden_size)

    def position_ids(self, grid_h: int, grid_w: int, device) -> torch.Tensor:
        """(grid_h * grid_w,) position ids as transformers' Idefics3VisionEmbeddings buckets them
        (the same float32 steps, so a tile of any patch grid maps onto the side x side table)."""
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side, device=device)

        def buckets(count: int) -> torch.Tensor:
            step = 1.0 / torch.tensor([count], device=device)                  # float32, as theirs
            coords = torch.arange(count, dtype=torch.float32, device=device)[None, :] * step[:, None]
            return torch.bucketize(coords.clamp(max=1.0 - 1e-6), boundaries, right=True)[0]

        return (buckets(grid_h)[:, None] * self.side + buckets(grid_w)[None, :]).reshape(-1)

    def encode_many(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        return encode_tiles_together(self, pixel_values)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        conv = self.embeddings.patch_embedding
        x = conv(pixel_values.to(conv.weight.dtype))                          # (n, W, gh, gw)
        n, width, grid_h, grid_w = x.shape
        x = x.flatten(2).transpose(1, 2) + self.embeddings.position_embedding(
            self.position_ids(grid_h, grid_w, x.device))
        for layer in self.encoder.layers:
            x = layer(x)
        x = self.post_layernorm(x)                                             # (n, gh*gw, W)
        s = self.scale                      # pixel shuffle, as transformers' Idefics3Connector does it
        x = x.reshape(n, grid_h, grid_w // s, width * s).permute(0, 2, 1, 3)
        x = x.reshape(n, grid_w // s, grid_h // s, width * s * s).permute(0, 2, 1, 3)
        x = x.reshape(n, grid_h * grid_w // s ** 2, width * s * s)
        return self.connector.modality_projection.proj(x).reshape(-1, self.hidden_size)


TOWER_KINDS["idefics3"] = (Idefics3Layout, Idefics3Tower)


# ----------------------------------------------------------------------------- config and state


def _processor_table(hf: dict, folder: Path) -> dict:
    """The layout's settings from the folder's processor files (transformers' defaults where
    absent) and the ids of the image tokens from its tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer

    from .hf_config import CheckpointError

    settings: dict[str, Any] = dict(PROCESSOR_DEFAULTS)
    for name in PROCESSOR_FILES:
        if (folder / name).is_file():
            data = json.loads((folder / name).read_text())
            settings.update(data.get("image_processor") or data)   # nested in transformers 5's layout
            if "image_seq_len" in data:                              # the processor's own setting
                settings["image_seq_len"] = data["image_seq_len"]
    if not settings.get("do_resize", True):
        raise CheckpointError(f"{folder}: the image processor's do_resize=false is not supported (the tiles "
                              "would depend on the raw size); set it to true, as the released models do")
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"{folder} has no tokenizer.json; the ids of an {hf['model_type']} model's "
                              "image tokens come from it: copy the model's tokenizer files into the folder")
    tokenizer = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok_config = {}
    if (folder / "tokenizer_config.json").is_file():
        tok_config = json.loads((folder / "tokenizer_config.json").read_text())

    def name_of(key: str, default: str) -> str:   # SmolVLM's processor reads these tokenizer attributes
        return tok_config[key] if isinstance(tok_config.get(key), str) else default

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    try:
        longest, tile = int(settings["size"]["longest_edge"]), int(settings["max_image_size"]["longest_edge"])
    except (KeyError, TypeError):
        raise CheckpointError(f"{folder}: the image processor's size and max_image_size need a longest_edge, got "
                              f"{settings['size']!r} and {settings['max_image_size']!r}") from None
    most = math.ceil(min(longest, MAX_IMAGE_SIZE) / tile)          # the most rows (or cols) of tiles
    marker = name_of("image_token", "<image>")
    return {
        "marker": marker, "marker_id": tokenizer.token_to_id(marker),
        "longest_edge": longest, "max_image_size": tile,
        "do_image_splitting": bool(settings["do_image_splitting"]), "resample": int(settings["resample"]),
        "do_rescale": bool(settings["do_rescale"]), "rescale_factor": float(settings["rescale_factor"]),
        "do_normalize": bool(settings["do_normalize"]),
        "image_mean": [float(v) for v in settings["image_mean"]],
        "image_std": [float(v) for v in settings["image_std"]],
        "image_seq_len": settings.get("image_seq_len"),
        "fake_image_ids": ids(name_of("fake_image_token", "<fake_token_around_image>")),
        "global_image_ids": ids(name_of("global_image_token", "<global-img>")),
        "row_col_ids": [[ids(f"<row_{r}_col_{c}>") for c in range(1, most + 1)] for r in range(1, most + 1)],
        "row_end_ids": ids("\n"), "tiles_end_ids": ids("\n\n"),
    }


def _vision_table(hf: dict) -> dict:
    """config.vision of an Idefics3/SmolVLM config.json whose folder's files were read."""
    processor = processor_table(hf)
    vision_hf = {**VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    if vision_hf["hidden_act"] not in ACTIVATIONS:
        raise ModelConfigError(f"vision_config.hidden_act={vision_hf['hidden_act']!r} is not supported; "
                               f"supported: {', '.join(ACTIVATIONS)}")
    image_token_id = int(hf.get("image_token_id", 128257))
    if processor["marker_id"] != image_token_id:
        raise ModelConfigError(f"the tokenizer's {processor['marker']} is id {processor['marker_id']} but "
                               f"config.json's image_token_id is {image_token_id}; fix: use the model's own "
                               "tokenizer")
    patch, scale = int(vision_hf["patch_size"]), int(hf.get("scale_factor", 2))
    seq_len = processor["image_seq_len"]
    if seq_len is None:                              # transformers' formula (Idefics3Model.image_seq_len)
        seq_len = (int(vision_hf["image_size"]) // patch) ** 2 // scale ** 2
    return {
        "kind": "idefics3", "image_token_id": image_token_id,
        "hidden_size": int(vision_hf["hidden_size"]),
        "intermediate_size": int(vision_hf["intermediate_size"]),
        "num_layers": int(vision_hf["num_hidden_layers"]), "num_heads": int(vision_hf["num_attention_heads"]),
        "image_size": int(vision_hf["image_size"]), "patch_size": patch, "scale_factor": scale,
        "hidden_act": vision_hf["hidden_act"], "layer_norm_eps": float(vision_hf["layer_norm_eps"]),
        **{k: v for k, v in processor.items() if k != "marker_id"}, "image_seq_len": int(seq_len),
    }


class Idefics3Model(LlamaModel):
    """An Idefics3 / SmolVLM model: the Llama decoder with `vision` an Idefics3Tower."""

    def __init__(self, config: ModelConfig):
        if not config.vision or config.vision.get("kind") != "idefics3":
            raise ModelConfigError(f"a {config.architecture} model needs config.vision of kind 'idefics3' "
                                   "(load it from its Hugging Face folder)")
        super().__init__(config)

    @staticmethod
    def folder_config_fields(hf: dict, folder: Path) -> dict:
        """What the folder's other files add to config.json: the processor's settings and the
        image tokens' ids (none where config.json keeps postrain's own table)."""
        return folder_processor_fields(hf, folder, _processor_table)

    @staticmethod
    def text_config_from_hf(hf: dict) -> dict:
        """The decoder's config.json fields (text_config, a Llama), with the vision table."""
        text = {"rms_norm_eps": 1e-5, **hf["text_config"]}     # transformers' default for this family
        if text.get("model_type", "llama") != "llama":
            raise ModelConfigError(f"text_config.model_type={text['model_type']!r} is not supported; "
                                   f"the {hf['model_type']} decoder postrain implements is a Llama")
        vision = hf.get("postrain_vision") or _vision_table(hf)
        Idefics3Layout(vision)                                    # its checks, at load
        return {**text, "model_type": hf["model_type"], "postrain_vision": vision,
                "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False))}

    @staticmethod
    def hf_config_from_text(text_hf: dict, config: ModelConfig) -> dict:
        """transformers' composite config.json around the decoder's fields (`text_config`)."""
        vision, prefix = config.vision or {}, HF_CLASSES[config.architecture]
        text = {k: v for k, v in text_hf.items() if k not in ("architectures", "postrain_vision")}
        return {
            "architectures": [f"{prefix}ForConditionalGeneration"], "model_type": config.architecture,
            "text_config": {**text, "model_type": "llama"},
            "vision_config": {
                "model_type": f"{config.architecture}_vision", "hidden_size": vision["hidden_size"],
                "intermediate_size": vision["intermediate_size"], "num_hidden_layers": vision["num_layers"],
                "num_attention_heads": vision["num_heads"], "image_size": vision["image_size"],
                "patch_size": vision["patch_size"], "hidden_act": vision["hidden_act"],
                "layer_norm_eps": vision["layer_norm_eps"]},
            "image_token_id": vision["image_token_id"], "scale_factor": vision["scale_factor"],
            "tie_word_embeddings": config.tie_word_embeddings, "dtype": "float32",
            "postrain_vision": dict(vision),
        }

    @staticmethod
    def hf_folder_files(config: ModelConfig) -> dict[str, dict]:
        """processor_config.json (transformers 5's layout), so the folder loads in AutoProcessor."""
        vision, prefix = config.vision or {}, HF_CLASSES[config.architecture]
        image_processor = {
            "image_processor_type": f"{prefix}ImageProcessor", "do_convert_rgb": True, "do_pad": True,
            "do_resize": True, "size": {"longest_edge": vision["longest_edge"]},
            "max_image_size": {"longest_edge": vision["max_image_size"]},
            **{key: vision[key] for key in ("do_image_splitting", "resample", "do_rescale", "rescale_factor",
                                            "do_normalize", "image_mean", "image_std")}}
        return {"processor_config.json": {"processor_class": f"{prefix}Processor",
                                          "image_processor": image_processor,
                                          "image_seq_len": vision["image_seq_len"]}}

    @staticmethod
    def state_from_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """transformers' names -> ours (module docstring); other names pass (the loader names strays)."""
        return {_renamed(name, HF_TO_OURS): tensor for name, tensor in state.items()}

    @staticmethod
    def state_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_renamed(name, OURS_TO_HF): tensor for name, tensor in state.items()}


# name prefixes, transformers' -> ours (the connector's before the tower's: "vision." holds both)
HF_TO_OURS = (("model.text_model.", "model."), ("model.connector.", "vision.connector."),
              ("model.vision_model.", "vision."))
OURS_TO_HF = tuple((ours, theirs) for theirs, ours in HF_TO_OURS)


def _renamed(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return name


MODEL_CLASS = Idefics3Model
