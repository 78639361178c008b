"""`postrain bench vision`: images through the generator, against transformers per family.

- vision_encodes_per_group: vision-tower runs for one group of 8 samples on one chart (`tiny-vl`);
  1 is the claim (the engine encodes each image once, generator/images.py).
- tiny_vl_tok_per_s_images / tiny_vl_tok_per_s_text: `tiny-vl` sampling 8 groups of 8 on 8 charts
  (64 new tokens, temperature 1), with the images and with the same ids as plain tokens: what the
  images cost.
- tok_per_s_<family>_b8_ratio, for idefics3, smolvlm, qwen2_5_vl and gemma3: greedy tokens per
  second of a batch of 8 prompts with one chart each (32 new tokens), postrain's engine over
  transformers' `generate` on the same random folder (bench/vision_folders.py: a decoder of the
  generate bench's shape, the family's test tower) and the same prompt ids (checked), prefill and
  image encoding included (and transformers' processor); the median of `repeats` interleaved runs
  after a warm-up of each.

Run alone: `python -m postrain.bench.vision [--quick]` (quick: 1 repeat).
"""
from __future__ import annotations

import argparse
import base64
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams
from postrain.actors.models.loading import load_model
from postrain.actors.models.images import load_image, render_prompt
from postrain.actors.tasks.charts import Chart, chart_message, eval_tasks, render_png

from .vision_folders import FAMILIES, build_folder, run_requests

BENCH_TEXT = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5)
NEW_TOKENS = 32


def run_engine(engine: Engine, requests: list[tuple[list[int], list, SamplingParams]]) -> tuple[int, float]:
    """(sampled tokens, seconds) of the requests run to the end."""
    start = time.perf_counter()
    outputs = run_requests(engine, requests)
    return sum(len(s.token_ids) for out in outputs for s in out.outputs), time.perf_counter() - start


def tiny_vl(repeats: int) -> dict[str, float]:
    """The encodes of one group, and tokens/s with and without the images (medians, interleaved)."""
    model, tokenizer = load_model("tiny-vl")
    assert model.vision is not None, "tiny-vl is a vision-language model"
    tasks = eval_tasks({"num_eval": 8})
    prompts = [render_prompt(tokenizer, model.vision.layout, [chart_message(task, "image")]) for task in tasks]
    group = SamplingParams(n=8, temperature=1.0, max_new_tokens=64, ignore_eos=True, seed=0)
    one = Engine(model, tokenizer)
    run_engine(one, [(prompts[0][0], prompts[0][1], group)])          # also the warm-up
    rates: dict[str, list[float]] = {"images": [], "text": []}
    for _ in range(repeats):
        for kind in rates:
            tokens, seconds = run_engine(Engine(model, tokenizer), [(ids, images if kind == "images" else [], group)
                                                                    for ids, images in prompts])
            rates[kind].append(tokens / seconds)
    return {"vision_encodes_per_group": one.stats()["num_image_encodes"],
            "tiny_vl_tok_per_s_images": statistics.median(rates["images"]),
            "tiny_vl_tok_per_s_text": statistics.median(rates["text"])}


def question(i: int) -> str:
    return f"What does chart {i} show?"


def nested(images: list) -> list:
    return [[image] for image in images]                   # one list of images per prompt


def flat(images: list) -> list:
    return images                                          # the batch's images in one list, in prompt order


# how each family's processor takes a batch's images (Qwen2.5-VL's: one flat list)
HF_IMAGES: dict[str, Callable[[list], list]] = {"idefics3": nested, "smolvlm": nested, "qwen2_5_vl": flat,
                                                "gemma3": nested}


def hf_inputs(name: str, processor, charts: list[bytes]):
    """transformers' inputs of the prompts (an image, then the question), left-padded for `generate`."""
    texts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                         {"type": "text", "text": question(i)}]}],
                                           add_generation_prompt=True) for i in range(len(charts))]
    return processor(text=texts, images=HF_IMAGES[name]([load_image(png) for png in charts]), return_tensors="pt",
                     padding=True)


def family(name: str, folder: Path, charts: list[bytes], repeats: int) -> tuple[float, float]:
    """(ours, transformers') greedy tokens/s of 8 prompts with one chart each; the same prompt ids."""
    folder, hf, processor = build_folder(folder, name, seed=1, text_shape=BENCH_TEXT)
    model, tokenizer = load_model(folder)
    assert model.vision is not None, f"a {name} folder is a vision-language model"
    messages = [[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                                      + _b64(png)}},
                                              {"type": "text", "text": question(i)}]}]
                for i, png in enumerate(charts)]
    prompts = [render_prompt(tokenizer, model.vision.layout, m) for m in messages]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    processor.tokenizer.padding_side = "left"              # a batch of prompts for `generate`
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    inputs = hf_inputs(name, processor, charts)
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(inputs["input_ids"], inputs["attention_mask"])]
    assert rows == [ids for ids, _ in prompts], f"{name}: transformers' prompt ids differ from ours"

    def theirs_generate(charts: list[bytes]) -> float:
        start = time.perf_counter()
        inputs = hf_inputs(name, processor, charts)
        with torch.no_grad():
            out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        return (out.shape[1] - inputs["input_ids"].shape[1]) * len(charts) / (time.perf_counter() - start)

    ours, theirs = [], []
    run_engine(Engine(model, tokenizer), prompts_of(prompts[:1], greedy))          # warm-ups
    theirs_generate(charts[:1])
    for _ in range(repeats):
        tokens, seconds = run_engine(Engine(model, tokenizer), prompts_of(prompts, greedy))
        ours.append(tokens / seconds)
        theirs.append(theirs_generate(charts))
    return statistics.median(ours), statistics.median(theirs)


def prompts_of(prompts: list[tuple[list[int], list]], params: SamplingParams) -> list:
    return [(ids, images, params) for ids, images in prompts]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def run(quick: bool = False) -> dict:
    repeats = 1 if quick else 3
    charts = [render_png(Chart.from_dict(task["chart"])) for task in eval_tasks({"num_eval": 8})]
    results: dict[str, float] = {k: round(v, 1) for k, v in tiny_vl(repeats).items()}
    peer: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in FAMILIES:
            ours, theirs = family(name, Path(tmp) / name, charts, repeats)
            results[f"tok_per_s_{name}_b8"] = round(ours, 1)
            peer[f"tok_per_s_{name}_b8"] = round(theirs, 1)
            results[f"tok_per_s_{name}_b8_ratio"] = round(ours / theirs, 3)
    return {"config": {"families": list(FAMILIES), "batch": 8, "new_tokens": NEW_TOKENS, "repeats": repeats,
                       "threads": torch.get_num_threads(), "chart_px": list(load_image(charts[0]).size)},
            "results": results, "peer": peer}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    print(json.dumps(run(quick=parser.parse_args().quick), indent=1))
