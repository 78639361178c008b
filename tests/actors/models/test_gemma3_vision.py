"""Parity of postrain.actors.models.gemma3_vision (Gemma 3 with images) with Hugging Face transformers.

A tiny random folder is built with transformers (bench/vision_folders.py: Gemma3Config over a
3-layer gemma3_text decoder whose sliding layers have an 8-token window, a 2-layer SigLIP tower of
4 x 4 patches pooled to mm_tokens_per_image = 4, saved with a Gemma3Processor whose byte-level
tokenizer holds Gemma's image tokens and a "\\n\\n" merge, and a Gemma-style chat template), loaded
through postrain's loader, and compared in float32: pixel values (odd sizes, extreme aspect ratios,
two images in one message), the prompt ids (an image right after "user\\n": the processor's "\\n\\n"
merges with it), logits with transformers' token_type_ids mask (an image's tokens see each other
both ways), greedy generation through the engine (whole prompts and prefill chunks that would cut an
image), the learner's logprobs against the engine's, and the export: transformers loads
save_checkpoint's folder (model, processor).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.images import image_runs
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.models.hf_config import CheckpointError
from postrain.actors.models.loading import load_model, save_checkpoint
from postrain.actors.models.images import render_prompt

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402
from postrain.bench.vision_folders import (  # noqa: E402
    GEMMA3_TEXT, build_folder, data_url, noise, png, run_requests)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tests/actors/models
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/actors
from train_batches import assert_logprobs_equal  # noqa: E402
from vision_checks import (  # noqa: E402
    assert_export_logits, assert_images_read_together_equal_each_alone, built_and_loaded, our_logits)

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return built_and_loaded(tmp_path_factory.mktemp("gemma3"), "gemma3")


def chat(images: list[Image.Image]) -> tuple[list[dict], list[dict]]:
    """One user message opening with an image: (transformers' form, OpenAI's with data URLs)."""
    theirs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare"},
                                           {"type": "image"}, {"type": "text", "text": "and tell."}]}]
    urls = iter(images)
    ours = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(next(urls))}} if part["type"] == "image" else part
        for part in theirs[0]["content"]]}]
    return theirs, ours


def hf_inputs(processor, images):
    text = processor.apply_chat_template(chat(images)[0], add_generation_prompt=True)
    return processor(text=text, images=images, return_tensors="pt")


SIZES = [(301, 17), (9, 300), (300, 1), (47, 31), (33, 33), (32, 32), (5, 5)]   # (width, height)


# ------------------------------------------------------------------ layout


def test_pixel_values_and_prompt_ids_equal_the_processors(pair):
    _, processor, model, tokenizer, _ = pair
    layout = model.vision.layout
    images = [noise(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    for image in images:
        theirs = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        torch.testing.assert_close(layout.pixel_values(image), theirs, atol=1e-6, rtol=0)
    two = [noise(90, 50, 1), noise(20, 240, 2)]
    inputs = hf_inputs(processor, two)                          # two images in one message
    torch.testing.assert_close(torch.cat([layout.pixel_values(i) for i in two]), inputs["pixel_values"],
                               atol=1e-6, rtol=0)
    ids, image_bytes = render_prompt(tokenizer, layout, chat(two)[1])
    assert ids == inputs["input_ids"][0].tolist()
    assert image_bytes == [png(i) for i in two]
    assert tokenizer.hf.token_to_id("ĊĊ") in ids                 # "user\\n" + "\\n\\n": merged as theirs
    runs = image_runs(np.flatnonzero(np.asarray(ids) == model.vision.image_token_id))
    starts = np.flatnonzero(np.diff(inputs["token_type_ids"][0].numpy(), prepend=0) == 1)   # theirs
    assert list(runs) == [(int(i), int(i) + 4) for i in starts]


# ------------------------------------------------------------------ model


def test_images_read_in_one_pass_equal_each_read_alone(pair):
    assert_images_read_together_equal_each_alone(pair[2], SIZES[:5])


def test_logits_equal_transformers_with_the_image_mask(pair):
    hf, processor, model, _, _ = pair
    images = [noise(90, 50, 3), noise(17, 301, 4)]
    inputs = hf_inputs(processor, images)
    assert inputs["input_ids"].shape[1] > 2 * GEMMA3_TEXT["sliding_window"]     # the window matters
    with torch.no_grad():
        theirs = hf(**inputs).logits
        mine = our_logits(model, inputs["input_ids"], [png(i) for i in images])
        causal = hf(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    assert theirs.std() > 0.5                                  # not a flat (uninformative) comparison
    assert (causal - theirs).abs().max() > 1e-2               # the two-way image mask changes the logits


def hf_greedy(hf, inputs) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and their logprobs (log-softmax of its logits)."""
    with torch.no_grad():
        out = hf.generate(**inputs, max_new_tokens=8, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    tokens = out.sequences[0, inputs["input_ids"].shape[1]:]
    logits = torch.cat(out.logits)                                          # (8, V)
    return tokens.tolist(), torch.log_softmax(logits.float(), -1)[torch.arange(len(tokens)), tokens]


def assert_same_sample(sample, theirs) -> None:
    tokens, logprobs = theirs
    assert sample.token_ids == tokens
    torch.testing.assert_close(torch.tensor(sample.logprobs), logprobs, atol=1e-4, rtol=0)


def test_greedy_generation_through_the_engine_equals_transformers(pair):
    """Whole prompts; chunks of 5 tokens (each image's 4-token run would be cut: the chunk stops
    before it or reads on to its end); and a prefix-cache hit that ends inside a run."""
    hf, processor, model, tokenizer, _ = pair
    images = [noise(60, 40, 5), noise(24, 24, 6)]
    files = [png(i) for i in images]
    inputs = hf_inputs(processor, images)
    ids = inputs["input_ids"][0].tolist()
    runs = image_runs(np.flatnonzero(np.asarray(ids) == model.vision.image_token_id))
    # the same images, other text from just after the second image: with 4-token blocks the prefix
    # cache holds that image's run only in part (a hit that ends inside it)
    other = ids[:runs[-1][1] + 2] + tokenizer.encode("Xy?<end_of_turn>\n<start_of_turn>model\n", add_bos=False)
    theirs = hf_greedy(hf, inputs)
    other_ids = torch.tensor([other])
    theirs_other = hf_greedy(hf, {**inputs, "input_ids": other_ids, "attention_mask": torch.ones_like(other_ids),
                                  "token_type_ids": (other_ids == model.vision.image_token_id).long()})
    (out,) = run_requests(Engine(model, tokenizer), [(ids, files, GREEDY)])
    assert_same_sample(out.outputs[0], theirs)
    chunked = Engine(model, tokenizer, prefill_chunk_tokens=5, block_size_tokens=4)
    (first,) = run_requests(chunked, [(ids, files, GREEDY)])
    assert_same_sample(first.outputs[0], theirs)
    (second,) = run_requests(chunked, [(other, files, GREEDY)])
    assert_same_sample(second.outputs[0], theirs_other)
    assert runs[-1][0] < second.num_cached_prompt_tokens < runs[-1][1], (second.num_cached_prompt_tokens, runs)


def test_learner_logprobs_equal_the_engines(pair):
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from postrain.actors.records import TrainBatch

    _, processor, model, tokenizer, folder = pair
    images = [noise(50, 70, 7), noise(33, 20, 8)]
    files = [png(i) for i in images]
    ids = hf_inputs(processor, images)["input_ids"][0].tolist()
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, seed=3, ignore_eos=True)
    (out,) = run_requests(Engine(model, tokenizer, prefill_chunk_tokens=7), [(ids, files, params)])
    cut = [(s.token_ids, s.logprobs) for s in out.outputs]
    cut[1] = (cut[1][0][:-2], cut[1][1][:-2])                  # unequal lengths: a padded batch
    batch = TrainBatch(token_ids=[ids + tokens for tokens, _ in cut],
                       loss_mask=[[0] * len(ids) + [1] * len(tokens) for tokens, _ in cut],
                       behavior_logprobs=[[0.0] * len(ids) + logprobs for _, logprobs in cut],
                       rewards=[1.0, 0.0], group_ids=[0, 0], images=[files, files])
    learner = Learner(LearnerConfig(model=str(folder), micro_batch_size=2))
    mine = learner.compute_logprobs(batch)
    assert_logprobs_equal(mine, batch)


def test_export_loads_in_transformers_and_back(pair, tmp_path):
    hf, processor, model, tokenizer, _ = pair
    folder = save_checkpoint(model, tokenizer, tmp_path / "export")
    images = [noise(70, 30, 9), noise(30, 70, 10)]
    inputs = hf_inputs(processor, images)
    theirs = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    assert type(theirs) is type(hf)
    reloaded_processor = transformers.AutoProcessor.from_pretrained(folder)
    text = processor.apply_chat_template(chat(images)[0], add_generation_prompt=True)
    again = reloaded_processor(text=text, images=images, return_tensors="pt")
    assert again["input_ids"].tolist() == inputs["input_ids"].tolist()
    torch.testing.assert_close(again["pixel_values"], inputs["pixel_values"], atol=0, rtol=0)
    assert_export_logits(folder, model, hf, theirs, inputs, lambda ours: our_logits(ours, inputs["input_ids"], images))


# ------------------------------------------------------------------ refusals


def test_refusals_name_the_field(tmp_path):
    folder, _, _ = build_folder(tmp_path / "m", "gemma3")
    settings = json.loads((folder / "processor_config.json").read_text())
    hf = json.loads((folder / "config.json").read_text())

    def refused(match: str, config: dict | None = None, processor: dict | None = None):
        (folder / "config.json").write_text(json.dumps(config or hf))
        (folder / "processor_config.json").write_text(json.dumps(processor or settings))
        with pytest.raises(CheckpointError, match=match):
            load_model(folder)

    refused("do_pan_and_scan=true is not implemented",
            processor={**settings, "image_processor": {**settings["image_processor"], "do_pan_and_scan": True}})
    refused("fix: image_seq_length = 4", processor={**settings, "image_seq_length": 9})
    refused("vision_use_head=true", config={**hf, "vision_config": {**hf["vision_config"], "vision_use_head": True}})
    refused("mm_tokens_per_image 9 must be a square whose side divides",
            config={**hf, "mm_tokens_per_image": 9},
            processor={**settings, "image_seq_length": 9})
    refused("config.json's image_token_index", config={**hf, "image_token_index": 3})
