"""Tiny random-weight Hugging Face models saved to a folder, for the architecture tests (no download).

    folder = save_tiny(tmp_path / "q3", "qwen3")
    folder = save_tiny(tmp_path / "moe", "qwen3_moe", num_experts=8)
    folder = save_hf_folder(tmp_path / "Llama-3.2-1B-Instruct", "llama", template_file=True)

Vocabulary 264: the folder loads with postrain's byte tokenizer. Weights are normal(0, 0.2)
(norm weights uniform in [0.5, 1.5]) so that greedy decoding has clear winners. `save_hf_folder`
adds what a folder from the Hub holds besides: tokenizer.json, tokenizer_config.json and a chat
template (ChatML), in tokenizer_config.json (Qwen3's and Llama 3.2's releases) or, with
`template_file`, in chat_template.jinja (transformers 5's layout).
"""
from pathlib import Path

import torch

COMMON = dict(vocab_size=264, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
MOE = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[1])


def build_tiny(model_type: str, seed: int = 0, **overrides):
    """The transformers model (eval mode) of a tiny `model_type` config with random weights."""
    import transformers

    if model_type == "qwen3":
        config = transformers.Qwen3Config(**{**COMMON, **overrides})
        cls = transformers.Qwen3ForCausalLM
    elif model_type == "llama":
        config = transformers.LlamaConfig(**{**COMMON, **overrides})
        cls = transformers.LlamaForCausalLM
    elif model_type == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**{**COMMON, **MOE, **overrides})
        cls = transformers.Qwen3MoeForCausalLM
    else:
        raise ValueError(model_type)
    torch.manual_seed(seed)
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(torch.rand(param.shape, generator=gen) + 0.5)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model


def save_tiny(folder: Path, model_type: str, seed: int = 0, **overrides) -> Path:
    build_tiny(model_type, seed, **overrides).save_pretrained(folder)
    return Path(folder)


def save_hf_folder(folder: Path, model_type: str, template_file: bool = False, seed: int = 0) -> Path:
    """A tiny random `model_type` folder laid out as one from the Hub: weights, tokenizer, chat template."""
    import json

    from postrain.actors.models.chat_template import CHATML_TEMPLATE, TEMPLATE_FILE
    from postrain.actors.models.tokenizer import byte_tokenizer

    folder = save_tiny(folder, model_type, seed)
    byte_tokenizer().save(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if template_file:
        config.pop("chat_template")
        (folder / TEMPLATE_FILE).write_text(CHATML_TEMPLATE)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


PROMPT = "Hello, routed world"


def engine_vs_learner_logprobs(folder, **learner_options):
    """(engine logprobs, learner logprobs) of 2 sampled continuations, generated tokens only."""
    from postrain.actors.generator.engine import Engine
    from postrain.actors.generator.sampling import SamplingParams
    from postrain.actors.learner.learner import Learner
    from postrain.actors.models.loading import load_model
    from postrain.actors.records import TrainBatch

    model, tokenizer = load_model(folder)
    out = Engine(model, tokenizer).generate([PROMPT], SamplingParams(n=2, temperature=1.0, seed=3,
                                                                    max_new_tokens=16, ignore_eos=True))[0]
    prompt = out.prompt_token_ids
    samples = out.outputs
    batch = TrainBatch(token_ids=[prompt + s.token_ids for s in samples],
                       loss_mask=[[0] * len(prompt) + [1] * len(s.token_ids) for s in samples],
                       behavior_logprobs=[[0.0] * len(prompt) + s.logprobs for s in samples],
                       advantages=[1.0, -1.0],
                       routed_experts=([s.routed_experts for s in samples]
                                       if samples[0].routed_experts else None))
    learner = Learner({"model": str(folder), **learner_options})
    scored = learner.compute_logprobs(batch)
    engine = torch.tensor([lp for s in samples for lp in s.logprobs])
    ours = torch.cat([row[len(prompt):] for row in scored])
    return engine, ours
