"""Parity of postrain.actors.models.qwen2_5_vl (Qwen2.5-VL) with Hugging Face transformers.

A tiny random folder is built with transformers in the test (Qwen2_5_VLConfig over a 2-layer Qwen2
decoder and a 3-layer vision tower whose middle block attends over the whole image and the others
within 2 x 2 windows of merged patches; a Qwen2VLImageProcessor's preprocessor_config.json; a
byte-level tokenizer holding the vision tokens and a chat template), loaded through postrain's
loader and compared in float32: pixel values and image grids (odd sizes, extreme aspect ratios, two
images at once), the prompt ids of a chat message with two images, logits (one prompt, a
left-padded batch, and right padding against the unpadded rows; text-only too), greedy generation
through the engine (whole and chunked prefill, the image split across chunks), the learner's
logprobs against the engine's sampled ones, and the export (transformers loads it: the same
logits and pixels). transformers' Qwen2_5_VLProcessor wants a video processor, which needs
torchvision; the test's processor goes without one (images only).
"""
from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.models.hf_config import CheckpointError, config_from_hf
from postrain.actors.models.loading import load_model, save_checkpoint
from postrain.actors.models.vision import ImageInputError, ImageRows, batch_rope_positions, load_image, render_prompt

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402
from tokenizers import AddedToken, decoders, models, pre_tokenizers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/actors
from train_batches import sampled_batch  # noqa: E402

TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
            "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
            "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
            "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>"]
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
# 8-pixel patches, 2 x 2 merged; windows of 32 pixels (2 x 2 merged patches); block 1 attends over the whole image
VISION = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=8, spatial_merge_size=2,
              temporal_patch_size=2, window_size=32, out_hidden_size=64, fullatt_block_indexes=[1])
# 4 to 30 image tokens per image
PROCESSOR = dict(min_pixels=16 * 16 * 4, max_pixels=16 * 16 * 30, patch_size=8, merge_size=2, temporal_patch_size=2)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


class Processor(transformers.Qwen2_5_VLProcessor):
    """transformers' processor without a video processor (that needs torchvision)."""

    def check_argument_for_proper_class(self, argument_name, argument):
        if argument_name == "video_processor" and argument is None:
            return None
        return super().check_argument_for_proper_class(argument_name, argument)


def tiny_tokenizer():
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE({s: i for i, s in enumerate(byte_symbols)}, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                     pad_token="<|endoftext|>")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def randomised(model, seed: int):
    """Weights normal(0, 0.2), norm weights in [0.5, 1.5] (clear greedy winners, bounded activations)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


def build_folder(folder: Path, seed: int = 0):
    """A tiny random Qwen2.5-VL folder (model, tokenizer, image processor); (folder, hf model, processor)."""
    tokenizer = tiny_tokenizer()
    image_processor = transformers.Qwen2VLImageProcessorPil(**PROCESSOR)
    processor = Processor(image_processor=image_processor, tokenizer=tokenizer, chat_template=TEMPLATE)
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad",
                                                                          "vision_start", "vision_end")}
    config = transformers.Qwen2_5_VLConfig(
        text_config={**TEXT, "vocab_size": len(tokenizer)}, vision_config=VISION, image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"])
    torch.manual_seed(seed)
    hf = randomised(transformers.Qwen2_5_VLForConditionalGeneration(config), seed)
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(folder)
    image_processor.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, hf, processor


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder, hf, processor = build_folder(tmp_path_factory.mktemp("qwen2_5_vl"))
    model, tokenizer = load_model(folder)
    return hf, processor, model, tokenizer, folder


def noise(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


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
    for lp_mine, lp_gen, mask in zip(mine, batch.behavior_logprobs, batch.loss_mask):
        m = torch.tensor(mask, dtype=torch.bool)
        assert (lp_mine[m] - torch.tensor(lp_gen)[m]).abs().max() < 1e-4


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
    reloaded, _ = load_model(folder)
    assert reloaded.config.vision == model.config.vision
    with torch.no_grad():
        expected = hf(**inputs).logits
        torch.testing.assert_close(theirs(**inputs).logits, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(our_logits(reloaded, inputs["input_ids"], [images]), expected,
                                   atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ refusals


def test_refusals_name_the_field(tmp_path):
    folder, _, _ = build_folder(tmp_path / "m")
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
