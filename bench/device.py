"""Benchmark `device`: the one prepared check of the GPU path, run when a CUDA GPU is at hand.

    postrain bench device --json          # on the GPU machine, in the repository root
    bash bench/device_check.sh run        # the same where packages must travel as wheels

On a machine without a usable CUDA GPU it says so in one line and exits 0 (nothing to check).
On a GPU machine it runs four bounded steps, the whole check within 8 minutes:

1. the GPU-marked tests (`pytest -m gpu`): the CuPy kernels against the torch references,
   forward and backward; a learner step on CUDA equal to the CPU step; the engine on CUDA
   greedy-identical to the CPU engine on the tiny model and SmolLM2 (`gpu_tests_*`);
2. the learner on CUDA: real tokens/s of a train step and its peak GPU memory, with the CuPy
   kernels (`backend = "cupy"`) against the torch references (`"torch"`, the peer), float32
   and bfloat16 autocast (`learner_*`);
3. the engine on CUDA against `transformers` `generate()` on the same GPU (the peer), sampled
   tokens/s at batch 1 and 32 and for one prompt's 16-sample group (`engine_tok_per_s_*`);
4. a short default run with the learner (and, with two GPUs, the generator) on the GPU: its
   wall time and held-out accuracy (`default_run_*`).

Each step's failure becomes an `error_<step>` entry and the others still run. The figures are
also written to one JSON file (`--out`-less: `device_check.json` in the working directory, or
`$POSTRAIN_DEVICE_CHECK_OUT`), which is what the performance page's GPU section is filled from.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import torch

from postrain.bench import postrain_command

TESTS_TIMEOUT_S = 180
RUN_TIMEOUT_S = 150


def no_gpu_reason() -> str | None:
    """None where a CUDA GPU is usable here, else the one line that says why not."""
    if torch.version.cuda is None:
        return "no GPU check: torch here is a CPU build (torch.version.cuda is None); nothing to check"
    if not torch.cuda.is_available():
        return "no GPU check: torch sees no CUDA GPU here (torch.cuda.is_available() is False); nothing to check"
    return None


def run(quick: bool) -> dict:
    reason = no_gpu_reason()
    if reason is not None:
        return {"skipped": reason, "config": {}, "results": {}}
    from postrain.actors.models.loading import packaged_model_path

    model = packaged_model_path("smollm2") or "small"
    config = {"gpu": torch.cuda.get_device_name(0), "num_gpus": torch.cuda.device_count(),
              "torch": torch.__version__, "cuda": torch.version.cuda, "host": platform.node(),
              "date": time.strftime("%Y-%m-%d"), "model": Path(model).name, "quick": quick}
    results: dict = {}
    peer: dict = {}
    steps = (("gpu_tests", lambda: _gpu_tests(results)),
             ("learner", lambda: _learner(model, quick, results, peer)),
             ("engine", lambda: _engine(model, quick, results, peer)),
             ("default_run", lambda: _default_run(quick, results)))
    for name, step in steps:
        start = time.perf_counter()
        try:
            step()
        except Exception as exc:                        # one step's failure is a figure, not the end
            traceback.print_exc(file=sys.stderr)
            results[f"error_{name}"] = f"{type(exc).__name__}: {exc}"[:500]
        results[f"{name}_s"] = round(time.perf_counter() - start, 1)
        print(f"device: {name} done in {results[f'{name}_s']} s", file=sys.stderr, flush=True)
    report = {"config": config, "results": results, "peer": peer}
    out = Path(os.environ.get("POSTRAIN_DEVICE_CHECK_OUT", "device_check.json"))
    out.write_text(json.dumps(report, indent=1, sort_keys=True))
    print(f"device: figures written to {out}", file=sys.stderr, flush=True)
    return report


# ----------------------------------------------------------------------------- 1. tests

def _gpu_tests(results: dict) -> None:
    tests = Path.cwd() / "tests"
    if not tests.is_dir():
        raise FileNotFoundError(f"no tests/ in {Path.cwd()}: run the device check from the repository root")
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "junit.xml"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", f"--junitxml={report}",
                               str(tests)], capture_output=True, text=True,
                              timeout=TESTS_TIMEOUT_S)
        print(proc.stdout[-4000:], file=sys.stderr, flush=True)
        root = ElementTree.parse(report).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        assert suite is not None, report  # pytest's junit report holds one <testsuite>
        total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        skipped = int(suite.get("skipped", 0))
        results.update(gpu_tests_passed=total - failed - skipped, gpu_tests_failed=failed,
                       gpu_tests_skipped=skipped)
        failures = [case.get("name") for case in suite.iter("testcase")
                    if case.find("failure") is not None or case.find("error") is not None]
        if failures:
            results["gpu_tests_failures"] = failures[:20]


# ----------------------------------------------------------------------------- 2. learner

def _learner(model: str, quick: bool, results: dict, peer: dict) -> None:
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from postrain.bench.learner import rollout_batch

    num, length = (8, 128) if quick else (32, 512)
    repeats = 2 if quick else 4
    for precision in ("float32", "bfloat16"):
        figures = {}
        for backend in ("cupy", "torch"):
            torch.cuda.empty_cache()
            learner = Learner(LearnerConfig(model=model, device="cuda", autocast_dtype=(
                None if precision == "float32" else precision), rl_ops_backend=backend, lr=1e-6,
                micro_batch_size=8))
            batch = rollout_batch(num, length, learner.model.config.vocab_size)
            learner.train_step(batch)                                # warm-up: kernels compiled
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            rates = []
            for _ in range(repeats):
                rates.append(learner.train_step(batch)["tokens_per_s"])
            torch.cuda.synchronize()
            figures[backend] = (statistics.median(rates), torch.cuda.max_memory_allocated() / 2**20)
            del learner
        key = f"learner_{precision}"
        results[f"{key}_tokens_per_s"], results[f"{key}_peak_mem_mb"] = figures["cupy"]
        peer[f"{key}_tokens_per_s"], peer[f"{key}_peak_mem_mb"] = figures["torch"]


# ----------------------------------------------------------------------------- 3. engine

def _engine(model_spec: str, quick: bool, results: dict, peer: dict) -> None:
    import transformers

    from postrain.actors.models.loading import load_model, save_checkpoint
    from postrain.actors.generator.engine import Engine
    from postrain.actors.generator.sampling import SamplingParams

    model, tokenizer = load_model(model_spec, device="cuda")
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(model.cpu(), tokenizer, folder)
        # transformers wraps .cuda() with functools.wraps, whose stub type is no method: self reads as missing
        hf = transformers.AutoModelForCausalLM.from_pretrained(  # type: ignore[call-arg]
            folder, dtype=torch.float32).cuda().eval()
    model.cuda()
    new_tokens = 32 if quick else 128
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Count from one to fifty in words."}])
    prompt = tokenizer.encode(text)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for label, prompts, n in (("b1", [prompt], 1), ("b32", [prompt] * 32, 1), ("group16", [prompt], 16)):
        ours, theirs = [], []
        for _ in range(2 if quick else 3):
            engine = Engine(model, tokenizer, max_num_seqs=64, kv_cache_mb=2048)
            params = SamplingParams(n=n, temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, seed=0)
            ours.append(_engine_rate(engine, prompts, params))
            theirs.append(_hf_rate(hf, prompts, new_tokens, pad_id, n))
        results[f"engine_tok_per_s_{label}"] = statistics.median(ours)
        peer[f"engine_tok_per_s_{label}"] = statistics.median(theirs)


def _engine_rate(engine, prompts, params) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for prompt in prompts:
        engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    torch.cuda.synchronize()
    return sum(len(o.token_ids) for out in outputs for o in out.outputs) / (time.perf_counter() - start)


def _hf_rate(hf, prompts, new_tokens: int, pad_id: int, n: int) -> float:
    ids = torch.tensor(prompts, device="cuda")                      # equal lengths: no padding
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                          top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad_id,
                          num_return_sequences=n)
    torch.cuda.synchronize()
    return (out.shape[1] - ids.shape[1]) * out.shape[0] / (time.perf_counter() - start)


# ----------------------------------------------------------------------------- 4. a default run

def gpu_run_config(num_gpus: int, quick: bool) -> dict:
    """The built-in run's config with the learner on GPU 0 (and the generator on GPU 1 where
    there are two), shortened to a check: fewer warm-start and RL steps."""
    from postrain.actors.configs.run_config import default_config_path

    config = tomllib.loads(Path(default_config_path()).read_text())
    for actor in config["actors"]:
        if actor["name"] == "learner" or (actor["name"] == "generator" and num_gpus >= 2):
            actor["gpus"] = 1                   # device = "auto" (the default) then finds it
        if actor["name"] == config["run"]["driver"]:
            actor["options"].update(sft_steps=40 if quick else 150, num_steps=3 if quick else 10,
                                    num_eval_tasks=20 if quick else 100)
    return config


def _default_run(quick: bool, results: dict) -> None:
    from postrain.core.testing import to_toml

    with tempfile.TemporaryDirectory() as folder:
        config = gpu_run_config(torch.cuda.device_count(), quick)
        config["run"]["run_dir"] = folder
        path = Path(folder) / "gpu_run.toml"
        path.write_text(to_toml(config))
        start = time.perf_counter()
        proc = subprocess.run(postrain_command("up", "--config", str(path)),
                              capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        results["default_run_wall_s"] = round(time.perf_counter() - start, 1)
        if proc.returncode != 0:
            raise RuntimeError(f"postrain up exited {proc.returncode}: {proc.stderr[-1500:]}")
        summaries = sorted(Path(folder).glob("*/summary.json"))
        if summaries:
            summary = json.loads(summaries[-1].read_text())
            for key in ("eval_after_sft", "eval_after", "rl_wall_s", "samples"):
                results[f"default_run_{key}"] = summary.get(key)
