"""Checks every architecture of the registry passes, against transformers' own implementation
of it (tests/actors/models/test_mistral.py, test_gemma3.py): a tiny random model built by
transformers (postrain.bench.architectures), a prompt longer than its sliding window.

Each check takes the model's folder and returns nothing; an assertion names what differs.
"""
from __future__ import annotations

import json

import torch

from postrain.actors.generator.engine import Engine
from postrain.actors.generator.sampling import SamplingParams

WINDOW = 8                                            # tokens; every prompt below is longer
PROMPT = "The sliding window forgets this opening; "  # 41 byte tokens
GREEDY = dict(temperature=0.0, ignore_eos=True)


def reference_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Step-by-step full-sequence forward, no cache: the definition of greedy decoding."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt_ids):]


def check_cli_greedy_equals_transformers(folder, capsys, num_tokens: int = 24) -> None:
    """`postrain generate --temperature 0 --json` gives transformers' greedy `generate` tokens."""
    import transformers

    from postrain.cli import main

    assert main(["generate", "--model", str(folder), "--prompt", PROMPT, "--temperature", "0",
                 "--max-tokens", str(num_tokens), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    ours = report["samples"][0]["token_ids"]
    prompt = torch.tensor([report["prompt_token_ids"]])
    assert prompt.shape[1] > WINDOW
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    theirs = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=num_tokens,
                         do_sample=False)[0, prompt.shape[1]:].tolist()
    assert len(ours) == num_tokens, f"stopped early ({len(ours)} tokens): pick another PROMPT"
    assert ours == theirs


def check_engine_logprobs_equal_learner(folder) -> None:
    """Sampled tokens' engine logprobs equal the learner's, by the plain and the shared-prefix pass
    (n samples share the prompt), within 1e-4."""
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from postrain.actors.records import TrainBatch

    learner = Learner(LearnerConfig(model=str(folder), temperature=0.8, micro_batch_size=4))
    engine = Engine(learner.model.__class__.empty(learner.model.config).eval(), learner.tokenizer,
                    num_blocks=64, block_size_tokens=4)
    engine.model.load_state_dict(learner.model.state_dict())
    prompt = learner.tokenizer.encode(PROMPT)
    out = engine.generate([prompt], SamplingParams(n=3, temperature=0.8, seed=5, max_new_tokens=16,
                                                   ignore_eos=True))[0]
    batch = TrainBatch(
        token_ids=[prompt + s.token_ids for s in out.outputs],
        loss_mask=[[0] * len(prompt) + [1] * len(s.token_ids) for s in out.outputs],
        behavior_logprobs=[[0.0] * len(prompt) + s.logprobs for s in out.outputs],
        policy_versions=[[0] * (len(prompt) + len(s.token_ids)) for s in out.outputs],
        rewards=[1.0, 0.0, 0.5], group_ids=[0, 0, 0])
    for shared in (True, False):
        learner.config.shared_prefix = shared
        for mine, theirs, mask in zip(learner.compute_logprobs(batch), batch.behavior_logprobs, batch.loss_mask):
            m = torch.tensor(mask, dtype=torch.bool)
            gap = float((mine[m] - torch.tensor(theirs)[m]).abs().max())
            assert gap < 1e-4, f"engine-learner logprob gap {gap:.2e} (shared_prefix={shared})"


def check_engine_paths_keep_greedy(folder, other_folder) -> None:
    """Prefix caching, preemption under block pressure and a weight swap: the engine's greedy
    tokens stay those of a full forward without cache."""
    from postrain.actors.models.loading import load_model

    model, tokenizer = load_model(folder)
    prompt = tokenizer.encode(PROMPT)[:18]            # 4 full blocks of 4 + 2, past the window
    want = reference_greedy(model, prompt, 10)
    engine = Engine(model, tokenizer, num_blocks=64, block_size_tokens=4)
    first, second = (engine.generate([prompt], SamplingParams(max_new_tokens=10, **GREEDY))[0] for _ in range(2))
    assert second.num_cached_prompt_tokens == 16
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == want

    tight = Engine(model, tokenizer, num_blocks=20, block_size_tokens=4)
    prompts = [[10 + i] + prompt[1:12] for i in range(4)]     # 4 x 6 blocks wanted, 20 held
    outs = tight.generate(prompts, SamplingParams(max_new_tokens=10, **GREEDY))
    assert tight.counters.num_preemptions > 0
    for p, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == reference_greedy(model, p, 10)

    other, _ = load_model(other_folder)
    engine.load_weights(other.state_dict(), version=1)   # the prefix cache must not serve old KV
    swapped = engine.generate([prompt], SamplingParams(max_new_tokens=10, **GREEDY))[0]
    assert swapped.num_cached_prompt_tokens == 0
    assert swapped.outputs[0].token_ids == reference_greedy(other, prompt, 10)


def check_export_round_trip(folder, tmp_path) -> None:
    """save_checkpoint's folder loads in transformers with the same logits (float32 rounding),
    and back in postrain as the same architecture."""
    import transformers

    from postrain.actors.models.loading import load_model, save_checkpoint

    model, tokenizer = load_model(folder)
    with torch.no_grad():                             # a trained policy: weights moved off the source's
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 0.01)
    out = save_checkpoint(model, tokenizer, tmp_path / "export", policy_version=7)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    again, _ = load_model(out)
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.no_grad():
        ours = model(ids)
        torch.testing.assert_close(hf(ids).logits, ours, rtol=0, atol=2e-5)
        torch.testing.assert_close(again(ids), ours, rtol=0, atol=0)
    assert type(again) is type(model) and again.config == model.config
