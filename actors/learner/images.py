"""The learner's images: a micro-batch's image feature rows, from the policy's own tower.

    images = batch_image_rows(model, mb, train_vision=False)   # ImageRows, or None for a text batch
    hidden = model.hidden_states(mb.input_ids, mask, images=images)

A sample's images (`PackedBatch.images`, its image files in order) fill its first image
placeholders, as many as their rows (a placeholder id the policy sampled later is a token, as in
the engine: models/vision.py `ImageRows`). Each distinct file is encoded once per
micro-batch (a group of samples on one image shares it). The tower is frozen unless
`learner.train_vision`: its rows are computed without a gradient, so the optimizer never moves it.
In a shared-prefix micro-batch (`shared_image_rows`) the rows land where the plan's `hidden_rows`
maps their positions: a prefix that a group's samples share shows their image once (the planner
groups only samples with the same images: shared_prefix.py).
A model whose rotary reads three positions per token (Qwen2.5-VL) gets them beside the rows
(`ImageRows.rope_positions`, from its layout: the generator's numbers for the same sample).
"""
from __future__ import annotations

import hashlib

import torch

from ..models.llama import LlamaModel
from ..models.images import load_image
from ..models.vision import ImageRows, batch_rope_positions
from .batch import LearnerError
from .packed import PackedBatch


def batch_image_rows(model: LlamaModel, mb: PackedBatch, train_vision: bool) -> ImageRows | None:
    """The micro-batch's ImageRows (module docstring); None when it shows no image. LearnerError
    when a sample's images do not fill every placeholder before its first trained token (an image
    lost on the way) or need more placeholders than it holds."""
    tower = model.vision
    if tower is None:
        if mb.images and any(mb.images):
            raise LearnerError("the batch carries images but the policy reads text only; train a "
                               "vision-language model, or send text samples")
        return None
    placeholders = (mb.input_ids == tower.image_token_id) & mb.attention_mask.bool()      # (B, T)
    trained = torch.nn.functional.pad(mb.loss_mask, (1, 0), value=False)                 # (B, T)
    before_trained = trained.int().cumsum(-1) == 0
    in_prompt = (placeholders & before_trained).sum(-1).tolist()
    mask = torch.zeros_like(placeholders)
    samples = mb.images or [[]] * mb.num_samples
    keys = [[hashlib.sha256(data).digest() for data in files] for files in samples]
    decoded: dict[bytes, object] = {}
    for files, file_keys in zip(samples, keys):
        for data, key in zip(files, file_keys):
            if key not in decoded:
                decoded[key] = load_image(data)
    shown: list[list] = []          # per sample its decoded images (a multimodal rotary reads their sizes)
    rows = []
    with torch.set_grad_enabled(train_vision and torch.is_grad_enabled()):
        encoded = dict(zip(decoded, tower.encode_many([tower.layout.pixel_values(image).to(mb.input_ids.device)
                                                       for image in decoded.values()])))   # one pass, each image once
        for b, files in enumerate(samples):
            count = 0
            shown.append([])
            for key in keys[b]:
                rows.append(encoded[key])
                shown[-1].append(decoded[key])
                count += len(encoded[key])
            positions = placeholders[b].nonzero()[:, 0]
            if count < in_prompt[b]:
                raise LearnerError(f"sample {b} of the micro-batch: its prompt holds {in_prompt[b]} image placeholders "
                                   f"but its {len(files)} image(s) fill {count}; send each sample's image files "
                                   "(TrainBatch.images) with it")
            if len(positions) < count:
                raise LearnerError(f"sample {b} of the micro-batch: its {len(files)} image(s) make {count} feature "
                                   f"rows but it holds {len(positions)} image placeholders; send each sample's "
                                   "image files in order, one per image run of its prompt")
            mask[b, positions[:count]] = True
    if not rows:
        return None
    return ImageRows(torch.cat(rows), mask, batch_rope_positions(tower.layout, mb.input_ids, shown, mb.attention_mask))


def shares_prefixes_with_images(model: LlamaModel) -> bool:
    """Whether image batches may take the shared-prefix path: a tower whose images are plain
    rows (not attended both ways, no multimodal rotary), or no tower."""
    tower = model.vision
    return tower is None or not (tower.bidirectional or tower.layout.multimodal_rope)


def shared_image_rows(model: LlamaModel, mb: PackedBatch, train_vision: bool) -> ImageRows | None:
    """The micro-batch's ImageRows over its shared-prefix layout's rows (the prefixes', then the
    suffixes', flattened (1, R)); None when it shows no image."""
    plain = batch_image_rows(model, mb, train_vision)
    if plain is None:
        return None
    assert mb.shared is not None, "a shared-prefix micro-batch carries its plan"
    flat = mb.shared.hidden_rows[plain.mask]                     # (N,) in the rows' order (row-major)
    flat, order = torch.sort(flat, stable=True)
    first = torch.ones_like(flat, dtype=torch.bool)
    first[1:] = flat[1:] != flat[:-1]                            # a shared prefix's rows, once
    mask = torch.zeros(mb.shared.num_token_rows, dtype=torch.bool, device=flat.device)
    mask[flat[first]] = True
    return ImageRows(plain.rows[order[first]], mask[None])

