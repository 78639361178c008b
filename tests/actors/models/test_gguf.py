"""GGUF files of the registry's architectures (actors/models/gguf.py): tiny random models built by
transformers, written as llama.cpp lays them out (gguf_files.py), loaded by postrain.

- Against transformers' own GGUF reader on the same file (the reference): equal logits and equal
  greedy tokens through the engine, for qwen3, qwen3_moe, gemma3 and Mistral (stored as llama), on
  configs that reader reads completely (it takes Qwen3's head_dim, Qwen3-MoE's expert width and
  Gemma 3's query scale, local rope base and layer pattern from its config defaults).
- Against the Hugging Face model the file was written from, where the file says more than
  transformers' reader takes: a Mistral window, Qwen3 head_dim, Qwen3-MoE's expert width, Gemma 3's
  own layer pattern, local rope base, linear scaling and logit soft cap.
- Quantized files (Q8_0, Q4_0) dequantize as transformers dequantizes them.
- An unsupported architecture (Mixtral included), a missing key, a per-layer array, an unknown tensor,
  an unsupported rope scaling type and an unknown tokenizer model are refused by name.
- SentencePiece (`llama`) vocabularies shaped like Mistral 7B's and Gemma 3's: postrain's encode,
  decode and chat-rendered prompt ids equal transformers' tokenizer read from the same file, and
  `postrain generate --chat` runs on such a file.
"""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).parent))
import arch_checks  # noqa: E402  (tests/actors/models/arch_checks.py)
import gguf_files  # noqa: E402

from gguf import GGMLQuantizationType  # noqa: E402

from postrain.actors.generator.engine import Engine  # noqa: E402
from postrain.actors.generator.sampling import SamplingParams  # noqa: E402
from postrain.actors.models import model_class  # noqa: E402
from postrain.actors.models.loading import CheckpointError, load_model  # noqa: E402
from postrain.actors.models.spec import spec_tokenizer  # noqa: E402
from postrain.actors.models.tokenizer import byte_tokenizer  # noqa: E402
from postrain.bench.architectures import BYTE_IDS, build_hf_folder  # noqa: E402

PROMPT_IDS = byte_tokenizer().encode(arch_checks.PROMPT)       # 41 tokens, longer than every window
NUM_TOKENS = 24
SMALL = dict(vocab_size=264, hidden_size=64, intermediate_size=128, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=512, **BYTE_IDS)


def random_model(config, seed: int = 0, std: float = 0.1):
    """A transformers model of `config` with normal(0, std) weights, norms around identity (as
    bench/architectures.py draws them)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    gemma = config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn_like(param) * std + (1.0 if "norm" in name and not gemma else 0.0))
    return model


# Configs transformers' GGUF reader reads completely: Qwen3's head_dim 128 and Qwen3-MoE's expert
# width 768 are its config defaults; Gemma 3 with head_dim = query_pre_attn_scalar = 256, every 6th
# layer global, local rope base 10000 (llama.cpp's values too).
READABLE = {
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, num_hidden_layers=2, head_dim=128),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, num_hidden_layers=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=768, norm_topk_prob=True),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(
        **SMALL, num_hidden_layers=6, head_dim=256, query_pre_attn_scalar=256, sliding_window=arch_checks.WINDOW),
    "mistral": lambda: transformers.MistralConfig(**SMALL, num_hidden_layers=2, head_dim=32, sliding_window=None),
}


@pytest.fixture(scope="module")
def readable_files(tmp_path_factory):
    """model_type -> (the transformers model, its GGUF file). Mistral's general.name says Mistral."""
    root = tmp_path_factory.mktemp("gguf")
    return {arch: (model := random_model(make()),
                   gguf_files.write_gguf(model, arch, root / f"{arch}.gguf", name=f"{arch}-tiny"))
            for arch, make in READABLE.items()}


def transformers_gguf(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def engine_greedy(model, tokenizer, prompt: list[int]) -> list[int]:
    engine = Engine(model, tokenizer, num_blocks=64, block_size_tokens=4)
    params = SamplingParams(temperature=0.0, max_new_tokens=NUM_TOKENS, ignore_eos=True)
    return engine.generate([prompt], params)[0].outputs[0].token_ids


@pytest.mark.parametrize("arch", list(READABLE))
def test_gguf_equals_transformers_gguf_reader(readable_files, arch):
    """Same logits as transformers on the same file, and the engine's greedy tokens are
    transformers' greedy decoding: its argmax after every prefix (one forward, not 24 steps)."""
    source, path = readable_files[arch]
    ours, tokenizer = load_model(path)
    theirs = transformers_gguf(path)
    assert type(ours) is model_class(arch)
    assert tokenizer.encode(arch_checks.PROMPT) == PROMPT_IDS and tokenizer.eos_token_ids[0] == 2
    greedy = engine_greedy(ours, tokenizer, PROMPT_IDS)
    ids = torch.tensor([PROMPT_IDS + greedy])
    with torch.no_grad():
        logits, reference = ours(ids), theirs(ids).logits
        torch.testing.assert_close(logits, reference, rtol=0, atol=2e-5)
        torch.testing.assert_close(logits, source(ids).logits, rtol=0, atol=2e-5)
    assert reference[0, len(PROMPT_IDS) - 1:-1].argmax(-1).tolist() == greedy


def _gemma3_local_global():
    """Gemma 3 with fields only GGUF keys carry: alternating local/global layers, local rope base
    1000, linear scaling on the global layers, a final logit soft cap (query scale: head_dim)."""
    kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(4)]
    rope = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1_000.0}}
    config = transformers.Gemma3TextConfig(
        **SMALL, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, layer_types=kinds,
        sliding_window=arch_checks.WINDOW, rope_parameters=rope, final_logit_softcapping=5.0)
    extra = {"gemma3.attention.sliding_window_pattern": [k == "sliding_attention" for k in kinds],
             "gemma3.rope.freq_base_swa": 1_000.0, "gemma3.final_logit_softcapping": 5.0}
    return random_model(config), extra


def _from_folder(arch, **kwargs):
    def make(tmp_path):
        folder = build_hf_folder(arch, tmp_path / arch, window=arch_checks.WINDOW, **kwargs)
        return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    return make


# case -> (model_type, builder(tmp_path) -> (model, extra keys)), what each adds over the reader above
RICHER = {
    "mistral_window": ("mistral", lambda tmp: (_from_folder("mistral")(tmp),
                                               {"llama.attention.sliding_window": arch_checks.WINDOW})),
    "qwen3_head_dim_16": ("qwen3", lambda tmp: (_from_folder("qwen3")(tmp), {})),
    "qwen3_moe_expert_width_32": ("qwen3_moe", lambda tmp: (_from_folder("qwen3_moe")(tmp), {})),
    "gemma3_local_global": ("gemma3_text", lambda tmp: _gemma3_local_global()),
}


@pytest.mark.parametrize("case", list(RICHER))
def test_gguf_keys_transformers_reader_drops_are_honoured(tmp_path, case):
    arch, build = RICHER[case]
    source, extra = build(tmp_path)
    path = gguf_files.write_gguf(source, arch, tmp_path / f"{case}.gguf", extra=extra)
    ours, _ = load_model(path)
    assert type(ours) is model_class(arch)
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), source(ids).logits, rtol=0, atol=2e-5)
    if arch == "mistral":
        assert ours.config.sliding_window == arch_checks.WINDOW
    if arch == "qwen3_moe":
        assert ours.config.moe_intermediate_size == 32 and ours.config.moe_layers == (0, 1, 2, 3)


@pytest.mark.parametrize("arch,qtype", [("qwen3_moe", GGMLQuantizationType.Q8_0),
                                        ("gemma3_text", GGMLQuantizationType.Q4_0)])
def test_quantized_gguf_dequantizes_as_transformers(readable_files, tmp_path, arch, qtype):
    source, _ = readable_files[arch]
    path = gguf_files.write_gguf(source, arch, tmp_path / f"{arch}.{qtype.name}.gguf", qtype=qtype)
    ours, _ = load_model(path)
    ids = torch.tensor([PROMPT_IDS])
    with torch.no_grad():
        logits = ours(ids)
        torch.testing.assert_close(logits, transformers_gguf(path)(ids).logits, rtol=0, atol=2e-5)
        assert (logits - source(ids).logits).abs().max() > 1e-4      # really quantized


@pytest.fixture(scope="module")
def qwen3_model(readable_files):
    return readable_files["qwen3"][0]


@pytest.mark.parametrize("change,message", [
    (dict(architecture="phi3"), r"GGUF architecture 'phi3' is not supported; supported: llama, qwen2, qwen3, "
                                r"qwen3moe, gemma3 \(Mistral is stored as llama\)"),
    (dict(drop={"qwen3.block_count"}), r"GGUF metadata lacks the key qwen3.block_count"),
    (dict(extra={"qwen3.rope.scaling.type": "yarn"}),
     r"GGUF key qwen3.rope.scaling.type = 'yarn' is not supported; supported: none, linear"),
    (dict(extra={"qwen3.attention.head_count_kv": [1, 1]}), r"qwen3.attention.head_count_kv holds one value per layer"),
    (dict(extra_tensors={"blk.0.attn_sinks.weight": torch.zeros(2).numpy()}),
     r"tensor 'blk.0.attn_sinks.weight' has no place in a postrain qwen3 model"),
    (dict(extra={"tokenizer.ggml.model": "bert"}),
     r"GGUF tokenizer model 'bert' \(tokenizer.ggml.model\) is not supported; supported: 'gpt2' .* and 'llama'"),
], ids=["architecture", "missing_key", "rope_type", "per_layer_key", "unknown_tensor", "tokenizer_model"])
def test_bad_gguf_files_are_refused_by_name(qwen3_model, tmp_path, change, message):
    path = gguf_files.write_gguf(qwen3_model, "qwen3", tmp_path / "bad.gguf", **change)
    with pytest.raises(CheckpointError, match=message):
        load_model(path)


def test_moe_files_without_expert_width_or_as_llama_are_refused(readable_files, tmp_path):
    source, _ = readable_files["qwen3_moe"]
    path = gguf_files.write_gguf(source, "qwen3_moe", tmp_path / "moe.gguf",
                                 drop={"qwen3moe.expert_feed_forward_length"})
    with pytest.raises(CheckpointError, match="lacks the key qwen3moe.expert_feed_forward_length"):
        load_model(path)
    mistral, _ = readable_files["mistral"]
    path = gguf_files.write_gguf(mistral, "mistral", tmp_path / "mixtral.gguf", extra={"llama.expert_count": 8})
    with pytest.raises(CheckpointError, match=r"a llama GGUF with experts \(llama.expert_count; Mixtral\) "
                                              "is not supported"):
        load_model(path)


def test_gguf_names_still_import_from_loading(readable_files):
    from postrain.actors.models import gguf
    from postrain.actors.models.gguf import GGUFFile, gguf_tokenizer
    from postrain.actors.models.loading import GGUF_ARCHITECTURES, load_gguf

    assert GGUF_ARCHITECTURES is gguf.GGUF_ARCHITECTURES and GGUF_ARCHITECTURES["qwen3moe"] == "qwen3_moe"
    path = readable_files["qwen3"][1]
    assert gguf_tokenizer(GGUFFile(path), path).encode("hi") == byte_tokenizer().encode("hi")
    model, _ = load_gguf(path)
    assert model.config.architecture == "qwen3" and model.config.head_dim == 128


# ----------------------------------------------------------------------------- SentencePiece tokenizers

SP_STRINGS = ["hello world", "  the  capital\nof France?", "café über 日本 ünïcödé", "12345 2026 3.14",
              "[INST] hi [/INST]", "<start_of_turn>user\nhi<end_of_turn>\n", " leading", "a\n\n b\t c  ",
              "", " ", "The answer is 42.", "def f(x):\n    return x+1"]
SP_CHAT = [{"role": "user", "content": "What is the capital of France?"},
           {"role": "assistant", "content": "Paris"}, {"role": "user", "content": "and 12+345?"}]


@pytest.fixture(scope="module")
def sentencepiece_files(tmp_path_factory):
    """style -> a tiny model's GGUF file with a SentencePiece vocabulary: Mistral-shaped (stored as
    llama) and Gemma 3-shaped, one folder each (transformers reads the tokenizer from the folder)."""
    files = {}
    for style, arch in (("mistral", "mistral"), ("gemma3", "gemma3_text")):
        meta = gguf_files.sentencepiece_metadata(style)
        shape = dict(SMALL, vocab_size=len(meta["tokenizer.ggml.tokens"]), num_hidden_layers=2, head_dim=32,
                     bos_token_id=meta["tokenizer.ggml.bos_token_id"],
                     eos_token_id=meta["tokenizer.ggml.eos_token_id"], pad_token_id=0)
        config = (transformers.MistralConfig(**shape) if style == "mistral" else
                  transformers.Gemma3TextConfig(**shape, query_pre_attn_scalar=32, sliding_window=8))
        folder = tmp_path_factory.mktemp(style)
        files[style] = gguf_files.write_gguf(random_model(config), arch, folder / f"{style}.gguf",
                                             name=f"{style}-tiny", extra=meta,
                                             drop={"tokenizer.ggml.padding_token_id"} if style == "mistral" else set())
    return files


@pytest.mark.parametrize("style", ["mistral", "gemma3"])
def test_a_gguf_specs_tokenizer_is_read_from_its_metadata_without_the_weights(sentencepiece_files, style):
    """The env actor takes a model's tokenizer from its spec (models/spec.py): for a .gguf file,
    the tokenizer.ggml.* metadata alone, the same tokenizer load_model gives."""
    path = sentencepiece_files[style]
    read, (_, loaded) = spec_tokenizer(str(path)), load_model(path)
    assert [read.encode(text) for text in SP_STRINGS] == [loaded.encode(text) for text in SP_STRINGS]
    assert read.eos_token_ids == loaded.eos_token_ids
    assert read.apply_chat_template(SP_CHAT, add_generation_prompt=True) == \
        loaded.apply_chat_template(SP_CHAT, add_generation_prompt=True)


@pytest.mark.parametrize("style", ["mistral", "gemma3"])
def test_sentencepiece_gguf_tokenizer_equals_transformers(sentencepiece_files, style):
    from postrain.actors.models.gguf import GGUFFile, gguf_tokenizer

    path = sentencepiece_files[style]
    ours = gguf_tokenizer(GGUFFile(path), path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in SP_STRINGS:
        ids = theirs.encode(text)                                   # BOS first: add_bos_token
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == theirs.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    rendered = theirs.apply_chat_template(SP_CHAT, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert ours.encode(ours.apply_chat_template(SP_CHAT)) == rendered     # the template's BOS, not two
    assert ours.vocab_size == len(theirs)
    assert ours.eos_token_ids == ([2] if style == "mistral" else [1, 6])   # Gemma: <end_of_turn> (eot) too


def test_sentencepiece_add_space_prefix_false_is_honoured():
    """llama.cpp puts no "▁" before the text when the file says add_space_prefix = false
    (transformers' reader ignores the flag, so the expectation is written out)."""
    from postrain.actors.models.tokenizer import Tokenizer

    meta = {k.rsplit(".", 1)[-1]: v for k, v in gguf_files.sentencepiece_metadata("mistral").items()}
    kwargs = dict(tokens=meta["tokens"], merges=[], model="llama", bos_token_id=1, eos_token_id=2,
                  pad_token_id=None, chat_template=None, add_bos_token=None, token_types=meta["token_type"],
                  scores=meta["scores"])
    with_prefix = Tokenizer.from_gguf_metadata(**kwargs)
    without = Tokenizer.from_gguf_metadata(**kwargs, add_space_prefix=False)
    pieces = lambda tok, text: [tok.hf.id_to_token(i) for i in tok.encode(text)]   # noqa: E731
    assert pieces(with_prefix, "hello world") == ["<s>", "\u2581hello", "\u2581world"]
    assert pieces(without, "hello world") == ["<s>", "he", "ll", "o", "\u2581world"]
    for text in SP_STRINGS:
        assert without.decode(without.encode(text, add_bos=False)) == text


@pytest.mark.parametrize("style", ["mistral", "gemma3"])
def test_postrain_generate_runs_on_sentencepiece_gguf(sentencepiece_files, style, capsys):
    import argparse
    import json

    from postrain.cli import generate as generate_cli

    path = sentencepiece_files[style]
    parser = argparse.ArgumentParser()
    generate_cli.add_arguments(parser)
    args = parser.parse_args(["--model", str(path), "--chat", "--prompt", "What is the capital of France?",
                              "--temperature", "0", "--max-tokens", "8", "--json"])
    assert generate_cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert out["prompt_token_ids"] == theirs.apply_chat_template(chat, tokenize=True,
                                                                  add_generation_prompt=True)["input_ids"]
    sample = out["samples"][0]
    assert 1 <= len(sample["token_ids"]) <= 8 and sample["text"] == theirs.decode(sample["token_ids"])


def test_a_corrupt_or_hostile_gguf_file_is_refused_in_one_error(tmp_path):
    """A GGUF file is untrusted input (docs/security.md, "Model files"): truncated at any byte,
    with bytes flipped or lengths set huge, it parses or is refused with a CheckpointError
    naming the file; never another exception, never an allocation the file does not back."""
    import random

    import numpy as np
    from gguf import GGUFWriter

    from postrain.actors.models.gguf import GGUFFile

    writer = GGUFWriter(str(tmp_path / "good.gguf"), "llama")
    writer.add_string("general.name", "fuzz")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "cd"])
    writer.add_array("llama.counts", [1, 2, 3])
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    good = (tmp_path / "good.gguf").read_bytes()
    assert GGUFFile(tmp_path / "good.gguf").fields["tokenizer.ggml.tokens"] == ["a", "b", "cd"]
    rng = random.Random(0)
    variants = [good[:cut] for cut in range(0, len(good), 7)]
    for _ in range(300):
        data = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(4, len(data) - 8)
            if rng.random() < 0.5:
                data[at] = rng.randrange(256)
            else:                                   # a length or count set huge
                data[at:at + 8] = rng.choice([2**63 - 1, 2**40, 2**32 + 1]).to_bytes(8, "little")
        variants.append(bytes(data))
    path = tmp_path / "bad.gguf"
    for data in variants:
        path.write_bytes(data)
        try:
            GGUFFile(path)
        except CheckpointError as exc:
            assert str(path) in str(exc)
