"""The engine's images: each image encoded once by content hash, and the image rows of a step.

    encoder = ImageEncoder(model.vision, counters)
    features = encoder.features(prompt_ids, images)     # PromptImages: rows, their prompt positions, salt
    counters.num_image_encodes                          # vision-tower runs since start (cache misses)
    images = step_image_rows(rows, input_ids, device)   # ImageRows of a step's prefill rows, or None

Design note: a request's images are encoded when it is added (`Engine.add_request(images=)`), once
per distinct image: the features are cached by `vision.image_key` (the pixels' hash) in an LRU of
`max_images`, so a group of n samples on one image, and every later request that shows it, run the
tower once. The rows stay with the request (`Request.images`) until it finishes; a prefill chunk
takes the rows of the placeholders it covers, so chunked prefill, prefix-cache hits and a
preempted sequence's second prefill splice the same rows at the same positions. The images fill
the prompt's first placeholders, as many as their rows: a placeholder id the policy sampled (in a
later turn's prompt) is a token (models/vision.py `ImageRows`).
The prefix cache keys a prompt with images by a salt of its image keys (`vision.images_salt`), so
two prompts that differ only in their pixels never share KV. A weight swap clears the cache (the
tower and its projector may have been trained).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..models.vision import ImageRows, VisionTower, image_key, images_salt, load_image
from .sequence import EngineCounters, EngineError


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images: `rows` (N, H) on the model's device, `positions` (N,) the sorted prompt
    positions of their placeholders, `keys` the images' content hashes, `salt` the prefix-cache salt."""

    rows: torch.Tensor
    positions: np.ndarray
    keys: tuple[str, ...]
    salt: int

    def span(self, start: int, stop: int) -> tuple[np.ndarray, torch.Tensor]:
        """(positions - start, rows) of the placeholders at positions start .. stop - 1."""
        lo, hi = np.searchsorted(self.positions, [start, stop])
        return self.positions[lo:hi] - start, self.rows[lo:hi]


class ImageEncoder:
    """The tower's features per image, cached by content hash (module docstring)."""

    def __init__(self, tower: VisionTower, counters: EngineCounters, max_images: int = 256):
        self.tower = tower
        self.counters = counters
        self.max_images = max_images
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()

    def features(self, prompt_ids: list[int], images: list) -> PromptImages:
        """The rows of `images` (bytes, data URLs or PIL images) for a prompt holding their
        placeholders in order; EngineError when the counts disagree, ImageInputError (a
        ValueError) for an image that does not decode."""
        decoded = [load_image(image) for image in images]
        keys = tuple(image_key(image) for image in decoded)
        rows = [self._rows(key, image) for key, image in zip(keys, decoded)]
        positions = np.flatnonzero(np.asarray(prompt_ids) == self.tower.image_token_id)
        total = sum(len(r) for r in rows)
        if len(positions) < total:
            raise EngineError(f"the prompt has {len(positions)} image placeholder tokens but its {len(images)} "
                              f"image(s) make {total} rows; render the prompt with the model's image layout "
                              "(models/vision.py render_prompt) and pass the same images")
        return PromptImages(torch.cat(rows), positions[:total], keys, images_salt(list(keys)))

    def _rows(self, key: str, image) -> torch.Tensor:
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        device = next(self.tower.parameters()).device
        with torch.inference_mode():
            rows = self.tower(self.tower.layout.pixel_values(image).to(device))
        self.counters.num_image_encodes += 1
        self.cache[key] = rows
        if len(self.cache) > self.max_images:
            self.cache.popitem(last=False)
        return rows

    def clear(self) -> None:
        self.cache.clear()


def step_image_rows(rows, input_ids: torch.Tensor) -> ImageRows | None:
    """The ImageRows of a step's right-padded (B, T) `input_ids` whose scheduled rows (`rows`,
    ScheduledSequence) carry their request's `images`; None when no row covers an image."""
    mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    parts = []
    for b, row in enumerate(rows):
        if row.images is None:
            continue
        columns, image_rows = row.images.span(row.start_position, row.start_position + row.num_new_tokens)
        if len(columns):
            mask[b, torch.from_numpy(columns)] = True
            parts.append(image_rows)
    if not parts:
        return None
    return ImageRows(torch.cat(parts), mask.to(parts[0].device))
