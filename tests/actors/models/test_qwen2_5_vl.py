"""Parity of postrain.actors.models.qwen2_5_vl (Qwen2.5-VL) with Hugging Face transformers.

A tiny random folder is built with transformers (bench/vision_folders.py: Qwen2_5_VLConfig over a
2-layer Qwen2 decoder and a 3-layer vision tower whose middle block attends over the whole image and
the others within 2 x 2 windows of merged patches; a Qwen2VLImageProcessor's
preprocessor_config.json; a byte-level tokenizer holding the vision tokens and a chat template),
loaded through postrain's loader and compared in float32: pixel values and image grids (odd sizes,
extreme aspect ratios, two images at once), the prompt ids of a chat message with two images, logits
(one prompt, a left-padded batch, and right padding against the unpadded rows; text-only too),
greedy generation through the engine (whole and chunked prefill, the image split across chunks), the
learner's logprobs against the engine's sampled ones, and the export (transformers loads it: the
same logits and pixels). transformers' Qwen2_5_VLProcessor wants a video processor, which needs
torchvision; the test's processor goes without one (images only).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.models.hf_config import CheckpointError, config_from_hf
from postrain.actors.models.loading import load_model, save_checkpoint
from postrain.actors.models.images import ImageInputError, load_image, render_prompt
from postrain.actors.models.vision import ImageRows, batch_rope_positions

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402
from postrain.bench.vision_folders import build_folder, data_url, noise, png  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tests/actors/models
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/actors
from train_batches import assert_logprobs_equal, sampled_batch  # noqa: E402
from vision_checks import (  # noqa: E402
    assert_export_logits, assert_images_read_together_equal_each_alone, built_and_loaded)

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return built_and_loaded(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl")


def chat(images: list[Image.Image], words: str = "Compare") -> tuple[list[dict], list[dict]]:
    """One user message with text and the images: (transformers' form, OpenAI's with data URLs)."""
    theirs = [{"role": "user", "content": [{"type": "text", "text": words}, {"type": "image"},
                                           {"type": "text", "text": " and\n"}, {"type": "image"},
                                           {"type": "text", "text": "please."}][:2 + 2 * (len(images) - 1) + 1]}]
    urls = iter(images)
    ours = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(next(urls))}} if part["type"] == "image" else part
        for part in theirs[0]["content"]]}]
    return theirs, ours


def hf_inputs(processor, prompts: list[list[Image.Image]], **kwargs):
    """The processor's inputs of a batch of chat prompts (one user message each, with its images)."""
    texts = [processor.apply_chat_template(chat(images, f"Look{i}")[0], add_generation_prompt=True)
             for i, images in enumerate(prompts)]
    return processor(text=texts, images=[i for images in prompts for i in images], return_tensors="pt", **kwargs)


def our_logits(model, ids: torch.Tensor, images: list[list], attention_mask=None) -> torch.Tensor:
    """Logits of a batch (row b shows images[b]): the rows spliced, the multimodal rotary positions."""
    decoded = [[load_image(i) for i in row] for row in images]
    rows = model.vision.encode_images([i for row in decoded for i in row])
    mask = ids == model.vision.image_token_id
    if attention_mask is not None:
        mask &= attention_mask.bool()
    rope = batch_rope_positions(model.vision.layout, ids, decoded, attention_mask)
    return model(ids, attention_mask, images=ImageRows(rows, mask, rope))


SIZES = [(301, 17), (9, 300), (200, 1), (47, 31), (33, 33), (5, 5), (96, 40), (150, 150), (1, 120)]   # (w, h)


# ------------------------------------------------------------------ layout


def test_pixel_values_and_grids_equal_the_image_processor(pair):
    _, processor, model, _, _ = pair
    layout = model.vision.layout
    images = [noise(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    ours = [layout.patches(layout.pixel_values(image)) for image in images]
    grids = [[1, *layout.grid(image.height, image.width)] for image in images]
    for image, mine, grid in zip(images, ours, grids):                         # one image per call
        theirs = processor.image_processor(images=[image], return_tensors="pt")
        torch.testing.assert_close(mine, theirs["pixel_values"], atol=1e-6, rtol=0)
        assert theirs["image_grid_thw"].tolist() == [grid]
    theirs = processor.image_processor(images=images[:2], return_tensors="pt")  # two at once
    torch.testing.assert_close(torch.cat(ours[:2]), theirs["pixel_values"], atol=1e-6, rtol=0)
    assert theirs["image_grid_thw"].tolist() == grids[:2]
    assert grids[5] == [1, 4, 4] and grids[7] == [1, 10, 10]              # min_pixels, max_pixels bind
    with pytest.raises(ImageInputError, match="aspect ratio over 200"):
        layout.grid(1, 300)
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        processor.image_processor(images=[noise(300, 1, 0)])


def test_prompt_ids_equal_the_processors(pair):
    _, processor, model, tokenizer, _ = pair
    images = [noise(90, 50, 1), noise(20, 240, 2)]
    theirs = hf_inputs(processor, [images])["input_ids"][0].tolist()
    ids, image_bytes = render_prompt(tokenizer, model.vision.layout, chat(images, "Look0")[1])
    assert ids == theirs
    assert image_bytes == [png(i) for i in images]
    assert ids.count(model.vision.image_token_id) == sum(len(model.vision.layout.image_token_run(i)) for i in images)


# ------------------------------------------------------------------ model


def test_images_read_in_one_pass_equal_each_read_alone(pair):
    """Windows and full-attention blocks stay within their image."""
    assert_images_read_together_equal_each_alone(pair[2], SIZES[:5])


def test_logits_equal_transformers(pair):
    hf, processor, model, _, _ = pair
    images = [noise(90, 50, 3), noise(17, 301, 4)]
    inputs = hf_inputs(processor, [images])
    with torch.no_grad():
        theirs = hf(**inputs).logits
        mine = our_logits(model, inputs["input_ids"], [[png(i) for i in images]])
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    assert theirs.std() > 0.5                                  # not a flat (uninformative) comparison
    text = processor.tokenizer("just text, no image", return_tensors="pt")["input_ids"]
    with torch.no_grad():                                      # text only: the plain rotary, as theirs
        torch.testing.assert_close(model(text), hf(input_ids=text).logits, atol=1e-4, rtol=1e-4)


def test_padded_batches_equal_transformers_and_the_unpadded_rows(pair):
    hf, processor, model, _, _ = pair
    prompts = [[noise(40, 70, 5)], [noise(64, 64, 6), noise(100, 30, 7)]]
    processor.tokenizer.padding_side = "left"
    inputs = hf_inputs(processor, prompts, padding=True)
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert not mask.all()
    with torch.no_grad():
        theirs = hf(**inputs).logits
        mine = our_logits(model, ids, prompts, mask)
        torch.testing.assert_close(mine[mask.bool()], theirs[mask.bool()], atol=1e-4, rtol=1e-4)
        right_ids = torch.zeros_like(ids)                      # the same rows right-padded
        right_mask = torch.zeros_like(mask)
        for b, row in enumerate(ids):
            real = row[mask[b].bool()]
            right_ids[b, :len(real)], right_mask[b, :len(real)] = real, 1
            alone = our_logits(model, real[None], [prompts[b]])[0]
            torch.testing.assert_close(mine[b][mask[b].bool()], alone, atol=1e-4, rtol=1e-4)
        right = our_logits(model, right_ids, prompts, right_mask)
        torch.testing.assert_close(right[right_mask.bool()], mine[mask.bool()], atol=1e-4, rtol=1e-4)


def test_greedy_generation_through_the_engine_equals_transformers(pair):
    hf, processor, model, tokenizer, _ = pair
    images = [noise(60, 40, 8), noise(24, 90, 9)]
    inputs = hf_inputs(processor, [images])
    with torch.no_grad():
        theirs = hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    ids = inputs["input_ids"][0].tolist()
    first = ids.index(model.vision.image_token_id)
    for chunk in (0, first + 3):                               # one prefill; chunks that split the first image
        engine = Engine(model, tokenizer, prefill_chunk_tokens=chunk, kv_cache_mb=4)
        request = engine.add_request(ids, GREEDY, images=[png(i) for i in images])
        engine.add_request(ids[:first - 1], GREEDY)            # a text-only row beside it, decoding together
        result = None
        while engine.has_unfinished():
            for out in engine.step():
                result = out if out.request_id == request else result
        assert result.outputs[0].token_ids == theirs, f"prefill_chunk_tokens={chunk}"
    again = engine.add_request(ids, GREEDY, images=[png(i) for i in images])     # a prefix-cache hit
    while engine.has_unfinished():
        result = next((out for out in engine.step() if out.request_id == again), result)
    assert result.num_cached_prompt_tokens > 0 and result.outputs[0].token_ids == theirs
    blocks = -(-len(ids) // 4) + 4                       # the prompt and a few samples' tails, not all three
    engine = Engine(model, tokenizer, num_blocks=blocks, block_size_tokens=4)
    engine.add_request(ids, dataclasses.replace(GREEDY, n=3), images=[png(i) for i in images])
    while engine.has_unfinished():                       # preempted samples recompute past the prompt
        result = next(iter(engine.step()), result)
    assert engine.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in result.outputs] == [theirs] * 3


def test_learner_logprobs_equal_the_engines(pair):
    _, _, model, tokenizer, folder = pair
    learner = Learner(LearnerConfig(model=str(folder), micro_batch_size=4, lr=1e-3))
    engine = Engine(model, tokenizer, kv_cache_mb=4)
    prompts = []
    for images in ([noise(50, 50, 10), noise(30, 80, 11)], [noise(70, 20, 12)]):
        ids, files = render_prompt(tokenizer, model.vision.layout, chat(images, "Hi")[1])
        prompts.append((ids, files))
    requests = [engine.add_request(ids, SamplingParams(n=2, temperature=1.0, max_new_tokens=10, seed=3,
                                                       ignore_eos=True), images=files)
                for ids, files in prompts]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step()})
    batch = sampled_batch([ids for ids, _ in prompts], [done[r] for r in requests])
    batch = dataclasses.replace(batch, images=[files for _, files in prompts for _ in range(2)])
    mine = learner.compute_logprobs(batch)
    assert_logprobs_equal(mine, batch)


def test_export_loads_in_transformers_and_back(pair, tmp_path):
    hf, processor, model, tokenizer, _ = pair
    folder = save_checkpoint(model, tokenizer, tmp_path / "export")
    images = [noise(70, 30, 13), noise(30, 70, 14)]
    inputs = hf_inputs(processor, [images])
    theirs = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    assert type(theirs) is type(hf)
    again = transformers.AutoImageProcessor.from_pretrained(folder)(images=images, return_tensors="pt")
    torch.testing.assert_close(again["pixel_values"], inputs["pixel_values"], atol=0, rtol=0)
    assert again["image_grid_thw"].tolist() == inputs["image_grid_thw"].tolist()
    assert_export_logits(folder, model, hf, theirs, inputs,
                         lambda ours: our_logits(ours, inputs["input_ids"], [images]))


# ------------------------------------------------------------------ refusals


def test_refusals_name_the_field(tmp_path):
    folder, _, _ = build_folder(tmp_path / "m", "qwen2_5_vl")
    hf = json.loads((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="load the folder, not its config.json alone"):
        config_from_hf(hf)

    def refused(edit, match):
        changed = json.loads(json.dumps(hf))
        edit(changed)
        (folder / "config.json").write_text(json.dumps(changed))
        with pytest.raises(CheckpointError, match=match):
            load_model(folder)

    refused(lambda c: c["text_config"]["rope_parameters"].update(mrope_section=[2, 2, 2]),
            r"mrope_section \[2, 2, 2\] must be 3 sizes summing to head_dim / 2 = 8")
    refused(lambda c: c["vision_config"].update(hidden_act="gelu"), "vision_config.hidden_act='gelu'")
    refused(lambda c: c["vision_config"].update(patch_size=4), "patch_size=8 but vision_config.patch_size=4")
    refused(lambda c: c["text_config"].update(use_sliding_window=True), "use_sliding_window=true")
