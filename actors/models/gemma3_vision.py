"""Gemma 3's vision-language model (HF `model_type` "gemma3", transformers'
Gemma3ForConditionalGeneration): a SigLIP tower, the multimodal projector and the Gemma 3 decoder.

    model, tokenizer = load_model("/ckpt/gemma-3-4b-it")
    ids, images = render_prompt(tokenizer, model.vision.layout, messages)    # models/vision.py
    rows = model.vision.encode_images(images)                               # (N, hidden)
    ids = torch.tensor([ids])
    logits = model(ids, images=ImageRows(rows, ids == model.vision.image_token_id))

The parts, and their Hugging Face names (the released checkpoints' and transformers 5's both load):
- the decoder: `Gemma3Model` (gemma3.py) over config.json's `text_config` (`language_model.model.*` or
  `model.language_model.*` -> `model.*`; the LM head tied unless the top-level `tie_word_embeddings`
  says otherwise);
- the tower (`Gemma3Tower`, `model.vision`, kind "gemma3"; `vision_tower[.vision_model].*` ->
  `vision.*`, `multi_modal_projector.*` -> `vision.projector.*`): SigLIP's patch conv and learned
  position embeddings, pre-norm encoder layers (idefics3.py's), a post layernorm; then the projector:
  the patch grid average-pooled to `mm_tokens_per_image` rows, Gemma's RMSNorm (`mm_soft_emb_norm`)
  and a linear map (`mm_input_projection_weight`) to the text width. The rows replace the
  placeholders' embeddings as they are: NOT scaled by the embedding's sqrt(hidden_size), as in
  transformers (which splices them over the scaled embeddings);
- the layout (`Gemma3Layout`): Gemma3ImageProcessor's pixels (a PIL resize to image_size x
  image_size, rescale, normalise; pan-and-scan off) and the processor's text for one
  `<start_of_image>`: "\\n\\n<start_of_image>" + mm_tokens_per_image `<image_soft_token>` +
  "<end_of_image>\\n\\n", written into the prompt's TEXT before tokenizing (`expand_text`), so the
  newlines merge with their neighbours as in the processor's ids.

Attention: an image's `<image_soft_token>` run attends to itself both ways (transformers'
token_type_ids mask: a placeholder sees every placeholder of its own run, before and after it, and
everything before causally; a sliding layer keeps its window on the keys before). The tower says so
(`bidirectional`): the learner's mask adds the runs (llama.py, `ImageRows.runs_mask`), the engine
reads a run in one prefill chunk and its backends let the run's queries see the run's later keys
(generator/images.py, attention.py). `exact = true` does not cover it (refused).

Where the settings come from: config.json (text_config, vision_config, mm_tokens_per_image, the
boi / eoi / image token indices), the processor's files (preprocessor_config.json and
processor_config.json, transformers 5's nested layout too; Gemma3ImageProcessor's defaults where
absent) and the tokenizer's ids and names of the image tokens (tokenizer.json, tokenizer_config.json).
postrain's exports keep the table in config.json (`postrain_vision`) and write processor_config.json
and the tokenizer's image token names, so a saved folder loads in transformers and in postrain.

Refused, naming the field: a text_config that is not gemma3_text, a vision_config that is not
siglip_vision_model, vision_use_head true, a vision hidden_act other than gelu_pytorch_tanh / gelu,
do_pan_and_scan true, do_resize false, a processor size other than the tower's image_size, an
image_seq_length other than mm_tokens_per_image, an mm_tokens_per_image whose square grid does not
pool the patch grid evenly, a tokenizer whose image tokens are not config.json's ids.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .blocks import PagedAttention, ProjectionPath, SharedPrefixBatch
from .config import ModelConfig, ModelConfigError
from .gemma3 import Gemma3Model, GemmaRMSNorm
from .hf_config import CheckpointError
from .idefics3 import ACTIVATIONS, VisionEmbeddings, VisionEncoder
from .images import ImageInputError, ImageLayout
from .vision import (
    TOWER_KINDS, folder_processor_fields, ImageRows, processor_table, VisionTower, encode_tiles_together)

# transformers' Gemma3TextConfig defaults (the released config.json files omit most of them)
TEXT_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                 "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                 "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131_072,
                 "rms_norm_eps": 1e-6, "bos_token_id": 2, "eos_token_id": 1}
# SiglipVisionConfig's defaults
VISION_DEFAULTS = {"model_type": "siglip_vision_model", "hidden_size": 768, "intermediate_size": 3072,
                   "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": 224, "patch_size": 16,
                   "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "vision_use_head": True}
# Gemma3ImageProcessor's defaults (resample 2: BILINEAR)
PROCESSOR_DEFAULTS = {"size": {"height": 224, "width": 224}, "do_resize": True, "resample": 2, "do_rescale": True,
                      "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
                      "image_std": [0.5, 0.5, 0.5], "do_pan_and_scan": False}
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")   # read in this order
TOKEN_NAMES = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


# ----------------------------------------------------------------------------- the layout


class Gemma3Layout(ImageLayout):
    """Gemma3ImageProcessor's pixels and the Gemma3Processor's text for an image (module
    docstring); config-only (`config.vision`)."""

    def __init__(self, vision: dict):
        super().__init__(vision)
        self.size = int(vision["image_size"])                       # the square the image is resized to
        self.resample = int(vision["resample"])
        self.rescale_factor = float(vision["rescale_factor"]) if vision["do_rescale"] else None
        self.normalize = ((np.asarray(vision["image_mean"], dtype=np.float32),
                           np.asarray(vision["image_std"], dtype=np.float32)) if vision["do_normalize"] else None)
        self.num_tokens = int(vision["mm_tokens_per_image"])
        self.run_text = (f"\n\n{self.marker}{vision['image_token'] * self.num_tokens}{vision['eoi_token']}\n\n")
        patch, side = int(vision["patch_size"]), int(round(self.num_tokens ** 0.5))
        if self.size % patch or side * side != self.num_tokens or (self.size // patch) % side:
            raise ModelConfigError(f"mm_tokens_per_image {self.num_tokens} must be a square whose side divides the "
                                   f"tower's {self.size // patch} x {self.size // patch} patch grid (image_size "
                                   f"{self.size}, patch_size {patch}); fix mm_tokens_per_image")

    def image_token_run(self, image) -> list[int]:
        return [self.image_token_id] * self.num_tokens

    def expand_text(self, text: str) -> str:
        """Every `<start_of_image>` replaced by the image's whole run, as Gemma3Processor writes it."""
        return text.replace(self.marker, self.run_text)

    def expand(self, ids: list[int], marker_id: int, images: list) -> list[int]:
        """`ids` as they are (`expand_text` wrote the runs), once one marker per image is checked."""
        count = ids.count(marker_id)
        if count != len(images):
            raise ImageInputError(f"{len(images)} image(s) given but the prompt has {count} image marker(s); "
                                  "fix: one image content part per image")
        return list(ids)

    def pixel_values(self, image) -> torch.Tensor:
        """(1, 3, S, S) float32: a PIL resize to S x S, rescaled and normalised as transformers'
        PIL backend does it (float64 rescale cast to float32, then (x - mean) / std in float32)."""
        from PIL import Image

        x = np.asarray(image.resize((self.size, self.size), Image.Resampling(self.resample)))[None]
        if self.rescale_factor is not None:
            x = (x.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.normalize is not None:
            mean, std = self.normalize
            x = (x.astype(np.float32) - mean) / std
        return torch.from_numpy(x.astype(np.float32)).permute(0, 3, 1, 2).contiguous()


# ----------------------------------------------------------------------------- the tower


class Projector(nn.Module):
    """transformers' Gemma3MultiModalProjector's parameters (the pooling has none)."""

    def __init__(self, width: int, hidden_size: int, eps: float):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(width, hidden_size))
        self.mm_soft_emb_norm = GemmaRMSNorm(width, eps)


class Gemma3Tower(VisionTower):
    """SigLIP and the projector: `forward(pixel_values (n, 3, S, S))` -> rows (n *
    mm_tokens_per_image, text hidden), each image's pooled cells row-major (the order of its
    placeholders). Module names are transformers' (SiglipVisionModel's, the projector's)."""

    bidirectional = True

    def __init__(self, vision: dict, hidden_size: int):
        super().__init__()
        self.layout = layout = Gemma3Layout(vision)
        self.hidden_size = hidden_size
        width, patch, eps = int(vision["hidden_size"]), int(vision["patch_size"]), float(vision["layer_norm_eps"])
        self.side = layout.size // patch                                # patches per side
        self.pool = self.side // int(round(layout.num_tokens ** 0.5))   # patches per pooled cell's side
        self.embeddings = VisionEmbeddings(width, patch, self.side ** 2)
        self.encoder = VisionEncoder(vision)
        self.post_layernorm = nn.LayerNorm(width, eps=eps)
        self.projector = Projector(width, hidden_size, eps)

    def encode_many(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        return encode_tiles_together(self, pixel_values)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        conv = self.embeddings.patch_embedding
        x = conv(pixel_values.to(conv.weight.dtype))                          # (n, W, side, side)
        n, width = x.shape[:2]
        x = x.flatten(2).transpose(1, 2) + self.embeddings.position_embedding.weight
        for layer in self.encoder.layers:
            x = layer(x)
        x = self.post_layernorm(x)                                             # (n, side * side, W)
        x = x.transpose(1, 2).reshape(n, width, self.side, self.side)
        x = F.avg_pool2d(x, self.pool).flatten(2).transpose(1, 2)             # (n, tokens, W)
        x = self.projector.mm_soft_emb_norm(x) @ self.projector.mm_input_projection_weight
        return x.reshape(-1, self.hidden_size)


TOWER_KINDS["gemma3"] = (Gemma3Layout, Gemma3Tower)


# ----------------------------------------------------------------------------- config and state


def _token_names(tok_config: dict) -> dict[str, str]:
    """The image tokens' names from tokenizer_config.json (top level, or transformers 5's
    extra_special_tokens), Gemma's where absent."""
    extra = tok_config.get("extra_special_tokens")
    pools = [tok_config] + ([extra] if isinstance(extra, dict) else [])
    names = dict(TOKEN_NAMES)
    for key in TOKEN_NAMES:
        for pool in pools:
            value = pool.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                names[key] = value
    return names


def _processor_table(hf: dict, folder: Path) -> dict:
    """The layout's settings from the folder's processor files (transformers' defaults where
    absent; null values count as absent) and the image tokens from its tokenizer files."""
    from tokenizers import Tokenizer as HFTokenizer

    settings: dict[str, Any] = dict(PROCESSOR_DEFAULTS)
    seq_len = None
    for name in PROCESSOR_FILES:
        if (folder / name).is_file():
            data = json.loads((folder / name).read_text())
            settings.update({k: v for k, v in (data.get("image_processor") or data).items() if v is not None})
            seq_len = data.get("image_seq_length", seq_len)
    if settings["do_pan_and_scan"]:
        raise CheckpointError(f"{folder}: the image processor's do_pan_and_scan=true is not implemented (postrain "
                              "reads each image whole); set it to false or null, as the released models do")
    if not settings["do_resize"]:
        raise CheckpointError(f"{folder}: the image processor's do_resize=false is not supported (the tower takes "
                              "a fixed size); set it to true")
    size = settings["size"]
    if not isinstance(size, dict) or "height" not in size or "width" not in size:
        raise CheckpointError(f"{folder}: the image processor's size must be {{'height', 'width'}}, got {size!r}")
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(f"{folder} has no tokenizer.json; the ids of a gemma3 model's image tokens come "
                              "from it: copy the model's tokenizer files into the folder")
    tokenizer = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok_config = {}
    if (folder / "tokenizer_config.json").is_file():
        tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    names = _token_names(tok_config)
    return {
        "marker": names["boi_token"], "eoi_token": names["eoi_token"], "image_token": names["image_token"],
        "token_ids": {key: tokenizer.token_to_id(name) for key, name in names.items()},
        "size": [int(size["height"]), int(size["width"])], "image_seq_length": seq_len,
        "resample": int(settings["resample"]), "do_rescale": bool(settings["do_rescale"]),
        "rescale_factor": float(settings["rescale_factor"]), "do_normalize": bool(settings["do_normalize"]),
        "image_mean": [float(v) for v in settings["image_mean"]],
        "image_std": [float(v) for v in settings["image_std"]],
    }


def _vision_table(hf: dict) -> dict:
    """config.vision of a gemma3 config.json whose folder's files were read."""
    processor = processor_table(hf)
    vision_hf = {**VISION_DEFAULTS, **(hf.get("vision_config") or {})}
    if vision_hf["model_type"] != "siglip_vision_model":
        raise ModelConfigError(f"vision_config.model_type={vision_hf['model_type']!r} is not supported; the gemma3 "
                               "tower postrain implements is siglip_vision_model")
    if vision_hf["vision_use_head"]:
        raise ModelConfigError("vision_config.vision_use_head=true (a pooling head Gemma 3 never reads) is not "
                               "supported; set it to false, as the released models do")
    if vision_hf["hidden_act"] not in ACTIVATIONS:
        raise ModelConfigError(f"vision_config.hidden_act={vision_hf['hidden_act']!r} is not supported; "
                               f"supported: {', '.join(ACTIVATIONS)}")
    if not isinstance(vision_hf["image_size"], int) or not isinstance(vision_hf["patch_size"], int):
        raise ModelConfigError(f"vision_config.image_size {vision_hf['image_size']!r} and patch_size "
                               f"{vision_hf['patch_size']!r} must be single ints (square images and patches)")
    tokens = int(hf.get("mm_tokens_per_image", 256))
    ids = {"image_token": hf.get("image_token_index", hf.get("image_token_id", 262_144)),
           "boi_token": hf.get("boi_token_index", hf.get("boi_token_id", 255_999)),
           "eoi_token": hf.get("eoi_token_index", hf.get("eoi_token_id", 256_000))}
    for key, expected in ids.items():
        name, found = processor["marker"] if key == "boi_token" else processor[key], processor["token_ids"][key]
        if found != expected:
            raise ModelConfigError(f"the tokenizer's {name} is id {found} but config.json's {key}_index is "
                                   f"{expected}; fix: use the model's own tokenizer")
    if processor["image_seq_length"] not in (None, tokens):
        raise ModelConfigError(f"the processor's image_seq_length {processor['image_seq_length']} but config.json's "
                               f"mm_tokens_per_image {tokens}; fix: image_seq_length = {tokens}")
    image_size = vision_hf["image_size"]
    if processor["size"] != [image_size, image_size]:
        raise ModelConfigError(f"the image processor's size {processor['size']} (height, width) but the tower's "
                               f"image_size is {image_size}; fix: size = {{'height': {image_size}, 'width': "
                               f"{image_size}}}")
    table = {k: v for k, v in processor.items() if k not in ("token_ids", "size", "image_seq_length")}
    return {
        "kind": "gemma3", "image_token_id": int(ids["image_token"]),
        "boi_token_id": int(ids["boi_token"]), "eoi_token_id": int(ids["eoi_token"]),
        "hidden_size": int(vision_hf["hidden_size"]), "intermediate_size": int(vision_hf["intermediate_size"]),
        "num_layers": int(vision_hf["num_hidden_layers"]), "num_heads": int(vision_hf["num_attention_heads"]),
        "image_size": image_size, "patch_size": int(vision_hf["patch_size"]),
        "hidden_act": vision_hf["hidden_act"], "layer_norm_eps": float(vision_hf["layer_norm_eps"]),
        "mm_tokens_per_image": tokens, **table,
    }


class Gemma3VisionModel(Gemma3Model):
    """Gemma 3 with images: the Gemma 3 decoder with `vision` a Gemma3Tower."""

    def __init__(self, config: ModelConfig):
        if not config.vision or config.vision.get("kind") != "gemma3":
            raise ModelConfigError("a gemma3 model needs config.vision of kind 'gemma3' (load it from its Hugging "
                                   "Face folder); a text-only Gemma 3 is model_type gemma3_text")
        super().__init__(config)
        self.image_token_id = int(config.vision["image_token_id"])

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.image_token_id >= self.config.vocab_size:      # transformers embeds such a placeholder as id 0
            input_ids = input_ids.masked_fill(input_ids == self.image_token_id, 0)   # (its row is replaced)
        return super().embed(input_ids)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      paged: PagedAttention | None = None, weights: ProjectionPath | None = None,
                      images: ImageRows | None = None) -> torch.Tensor:
        if images is not None and paged is None and self.exact:
            raise ModelConfigError("exact = true does not cover Gemma 3's images (their runs attend both ways); "
                                   "set exact = false for a gemma3 vision-language policy")
        return super().hidden_states(input_ids, attention_mask, paged, weights, images)

    def shared_prefix_hidden_states(self, batch: SharedPrefixBatch) -> torch.Tensor:
        if batch.images is not None:
            raise ModelConfigError("Gemma 3's images attend both ways, which the shared-prefix path does not "
                                   "mask; image batches take the plain padded path")
        return super().shared_prefix_hidden_states(batch)

    @staticmethod
    def folder_config_fields(hf: dict, folder: Path) -> dict:
        """What the folder's other files add to config.json: the processor's settings and the
        image tokens (none where config.json keeps postrain's own table)."""
        return folder_processor_fields(hf, folder, _processor_table)

    @staticmethod
    def text_config_from_hf(hf: dict) -> dict:
        """The decoder's config.json fields (text_config, a gemma3_text), with the vision table."""
        text = {**TEXT_DEFAULTS, **(hf.get("text_config") or {})}
        if text.get("model_type", "gemma3_text") != "gemma3_text":
            raise ModelConfigError(f"text_config.model_type={text['model_type']!r} is not supported; the gemma3 "
                                   "decoder postrain implements is gemma3_text")
        for key in ("bos_token_id", "eos_token_id"):
            if hf.get(key) is not None:
                text[key] = hf[key]
        vision = hf.get("postrain_vision") or _vision_table(hf)
        Gemma3Layout(vision)                                      # its checks, at load
        return {**text, "model_type": "gemma3", "postrain_vision": vision,
                "tie_word_embeddings": bool(hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True)))}

    @staticmethod
    def hf_config_from_text(text_hf: dict, config: ModelConfig) -> dict:
        """transformers' composite config.json around the decoder's fields (`text_config`)."""
        vision = config.vision or {}
        text = {k: v for k, v in text_hf.items() if k not in ("architectures", "postrain_vision")}
        return {
            "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": {**text, "model_type": "gemma3_text"},
            "vision_config": {
                "model_type": "siglip_vision_model", "hidden_size": vision["hidden_size"],
                "intermediate_size": vision["intermediate_size"], "num_hidden_layers": vision["num_layers"],
                "num_attention_heads": vision["num_heads"], "image_size": vision["image_size"],
                "patch_size": vision["patch_size"], "hidden_act": vision["hidden_act"],
                "layer_norm_eps": vision["layer_norm_eps"], "vision_use_head": False},
            "mm_tokens_per_image": vision["mm_tokens_per_image"], "image_token_index": vision["image_token_id"],
            "boi_token_index": vision["boi_token_id"], "eoi_token_index": vision["eoi_token_id"],
            "tie_word_embeddings": config.tie_word_embeddings, "dtype": "float32",
            "postrain_vision": dict(vision),
        }

    @staticmethod
    def hf_folder_files(config: ModelConfig) -> dict[str, dict]:
        """processor_config.json (transformers 5's layout) and the image tokens' names for
        tokenizer_config.json, so the folder loads in AutoProcessor."""
        vision = config.vision or {}
        size = vision["image_size"]
        image_processor = {
            "image_processor_type": "Gemma3ImageProcessor", "do_convert_rgb": True, "do_resize": True,
            "size": {"height": size, "width": size}, "do_pan_and_scan": False,
            **{key: vision[key] for key in ("resample", "do_rescale", "rescale_factor", "do_normalize",
                                            "image_mean", "image_std")}}
        return {"processor_config.json": {"processor_class": "Gemma3Processor", "image_processor": image_processor,
                                          "image_seq_length": vision["mm_tokens_per_image"]},
                "tokenizer_config.json": {"boi_token": vision["marker"], "eoi_token": vision["eoi_token"],
                                          "image_token": vision["image_token"], "processor_class": "Gemma3Processor"}}

    @staticmethod
    def state_from_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
        """transformers' names (the released layout or transformers 5's) -> ours; other names pass
        (the loader names strays)."""
        return {_renamed(name, HF_TO_OURS): tensor for name, tensor in state.items()}

    @staticmethod
    def state_to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Ours -> the released checkpoints' names (transformers 4.5x and 5 load them)."""
        return {_renamed(name, OURS_TO_HF): tensor for name, tensor in state.items()}


# name prefixes, transformers' -> ours, first match wins (the released layout, then transformers 5's)
HF_TO_OURS = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
              ("model.language_model.", "model."), ("vision_tower.vision_model.", "vision."),
              ("model.vision_tower.vision_model.", "vision."), ("model.vision_tower.", "vision."),
              ("vision_tower.", "vision."), ("multi_modal_projector.", "vision.projector."),
              ("model.multi_modal_projector.", "vision.projector."))
OURS_TO_HF = (("vision.projector.", "multi_modal_projector."), ("vision.", "vision_tower.vision_model."),
              ("model.", "language_model.model."), ("lm_head.", "language_model.lm_head."))


def _renamed(name: str, prefixes: tuple[tuple[str, str], ...]) -> str:
    for old, new in prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return name


MODEL_CLASS = Gemma3VisionModel
