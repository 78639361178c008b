"""Parity of postrain.actors.models.idefics3 (Idefics3 / SmolVLM) with Hugging Face transformers.

Tiny random folders are built with transformers (bench/vision_folders.py: Idefics3Config /
SmolVLMConfig over a 2-layer Llama and a 2-layer vision tower, saved with an Idefics3Processor whose
tokenizer holds the image tokens and a "\\n\\n" merge), loaded through postrain's loader, and
compared in float32: pixel values (odd sizes, extreme aspect ratios, several images per message,
splitting off), the prompt ids of a chat message with two images, logits, greedy generation (a plain
forward loop and the engine), and the export: transformers loads save_checkpoint's folder, model and
processor. The smolvlm folder's tower has more position embeddings than a tile has patches (48-pixel
image_size, 32-pixel tiles), so the bucketed position ids are exercised; the idefics3 one matches
them one to one, as the released models do. transformers' SmolVLMProcessor needs num2words, so both
folders carry an Idefics3Processor (the two build the same prompt text for images).
"""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.models.hf_config import CheckpointError, config_from_hf
from postrain.actors.models.idefics3 import Idefics3Layout
from postrain.actors.models.loading import load_model, model_config, save_checkpoint
from postrain.actors.models.images import render_prompt
from postrain.actors.models.vision import ImageRows

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402
from postrain.bench.vision_folders import build_folder, data_url, noise, png  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # tests/actors/models
from vision_checks import (  # noqa: E402
    assert_export_logits, assert_images_read_together_equal_each_alone, built_and_loaded, our_logits)

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def pair(request, tmp_path_factory):
    return built_and_loaded(tmp_path_factory.mktemp(request.param), request.param)[:4]


def chat(images: list[Image.Image]) -> tuple[list[dict], list[dict]]:
    """One user message with text and the images: (transformers' form, OpenAI's with data URLs)."""
    theirs = [{"role": "user", "content": [{"type": "text", "text": "Compare"}, {"type": "image"},
                                           {"type": "text", "text": " and\n"}, {"type": "image"},
                                           {"type": "text", "text": "please."}]}]
    urls = iter(images)
    ours = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(next(urls))}} if part["type"] == "image" else part
        for part in theirs[0]["content"]]}]
    return theirs, ours


SIZES = [(301, 17), (9, 300), (300, 1), (47, 31), (33, 33), (32, 32), (5, 5), (96, 40)]   # (width, height)


# ------------------------------------------------------------------ layout


@pytest.mark.parametrize("splitting", [True, False])
def test_pixel_values_equal_the_image_processor(pair, splitting):
    _, processor, model, _ = pair
    layout = Idefics3Layout({**model.config.vision, "do_image_splitting": splitting})
    images = [noise(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    for image in images:                                       # one image per call
        theirs = processor.image_processor(images=[[image]], do_image_splitting=splitting,
                                           return_tensors="pt")["pixel_values"][0]
        torch.testing.assert_close(layout.pixel_values(image), theirs, atol=1e-6, rtol=0)
    theirs = processor.image_processor(images=[images], do_image_splitting=splitting,   # all in one message
                                       return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(torch.cat([layout.pixel_values(i) for i in images]), theirs, atol=1e-6, rtol=0)


def test_prompt_ids_equal_the_processors(pair):
    _, processor, model, tokenizer = pair
    images = [noise(90, 50, 1), noise(20, 24, 2)]          # 3 x 2 tiles + the global one; the global one only
    theirs_messages, ours_messages = chat(images)
    text = processor.apply_chat_template(theirs_messages, add_generation_prompt=True)
    theirs = processor(text=text, images=images)["input_ids"][0]
    ids, image_bytes = render_prompt(tokenizer, model.vision.layout, ours_messages)
    assert ids == list(theirs)
    assert image_bytes == [png(i) for i in images]
    assert model.vision.layout.grid(50, 90) == (2, 3)
    assert tokenizer.hf.token_to_id("ĊĊ") in ids      # the "\\n\\n" before a global tile: one token, as theirs


# ------------------------------------------------------------------ model


def hf_inputs(processor, images):
    text = processor.apply_chat_template(chat(images)[0], add_generation_prompt=True)
    return processor(text=text, images=images, return_tensors="pt")


def test_images_read_in_one_pass_equal_each_read_alone(pair):
    assert_images_read_together_equal_each_alone(pair[2], SIZES[:5])


def test_logits_equal_transformers(pair):
    hf, processor, model, _ = pair
    images = [noise(90, 50, 3), noise(17, 301, 4)]
    inputs = hf_inputs(processor, images)
    with torch.no_grad():
        theirs = hf(**inputs).logits
        mine = our_logits(model, inputs["input_ids"], [png(i) for i in images])
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    assert theirs.std() > 0.5                                  # not a flat (uninformative) comparison


def test_greedy_generation_equals_transformers(pair):
    hf, processor, model, tokenizer = pair
    images = [noise(60, 40, 5), noise(24, 24, 6)]
    inputs = hf_inputs(processor, images)
    with torch.no_grad():
        theirs = hf.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()
    ids = inputs["input_ids"][0].tolist()
    rows = model.vision.encode_images([png(i) for i in images])
    out = list(ids)
    with torch.no_grad():                                      # a plain forward loop
        for _ in range(8):
            mask = torch.tensor(out) == model.vision.image_token_id
            mask[len(ids):] = False                            # sampled placeholders are tokens, not images
            out.append(int(model(torch.tensor([out]), images=ImageRows(rows, mask[None]))[0, -1].argmax()))
    assert out[len(ids):] == theirs
    engine = Engine(model, tokenizer)
    request = engine.add_request(ids, GREEDY, images=[png(i) for i in images])
    while engine.has_unfinished():
        done = {o.request_id: o for o in engine.step()}
    assert done[request].outputs[0].token_ids == theirs


def test_export_loads_in_transformers_and_back(pair, tmp_path):
    hf, processor, model, tokenizer = pair
    folder = save_checkpoint(model, tokenizer, tmp_path / "export")
    images = [noise(70, 30, 7), noise(30, 70, 8)]
    inputs = hf_inputs(processor, images)
    theirs = transformers.AutoModelForImageTextToText.from_pretrained(folder).eval()
    assert type(theirs) is type(hf)
    if isinstance(hf, transformers.Idefics3ForConditionalGeneration):   # SmolVLM's needs num2words and videos
        reloaded_processor = transformers.AutoProcessor.from_pretrained(folder)   # its template: the tokenizer's
        text = processor.apply_chat_template(chat(images)[0], add_generation_prompt=True)
        again = reloaded_processor(text=text, images=images, return_tensors="pt")
        assert again["input_ids"].tolist() == inputs["input_ids"].tolist()
    else:
        again = transformers.AutoImageProcessor.from_pretrained(folder)(images=[images], return_tensors="pt")
    torch.testing.assert_close(again["pixel_values"], inputs["pixel_values"], atol=0, rtol=0)
    assert_export_logits(folder, model, hf, theirs, inputs, lambda ours: our_logits(ours, inputs["input_ids"], images))


# ------------------------------------------------------------------ refusals


def test_older_processor_files_and_refusals(tmp_path):
    """The image processor's settings in preprocessor_config.json (transformers 4's layout) read as
    transformers 5's nested processor_config.json; unsupported settings refused by name."""
    folder, _, _ = build_folder(tmp_path / "m", "idefics3")
    vision = model_config(str(folder)).vision
    settings = json.loads((folder / "processor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps(settings.pop("image_processor")))
    (folder / "processor_config.json").write_text(json.dumps(settings))
    assert model_config(str(folder)).vision == vision
    hf = json.loads((folder / "config.json").read_text())
    with pytest.raises(CheckpointError, match="load the folder, not its config.json alone"):
        config_from_hf(hf)
    hf["text_config"]["model_type"] = "mistral"
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="text_config.model_type='mistral' is not supported"):
        load_model(folder)
    hf["text_config"]["model_type"] = "llama"
    hf["vision_config"]["hidden_act"] = "quick_gelu"
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(CheckpointError, match="hidden_act='quick_gelu' is not supported"):
        load_model(folder)
    hf["vision_config"]["hidden_act"] = "gelu_pytorch_tanh"
    (folder / "config.json").write_text(json.dumps(hf))
    (folder / "processor_config.json").write_text(json.dumps({**settings, "image_seq_len": 9}))
    with pytest.raises(CheckpointError, match="fix: image_seq_len = 4"):
        load_model(folder)
