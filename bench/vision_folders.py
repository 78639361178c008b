"""Random tiny vision-language folders built by `transformers` itself (model, tokenizer, processor):
the peers of `postrain bench vision` and of the vision families' tests (tests/actors/models/).

    folder, hf, processor = build_folder(tmp / "idefics3", "idefics3")   # or smolvlm, qwen2_5_vl, gemma3
    model, tokenizer = load_model(folder)          # postrain's own implementation of it

Nothing is downloaded: a byte-level tokenizer with the family's special tokens is built here, the
weights drawn from a seed (normal(0, 0.2), norm weights in [0.5, 1.5]: clear greedy winners).
Each family's default shapes are its test's (a 2- or 3-layer decoder, a 2- or 3-layer tower);
`text_shape` swaps in a larger decoder (the bench's), the family's own settings derived from it.
Also the tests' images (`noise`, `png`, `data_url`) and `run_requests`, requests with images run
through an engine to the end.
"""
from __future__ import annotations

import base64
import functools
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:
    from postrain.actors.generator.engine import Engine
    from postrain.actors.generator.sampling import SamplingParams
    from postrain.actors.generator.sequence import RequestOutput

FAMILIES = ("idefics3", "smolvlm", "qwen2_5_vl", "gemma3")


# ------------------------------------------------------------------ images and requests


def noise(width: int, height: int, seed: int) -> Image.Image:
    """An RGB image of uniform random pixels."""
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def run_requests(engine: Engine, requests: list[tuple[list[int], list[bytes], SamplingParams]]
                 ) -> list[RequestOutput]:
    """(prompt ids, images, params) run to the end; the outputs in the requests' order."""
    ids = [engine.add_request(p, params, images=images) for p, images, params in requests]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    return [done[i] for i in ids]


# ------------------------------------------------------------------ weights and tokenizers


def randomised(model, seed: int):
    """Weights normal(0, 0.2), norm weights in [0.5, 1.5] (clear greedy winners, bounded activations)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ("norm" in name or "ln_q" in name) and name.endswith("weight"):   # ln_q: Qwen2.5-VL's merger
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model.eval()


def byte_tokenizer(specials: list[str], newline_merge: bool, **tokens: Any):
    """Byte-level BPE with `specials` as special tokens (and, with `newline_merge`, one merge:
    "\\n\\n"); `tokens`: transformers' bos_token, eos_token, ... settings."""
    import transformers

    vocab = {s: i for i, s in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    if newline_merge:
        vocab["ĊĊ"] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab, [("Ċ", "Ċ")] if newline_merge else [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)


def saved(folder: Path, hf, seed: int, *parts) -> None:
    """`hf` randomised from `seed` (no eos: generation runs its whole length), saved with `parts`."""
    randomised(hf, seed)
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(folder)
    for part in parts:
        part.save_pretrained(folder)


# ------------------------------------------------------------------ Idefics3 / SmolVLM


IDEFICS3_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")
IDEFICS3_SPECIALS = (["<|endoftext|>", "<|im_start|>", "<fake_token_around_image>", "<image>", "<end_of_utterance>",
                      "<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])
IDEFICS3_TEXT: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, rms_norm_eps=1e-5)
IDEFICS3_VISION: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, patch_size=8)
# longest edge 96, 32-pixel tiles (4 x 4 patches, 2 x 2 joined: 4 rows per tile): up to 3 x 3 tiles
IDEFICS3_PROCESSOR: dict[str, Any] = dict(size={"longest_edge": 96}, max_image_size={"longest_edge": 32})


def idefics3_folder(folder: Path, model_type: str, seed: int, text_shape: dict | None):
    """Idefics3 or SmolVLM (tied LM head; a 6 x 6 position table for the 4 x 4 patch grid of a
    tile), both with an Idefics3Processor (SmolVLM's needs num2words; the prompt text is the same)."""
    import transformers

    tokenizer = byte_tokenizer(IDEFICS3_SPECIALS, True, bos_token="<|endoftext|>", eos_token="<end_of_utterance>")
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    processor = transformers.Idefics3Processor(
        image_processor=transformers.Idefics3ImageProcessorPil(**IDEFICS3_PROCESSOR), tokenizer=tokenizer,
        image_seq_len=4, chat_template=IDEFICS3_TEMPLATE)
    text = {**(text_shape or IDEFICS3_TEXT), "vocab_size": len(tokenizer), "bos_token_id": None, "eos_token_id": None}
    if model_type == "idefics3":
        config: Any = transformers.Idefics3Config(text_config=text, vision_config={**IDEFICS3_VISION, "image_size": 32},
                                                  image_token_id=image_token_id, scale_factor=2)
        cls: Any = transformers.Idefics3ForConditionalGeneration
    else:
        config = transformers.SmolVLMConfig(text_config={**text, "tie_word_embeddings": True},
                                            vision_config={**IDEFICS3_VISION, "image_size": 48},
                                            image_token_id=image_token_id, scale_factor=2, tie_word_embeddings=True)
        cls = transformers.SmolVLMForConditionalGeneration
    torch.manual_seed(seed)
    hf = cls(config)
    saved(folder, hf, seed, processor)
    return hf, processor


# ------------------------------------------------------------------ Qwen2.5-VL


QWEN2_5_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")
QWEN2_5_VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                       "<|image_pad|>", "<|video_pad|>"]
QWEN2_5_VL_TEXT: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=None, eos_token_id=None,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0})
# 8-pixel patches, 2 x 2 merged; windows of 32 pixels (2 x 2 merged patches); block 1 attends over the whole image
QWEN2_5_VL_VISION: dict[str, Any] = dict(
    depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=8, spatial_merge_size=2,
    temporal_patch_size=2, window_size=32, out_hidden_size=64, fullatt_block_indexes=[1])
# 4 to 30 image tokens per image
QWEN2_5_VL_PROCESSOR: dict[str, Any] = dict(
    min_pixels=16 * 16 * 4, max_pixels=16 * 16 * 30, patch_size=8, merge_size=2, temporal_patch_size=2)


@functools.cache
def qwen2_5_vl_processor_class() -> Any:
    """transformers' Qwen2_5_VLProcessor without a video processor (that needs torchvision)."""
    import transformers

    class Processor(transformers.Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return Processor


def qwen2_5_vl_folder(folder: Path, model_type: str, seed: int, text_shape: dict | None):
    """Qwen2.5-VL; the folder holds the image processor's preprocessor_config.json and the tokenizer
    (with the template). A `text_shape` keeps the rotary sections' proportions for its head size."""
    import transformers

    text, vision = QWEN2_5_VL_TEXT, QWEN2_5_VL_VISION
    if text_shape:
        half = text_shape["hidden_size"] // text_shape["num_attention_heads"] // 2
        rest = half - half // 4
        sections = [half // 4, rest - rest // 2, rest // 2]                  # [2, 3, 3] at 8, [4, 6, 6] at 16
        text = {**text, **text_shape, "rope_parameters": {**text["rope_parameters"], "mrope_section": sections}}
        vision = {**vision, "out_hidden_size": text_shape["hidden_size"]}
    tokenizer = byte_tokenizer(QWEN2_5_VL_SPECIALS, False, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = QWEN2_5_VL_TEMPLATE
    image_processor = transformers.Qwen2VLImageProcessorPil(**QWEN2_5_VL_PROCESSOR)
    processor = qwen2_5_vl_processor_class()(image_processor=image_processor, tokenizer=tokenizer,
                                             chat_template=QWEN2_5_VL_TEMPLATE)
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad",
                                                                          "vision_start", "vision_end")}
    config = transformers.Qwen2_5_VLConfig(
        text_config={**text, "vocab_size": len(tokenizer)}, vision_config=vision, image_token_id=ids["image_pad"],
        video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"])
    torch.manual_seed(seed)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(config)
    saved(folder, hf, seed, image_processor, tokenizer)
    return hf, processor


# ------------------------------------------------------------------ Gemma 3


GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")
GEMMA3_SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                   "<end_of_image>", "<image_soft_token>"]
GEMMA3_TEXT: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512, sliding_window=8, query_pre_attn_scalar=16,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"])
# a 2-layer SigLIP tower of 4 x 4 patches, pooled to mm_tokens_per_image = 4
GEMMA3_VISION: dict[str, Any] = dict(
    model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=2, image_size=32, patch_size=8, vision_use_head=False)


def gemma3_folder(folder: Path, model_type: str, seed: int, text_shape: dict | None):
    """Gemma 3 with images (a gemma3_text decoder whose sliding layers have an 8-token window). A
    `text_shape` keeps the window and alternates sliding and full layers."""
    import transformers

    text = GEMMA3_TEXT
    if text_shape:
        head_dim = text_shape["hidden_size"] // text_shape["num_attention_heads"]
        text = {**text, **text_shape, "head_dim": head_dim, "query_pre_attn_scalar": head_dim,
                "layer_types": [("sliding_attention", "full_attention")[i % 2]
                                for i in range(text_shape["num_hidden_layers"])]}
    tokenizer = byte_tokenizer(
        GEMMA3_SPECIALS, True, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    processor = transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
        tokenizer=tokenizer, image_seq_length=4, chat_template=GEMMA3_TEMPLATE)
    ids = {name: tokenizer.convert_tokens_to_ids(f"<{token}>") for name, token in
           (("boi", "start_of_image"), ("eoi", "end_of_image"), ("image", "image_soft_token"))}
    config = transformers.Gemma3Config(
        text_config={**text, "vocab_size": len(tokenizer), "bos_token_id": None, "eos_token_id": None},
        vision_config=GEMMA3_VISION, mm_tokens_per_image=4, boi_token_index=ids["boi"], eoi_token_index=ids["eoi"],
        image_token_index=ids["image"])
    torch.manual_seed(seed)
    hf = transformers.Gemma3ForConditionalGeneration(config)
    saved(folder, hf, seed, processor)
    return hf, processor


BUILDERS: dict[str, Callable[[Path, str, int, dict | None], tuple[Any, Any]]] = {
    "idefics3": idefics3_folder, "smolvlm": idefics3_folder, "qwen2_5_vl": qwen2_5_vl_folder,
    "gemma3": gemma3_folder}


def build_folder(folder: Path, model_type: str, seed: int = 0, text_shape: dict | None = None):
    """A tiny random `model_type` folder (one of FAMILIES: model, tokenizer, processor); (folder,
    hf model, processor). text_shape: the decoder's sizes (default: the family's test shapes)."""
    if model_type not in BUILDERS:
        raise ValueError(f"model_type {model_type!r}: one of {', '.join(FAMILIES)}")
    hf, processor = BUILDERS[model_type](folder, model_type, seed, text_shape)
    return folder, hf, processor
