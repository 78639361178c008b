"""The engine's images: each image encoded once by content hash, and the image rows of a step.

    encoder = ImageEncoder(model.vision, counters)
    features = encoder.features(prompt_ids, images)     # PromptImages: their prompt positions, salt; rows to come
    failed = encoder.encode_pending()                   # the tower over every image waiting: rows filled,
                                                        # (PromptImages, error) of those whose image failed
    counters.num_image_encodes                          # images the tower read since start (cache misses)
    images = step_image_rows(rows, input_ids, device)   # ImageRows of a step's prefill rows, or None

Design note: a request's images are checked when it is added (`Engine.add_request(images=)`: each
decodes, and the prompt holds their placeholders, counted from the layout) and encoded at the start
of the next engine step, together with every other request's added since: the distinct images not
yet cached go through the tower together (`VisionTower.encode_many`, MAX_IMAGES_PER_CALL a call),
as a batch of prompts with one chart each arrives. An image the tower fails on fails the requests
that show it, and no other (`Engine.encode_images` aborts them and names each). The features are
cached by `vision.image_key` (the pixels' hash) in an LRU of `max_images`, so a group of n samples
on one image, and every later request that shows it, run the tower once. Invariant: a
PromptImages' `rows` is None while it waits in `_pending`, and after only if its image failed
(its request aborted); the engine encodes before it schedules, so every row a step reads is
filled. The rows stay with the request (`Request.images`) until it finishes; a prefill chunk
takes the rows of the placeholders it covers, so chunked prefill, prefix-cache hits and a
preempted sequence's second prefill splice the same rows at the same positions. The images fill
the prompt's first placeholders, as many as their rows: a placeholder id the policy sampled (in a
later turn's prompt) is a token (models/vision.py `ImageRows`).
The prefix cache keys a prompt with images by a salt of its image keys (`vision.images_salt`), so
two prompts that differ only in their pixels never share KV. A weight swap clears the cache (the
tower and its projector may have been trained).
A model whose rotary reads three positions per token (a layout with `multimodal_rope`: Qwen2.5-VL)
gets them from a table computed once per request (`PromptImages.rope`, (3, prompt length)); a
position p past the prompt (generated tokens, their decodes, a preempted sequence's recompute)
turns by p + `rope_delta` on all three axes. Every row of a step that shows such a prompt, decodes
included, carries its PromptImages (scheduler.py), and `step_image_rows` fills the step's (3, B, T)
`ImageRows.rope_positions` (the plain positions for the other rows); text-only models and prompts
never build one.
A tower whose image runs attend both ways (`bidirectional`: Gemma 3) gives each prompt its runs
(`PromptImages.runs`): the scheduler never ends a prefill chunk inside one (`chunk_end`), and
`step_image_horizons` tells the attention backend which later keys of its run each placeholder
sees (attention.py `PagedMetadata.horizons`); other models' steps carry none (the causal mask).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ..models.images import image_key, images_salt, load_image
from ..models.vision import ImageRows, VisionTower
from .sequence import EngineCounters, EngineError, PromptImages


MAX_IMAGES_PER_CALL = 16     # images one tower call reads at most: a bound on its activations


class ImageEncoder:
    """The tower's features per image, cached by content hash (module docstring)."""

    def __init__(self, tower: VisionTower, counters: EngineCounters, max_images: int = 256):
        self.tower = tower
        self.counters = counters
        self.max_images = max_images
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._pending: list[tuple[PromptImages, list]] = []    # (its images, the decoded images) to encode
        self.tower_calls = 0                                       # encode_many calls since start

    def features(self, prompt_ids: list[int], images: list) -> PromptImages:
        """A prompt's images (bytes, data URLs or PIL images) for a prompt holding their
        placeholders in order, their rows filled by the next `encode_pending`; EngineError when
        the counts disagree, ImageInputError (a ValueError) for an image that does not decode."""
        decoded = [load_image(image) for image in images]
        keys = tuple(image_key(image) for image in decoded)
        layout = self.tower.layout
        positions = np.flatnonzero(np.asarray(prompt_ids) == self.tower.image_token_id)
        total = sum(layout.image_token_run(image).count(self.tower.image_token_id) for image in decoded)
        if len(positions) < total:
            raise EngineError(f"the prompt has {len(positions)} image placeholder tokens but its {len(images)} "
                              f"image(s) make {total} rows; render the prompt with the model's image layout "
                              "(models/vision.py render_prompt) and pass the same images")
        runs = image_runs(positions[:total]) if self.tower.bidirectional else ()
        if not layout.multimodal_rope:
            features = PromptImages(None, positions[:total], keys, images_salt(list(keys)), runs=runs)
        else:
            rope = layout.rope_positions(prompt_ids, decoded)
            features = PromptImages(None, positions[:total], keys, images_salt(list(keys)), rope,
                                    int(rope.max()) + 1 - len(prompt_ids), runs=runs)
        self._pending.append((features, decoded))
        return features

    def encode_pending(self) -> list[tuple[PromptImages, Exception]]:
        """Fill the rows of every prompt's images added since the last call: the images not in
        the cache go through the tower together (`encode_many`, at most MAX_IMAGES_PER_CALL a
        call), each distinct image once. A call that fails is retried one image at a time, so one
        image's failure is its prompts' alone: the (prompt's images, error) of each prompt left
        unfilled are returned, for the engine to fail those requests only."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, []
        todo: dict[str, object] = {}
        for features, decoded in pending:
            for key, image in zip(features.keys, decoded):
                if key not in self.cache and key not in todo:
                    todo[key] = image
        fresh: dict[str, torch.Tensor] = {}
        errors: dict[str, Exception] = {}
        keys = list(todo)
        for first in range(0, len(keys), MAX_IMAGES_PER_CALL):
            chunk = keys[first:first + MAX_IMAGES_PER_CALL]
            try:
                fresh.update(zip(chunk, self._encode([todo[key] for key in chunk])))
            except Exception as exc:
                if len(chunk) == 1:
                    errors[chunk[0]] = exc
                    continue
                for key in chunk:                      # which image: each alone
                    try:
                        fresh[key] = self._encode([todo[key]])[0]
                    except Exception as one:
                        errors[key] = one
        failed: list[tuple[PromptImages, Exception]] = []
        for features, _ in pending:
            bad = next((errors[key] for key in features.keys if key in errors), None)
            if bad is not None:
                failed.append((features, bad))
                continue
            features.rows = torch.cat([fresh[key] if key in fresh else self.cache[key] for key in features.keys])
            assert len(features.rows) == len(features.positions), "the layout counted each image's rows"
            for key in features.keys:
                if key in self.cache:
                    self.cache.move_to_end(key)
        self.cache.update(fresh)
        while len(self.cache) > self.max_images:
            self.cache.popitem(last=False)
        return failed

    def _encode(self, images: list) -> list[torch.Tensor]:
        device = next(self.tower.parameters()).device
        with torch.inference_mode():
            rows = self.tower.encode_many([self.tower.layout.pixel_values(image).to(device) for image in images])
        self.counters.num_image_encodes += len(images)
        self.tower_calls += 1
        return rows

    def clear(self) -> None:
        self.cache.clear()


def step_image_rows(rows, input_ids: torch.Tensor) -> ImageRows | None:
    """The ImageRows of a step's right-padded (B, T) `input_ids` whose scheduled rows (`rows`,
    ScheduledSequence) carry their request's `images`; None when no row covers an image and none
    needs multimodal rotary positions (module docstring)."""
    if all(row.images is None for row in rows):     # a text step: nothing to build
        return None
    mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    parts = []
    rope = step_rope_positions(rows, input_ids.shape[1])
    for b, row in enumerate(rows):
        if row.images is None:
            continue
        columns, image_rows = row.images.span(row.start_position, row.start_position + row.num_new_tokens)
        if len(columns):
            mask[b, torch.from_numpy(columns)] = True
            parts.append(image_rows)
    if not parts and rope is None:
        return None
    if not parts:        # decodes past an image prompt: no image rows, their positions only
        first = next(r.images.rows for r in rows if r.images is not None)
        assert first is not None, "the engine encodes a prompt's images before any step reads them"
        parts = [first[:0]]
    device = parts[0].device
    return ImageRows(torch.cat(parts), mask.to(device), None if rope is None else torch.from_numpy(rope).to(device))


def step_rope_positions(rows, width: int) -> np.ndarray | None:
    """(3, B, width) multimodal rotary positions of a step's rows, or None when no row's prompt has
    a rope table: a row with one reads it (`PromptImages.rope_span`), the others their plain positions."""
    if not any(row.images is not None and row.images.rope is not None for row in rows):
        return None
    out = np.zeros((3, len(rows), width), dtype=np.int64)
    for b, row in enumerate(rows):
        start, stop = row.start_position, row.start_position + row.num_new_tokens
        has_rope = row.images is not None and row.images.rope is not None
        out[:, b, :stop - start] = row.images.rope_span(start, stop) if has_rope else np.arange(start, stop)
    return out


def image_runs(positions: np.ndarray) -> tuple[tuple[int, int], ...]:
    """(first, stop) of each run of consecutive positions (one image's placeholders)."""
    if not len(positions):
        return ()
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    return tuple((int(run[0]), int(run[-1]) + 1) for run in np.split(positions, breaks))


def step_image_horizons(rows, positions: torch.Tensor) -> torch.Tensor | None:
    """(B, T) the last key position each new token of a step may see (attention.py
    `PagedMetadata.horizons`): its own, or the run's last for a placeholder of an image run its row
    reads (`PromptImages.runs`); None when no row reads such a run (the plain causal mask)."""
    horizons = None
    for b, row in enumerate(rows):
        if row.images is None or not row.images.runs:
            continue
        start, stop = row.start_position, row.start_position + row.num_new_tokens
        for first, end in row.images.runs:
            if end <= start or first >= stop:
                continue
            if end > stop:      # the scheduler's invariant (scheduler.py `PrefillGroup.chunk_end`)
                raise EngineError(f"a prefill chunk of positions {start}..{stop - 1} cuts the image run "
                                  f"{first}..{end - 1}, which must be read in one chunk")
            if horizons is None:
                horizons = positions.clone()
            horizons[b, max(first, start) - start:end - start] = end - 1
    return horizons
