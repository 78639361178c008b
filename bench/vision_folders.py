"""Random tiny vision-language folders built by `transformers` itself (model, tokenizer, processor):
the peers of `postrain bench vision` and of the vision families' tests (tests/actors/models/).

    folder, hf, processor = build_folder(tmp / "idefics3", "idefics3")
    model, tokenizer = load_model(folder)          # postrain's own implementation of it

Nothing is downloaded: a byte-level tokenizer with the family's image tokens is built here, the
weights drawn from a seed (normal(0, 0.2), norm weights in [0.5, 1.5]: clear greedy winners).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

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
PROCESSOR: dict[str, Any] = dict(size={"longest_edge": 96}, max_image_size={"longest_edge": 32})


def tiny_tokenizer():
    """Byte-level BPE (one merge: "\\n\\n") with the image tokens as special tokens."""
    byte_symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(byte_symbols)}
    vocab["ĊĊ"] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab, [("Ċ", "Ċ")], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    import transformers

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


def build_folder(folder: Path, model_type: str, seed: int = 0, text_shape: dict | None = None):
    """A tiny random `model_type` folder (model, tokenizer, processor); (folder, hf model, processor).
    text_shape: the decoder's sizes (default TEXT, the tests')."""
    import transformers

    tokenizer = tiny_tokenizer()
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    processor = transformers.Idefics3Processor(
        image_processor=transformers.Idefics3ImageProcessorPil(**PROCESSOR), tokenizer=tokenizer,
        image_seq_len=4, chat_template=TEMPLATE)
    text = {**(text_shape or TEXT), "vocab_size": len(tokenizer), "bos_token_id": None, "eos_token_id": None}
    if model_type == "idefics3":
        config: Any = transformers.Idefics3Config(text_config=text, vision_config={**VISION, "image_size": 32},
                                             image_token_id=image_token_id, scale_factor=2)
        cls: Any = transformers.Idefics3ForConditionalGeneration
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
