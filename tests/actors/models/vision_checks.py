"""What the vision families' parity tests share (test_idefics3.py, test_qwen2_5_vl.py,
test_gemma3_vision.py): their folders loaded both ways, postrain's logits with the images spliced in,
and the export's check. The folders and images are bench/vision_folders.py's."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from postrain.actors.models.loading import load_model
from postrain.actors.models.images import load_image
from postrain.actors.models.vision import ImageRows
from postrain.bench.vision_folders import build_folder, noise, png


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


def assert_images_read_together_equal_each_alone(model, sizes: list[tuple[int, int]]) -> None:
    """The tower's encode_many (the engine reads the images of requests added together in one
    call) equals reading each image alone, on images of these (width, height)s."""
    tower = model.vision
    values = [tower.layout.pixel_values(load_image(png(noise(w, h, i)))) for i, (w, h) in enumerate(sizes)]
    with torch.no_grad():
        together = tower.encode_many(values)
        alone = [tower(v) for v in values]
    assert [len(r) for r in together] == [len(r) for r in alone]
    for mine, theirs in zip(together, alone):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
