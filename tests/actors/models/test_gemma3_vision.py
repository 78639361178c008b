"""Parity of postrain.actors.models.gemma3_vision (Gemma 3 with images) with Hugging Face transformers.

A tiny random folder is built with transformers in the test (Gemma3Config over a 3-layer gemma3_text
decoder whose sliding layers have an 8-token window, a 2-layer SigLIP tower of 4 x 4 patches pooled to
mm_tokens_per_image = 4, saved with a Gemma3Processor whose byte-level tokenizer holds Gemma's image
tokens and a "\\n\\n" merge, and a Gemma-style chat template), loaded through postrain's loader, and
compared in float32: pixel values (odd sizes, extreme aspect ratios, two images in one message), the
prompt ids (an image right after "user\\n": the processor's "\\n\\n" merges with it), logits with
transformers' token_type_ids mask (an image's tokens see each other both ways), greedy generation
through the engine (whole prompts and prefill chunks that would cut an image), the learner's logprobs
against the engine's, and the export: transformers loads save_checkpoint's folder (model, processor).
"""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.images import image_runs
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.models.hf_config import CheckpointError
from postrain.actors.models.loading import load_model, save_checkpoint
from postrain.actors.models.vision import ImageRows, render_prompt

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402
from tokenizers import AddedToken, decoders, models, pre_tokenizers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from postrain.bench.vision_folders import randomised  # noqa: E402

SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
            "<image_soft_token>"]
TEMPLATE = ("{{ bos_token }}{%- for message in messages -%}"
            "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
            "{{ '<start_of_turn>' + role + '\n' }}"
            "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
            "{%- else -%}{%- for item in message['content'] -%}"
            "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
            "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}"
            "{{ '<end_of_turn>\n' }}{%- endfor -%}"
            "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, sliding_window=8, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"])
VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=2, image_size=32, patch_size=8, vision_use_head=False)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def tiny_tokenizer():
    """Byte-level BPE (one merge: "\\n\\n") with Gemma's turn and image tokens as special tokens."""
    vocab = {s: i for i, s in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["ĊĊ"] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab, [("Ċ", "Ċ")], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})


def build_folder(folder, seed: int = 0):
    tokenizer = tiny_tokenizer()
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=tokenizer, image_seq_length=4, chat_template=TEMPLATE)
    ids = {name: tokenizer.convert_tokens_to_ids(f"<{token}>") for name, token in
           (("boi", "start_of_image"), ("eoi", "end_of_image"), ("image", "image_soft_token"))}
    config = transformers.Gemma3Config(
        text_config={**TEXT, "vocab_size": len(tokenizer), "bos_token_id": None, "eos_token_id": None},
        vision_config=VISION, mm_tokens_per_image=4, boi_token_index=ids["boi"], eoi_token_index=ids["eoi"],
        image_token_index=ids["image"])
    torch.manual_seed(seed)
    hf = randomised(transformers.Gemma3ForConditionalGeneration(config), seed)
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder, hf, processor


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder, hf, processor = build_folder(tmp_path_factory.mktemp("gemma3"))
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


def our_logits(model, ids: torch.Tensor, images: list) -> torch.Tensor:
    rows = model.vision.encode_images(images)
    return model(ids, images=ImageRows(rows, ids == model.vision.image_token_id))


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


def test_logits_equal_transformers_with_the_image_mask(pair):
    hf, processor, model, _, _ = pair
    images = [noise(90, 50, 3), noise(17, 301, 4)]
    inputs = hf_inputs(processor, images)
    assert inputs["input_ids"].shape[1] > 2 * TEXT["sliding_window"]     # the window matters
    with torch.no_grad():
        theirs = hf(**inputs).logits
        mine = our_logits(model, inputs["input_ids"], [png(i) for i in images])
        causal = hf(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    assert theirs.std() > 0.5                                  # not a flat (uninformative) comparison
    assert (causal - theirs).abs().max() > 1e-2               # the two-way image mask changes the logits


def run(engine: Engine, requests: list[tuple[list[int], list[bytes], SamplingParams]]):
    ids = [engine.add_request(p, params, images=images) for p, images, params in requests]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    return [done[i] for i in ids]


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
    (out,) = run(Engine(model, tokenizer), [(ids, files, GREEDY)])
    assert_same_sample(out.outputs[0], theirs)
    chunked = Engine(model, tokenizer, prefill_chunk_tokens=5, block_size_tokens=4)
    (first,) = run(chunked, [(ids, files, GREEDY)])
    assert_same_sample(first.outputs[0], theirs)
    (second,) = run(chunked, [(other, files, GREEDY)])
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
    (out,) = run(Engine(model, tokenizer, prefill_chunk_tokens=7), [(ids, files, params)])
    cut = [(s.token_ids, s.logprobs) for s in out.outputs]
    cut[1] = (cut[1][0][:-2], cut[1][1][:-2])                  # unequal lengths: a padded batch
    batch = TrainBatch(token_ids=[ids + tokens for tokens, _ in cut],
                       loss_mask=[[0] * len(ids) + [1] * len(tokens) for tokens, _ in cut],
                       behavior_logprobs=[[0.0] * len(ids) + logprobs for _, logprobs in cut],
                       rewards=[1.0, 0.0], group_ids=[0, 0], images=[files, files])
    learner = Learner(LearnerConfig(model=str(folder), micro_batch_size=2))
    mine = learner.compute_logprobs(batch)
    for lp_mine, lp_gen, mask in zip(mine, batch.behavior_logprobs, batch.loss_mask):
        m = torch.tensor(mask, dtype=torch.bool)
        assert (lp_mine[m] - torch.tensor(lp_gen)[m]).abs().max() < 1e-4


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
    reloaded, _ = load_model(folder)
    assert reloaded.config.vision == model.config.vision
    with torch.no_grad():
        expected = hf(**inputs).logits
        torch.testing.assert_close(theirs(**inputs).logits, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(our_logits(reloaded, inputs["input_ids"], images), expected, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------ refusals


def test_refusals_name_the_field(tmp_path):
    folder, _, _ = build_folder(tmp_path / "m")
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
