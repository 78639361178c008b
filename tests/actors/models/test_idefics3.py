"""Parity of postrain.actors.models.idefics3 (Idefics3 / SmolVLM) with Hugging Face transformers.

Tiny random folders are built with transformers in the test (Idefics3Config / SmolVLMConfig over a
2-layer Llama and a 2-layer vision tower, saved with an Idefics3Processor whose tokenizer holds the
image tokens and a "\\n\\n" merge), loaded through postrain's loader, and compared in float32:
pixel values (odd sizes, extreme aspect ratios, several images per message, splitting off), the
prompt ids of a chat message with two images, logits, greedy generation (a plain forward loop and
the engine), and the export: transformers loads save_checkpoint's folder, model and processor.
The smolvlm folder's tower has more position embeddings than a tile has patches (48-pixel
image_size, 32-pixel tiles), so the bucketed position ids are exercised; the idefics3 one matches
them one to one, as the released models do. transformers' SmolVLMProcessor needs num2words, so
both folders carry an Idefics3Processor (the two build the same prompt text for images).
"""
from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.models.hf_config import CheckpointError, config_from_hf
from postrain.actors.models.idefics3 import Idefics3Layout
from postrain.actors.models.loading import load_model, model_config, save_checkpoint
from postrain.actors.models.vision import ImageRows, render_prompt

transformers = pytest.importorskip("transformers")
from PIL import Image  # noqa: E402
from tokenizers import AddedToken, decoders, models, pre_tokenizers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

TEMPLATE = ("<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
            "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
            "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
            "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
            "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
SPECIALS = (["<|endoftext|>", "<|im_start|>", "<fake_token_around_image>", "<image>", "<end_of_utterance>",
             "<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
TEXT = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=8)
# longest edge 96, 32-pixel tiles (4 x 4 patches, 2 x 2 joined: 4 rows per tile): up to 3 x 3 tiles
PROCESSOR = dict(size={"longest_edge": 96}, max_image_size={"longest_edge": 32})
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def tiny_tokenizer():
    """Byte-level BPE (one merge: "\\n\\n") with the image tokens as special tokens."""
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(byte_symbols)}
    vocab["ĊĊ"] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab, [("Ċ", "Ċ")], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<end_of_utterance>")


def randomised(model, seed: int):
    """Weights normal(0, 0.2), norm weights in [0.5, 1.5] (clear greedy winners, bounded activations)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


def build_folder(folder: Path, model_type: str, seed: int = 0):
    """A tiny random `model_type` folder (model, tokenizer, processor); (folder, hf model, processor)."""
    tokenizer = tiny_tokenizer()
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    processor = transformers.Idefics3Processor(
        image_processor=transformers.Idefics3ImageProcessorPil(**PROCESSOR), tokenizer=tokenizer,
        image_seq_len=4, chat_template=TEMPLATE)
    text = {**TEXT, "vocab_size": len(tokenizer), "bos_token_id": None, "eos_token_id": None}
    if model_type == "idefics3":
        config = transformers.Idefics3Config(text_config=text, vision_config={**VISION, "image_size": 32},
                                             image_token_id=image_token_id, scale_factor=2)
        cls = transformers.Idefics3ForConditionalGeneration
    else:   # tied LM head; a 6 x 6 position table for the 4 x 4 patch grid of a tile
        config = transformers.SmolVLMConfig(text_config={**text, "tie_word_embeddings": True},
                                            vision_config={**VISION, "image_size": 48},
                                            image_token_id=image_token_id, scale_factor=2, tie_word_embeddings=True)
        cls = transformers.SmolVLMForConditionalGeneration
    torch.manual_seed(seed)
    hf = randomised(cls(config), seed)
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder, hf, processor


@pytest.fixture(scope="module", params=["idefics3", "smolvlm"])
def pair(request, tmp_path_factory):
    folder, hf, processor = build_folder(tmp_path_factory.mktemp(request.param), request.param)
    model, tokenizer = load_model(folder)
    return hf, processor, model, tokenizer


def noise(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


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


def our_logits(model, ids: torch.Tensor, images: list) -> torch.Tensor:
    rows = model.vision.encode_images(images)
    return model(ids, images=ImageRows(rows, ids == model.vision.image_token_id))


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
    reloaded, _ = load_model(folder)
    assert reloaded.config.vision == model.config.vision
    with torch.no_grad():
        expected = hf(**inputs).logits
        torch.testing.assert_close(theirs(**inputs).logits, expected, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(our_logits(reloaded, inputs["input_ids"], images), expected, atol=1e-4, rtol=1e-4)


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
