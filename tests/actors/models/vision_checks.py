"""What the vision families' parity tests share (test_idefics3.py, test_qwen2_5_vl.py,
test_gemma3_vision.py): their folders loaded both ways, postrain's logits with the images spliced in,
and the export's check. The folders and images are bench/vision_folders.py's."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from postrain.actors.models.loading import load_model
from postrain.actors.models.vision import ImageRows
from postrain.bench.vision_folders import build_folder


def built_and_loaded(folder: Path, model_type: str) -> tuple:
    """A tiny random `model_type` folder: (transformers' model, its processor, postrain's model,
    tokenizer, the folder)."""
    folder, hf, processor = build_folder(folder, model_type)
    model, tokenizer = load_model(folder)
    return hf, processor, model, tokenizer, folder


def our_logits(model, ids: torch.Tensor, images: list) -> torch.Tensor:
    """postrain's logits of `ids`, the images' rows over its image tokens (positions as text's)."""
    rows = model.vision.encode_images(images)
    return model(ids, images=ImageRows(rows, ids == model.vision.image_token_id))


def assert_export_logits(folder, model, hf, theirs, inputs: dict, our_logits: Callable) -> None:
    """save_checkpoint's `folder` (of `model`) loads back in postrain with the same vision settings,
    and transformers' load of it (`theirs`) and ours (`our_logits(reloaded)`) give `hf`'s logits."""
    reloaded, _ = load_model(folder)
    assert reloaded.config.vision == model.config.vision
    with torch.no_grad():
        expected = hf(**inputs).logits
        torch.testing.assert_close(theirs(**inputs).logits, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(our_logits(reloaded), expected, atol=1e-4, rtol=1e-4)
