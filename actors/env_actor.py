"""The environment actor: runs episodes token by token, so nothing is re-tokenized for training.

    [[actors]]
    name = "env"
    cls = "postrain.actors.env_actor:EnvironmentActor"
    options = { task = "arithmetic", model = "tiny", generator = "generator", sandbox = "sandbox" }

`rollout` {"task": {...}, "sample_id": str, "sampling": {...}} -> a rollout:
    {"sample_id", "token_ids", "loss_mask", "behavior_logprobs", "policy_versions",
     "reward": {"components", "weights"}, "num_turns", "num_policy_tokens", "tool_statuses",
     "timeline"}
where `timeline` lists the episode's hops: each generate call and each tool call
with its start, duration and outcome (actors/timeline.py; `postrain trace`).

Design note (tokens in, tokens out). The rollout is one growing list of token
ids: the rendered prompt, then for each turn exactly the ids the generator
sampled (loss_mask 1, with their logprobs and policy versions), then the
observation's tokens (loss_mask 0). The action text the environment sees is
the decode of the sampled ids; the sampled ids themselves are never re-encoded.
An observation's tokens are the chat template's text between the end of the
assistant's content and the next generation prompt, encoded alone.

Failures: an environment that raises, hangs past `step_timeout_s` or returns
garbage fails the request with `EnvironmentFailure` (its `reason` goes to the
ledger); the actor keeps serving.
"""
from __future__ import annotations

from pathlib import Path

from postrain.core import Actor, handler

from .environment import EnvironmentFailure, checked_reset, checked_step, checked_truncated
from .tasks import get_task
from .timeline import Timeline, tool_status
from .tokenizer import Tokenizer, byte_tokenizer


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a model spec without loading its weights where that is possible."""
    from .checkpoint import resolve_model
    path = Path(resolve_model(model))
    if path.is_dir() and (path / "tokenizer.json").exists():
        return Tokenizer.from_file(path / "tokenizer.json", path / "tokenizer_config.json")
    if not path.exists():
        return byte_tokenizer()  # a built-in config
    from .checkpoint import load_model
    return load_model(path)[1]


class RemoteSandbox:
    """A `SandboxHandle` that calls the sandbox actor; with a `timeline`, each call is a hop in it."""

    def __init__(self, ref, timeline: Timeline | None = None):
        self.ref = ref
        self.timeline = timeline

    def for_episode(self, timeline: Timeline) -> "RemoteSandbox":
        return RemoteSandbox(self.ref, timeline)

    async def exec(self, code, *, stdin=None, files=None, timeout_s=None):
        body = {"code": code, "stdin": stdin, "files": files}
        if timeout_s is not None:
            body["limits"] = {"wall_time_s": float(timeout_s)}
        return await self._ask("exec", body, timeout_s=(timeout_s or 30) + 30)

    async def run_tests(self, solution, tests, *, test_timeout_s=2.0, timeout_s=None):
        body = {"solution": solution, "tests": tests, "test_timeout_s": test_timeout_s}
        if timeout_s is not None:
            body["limits"] = {"wall_time_s": float(timeout_s)}
        return await self._ask("run_tests", body, timeout_s=(timeout_s or 60) + 30)

    async def _ask(self, call: str, body: dict, timeout_s: float):
        if self.timeline is None:
            return await self.ref.ask(call, body, timeout_s=timeout_s)
        with self.timeline.hop("tool", self.ref.name, call=call) as hop:
            reply = await self.ref.ask(call, body, timeout_s=timeout_s)
            hop.update(tool_status(call, reply))
        return reply


def observation_ids(tokenizer: Tokenizer, conversation: list[dict], ended_with_eos: bool) -> list[int]:
    """Token ids that close the last assistant turn, add the observation turn (the last
    message of `conversation`) and open the next assistant turn."""
    before_assistant = tokenizer.apply_chat_template(conversation[:-2], add_generation_prompt=True)
    with_assistant = tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=False)
    with_observation = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    content = conversation[-2]["content"]
    if not (with_assistant.startswith(before_assistant + content) and with_observation.startswith(with_assistant)):
        raise EnvironmentFailure("the chat template re-renders earlier turns differently; multi-turn "
                                 "token rollouts need a prefix-stable template")
    turn_end = with_assistant[len(before_assistant) + len(content):]
    if ended_with_eos and tokenizer.eos_token_ids:
        for eos in tokenizer.eos_token_ids:  # the sampled eos already closed the turn
            eos_text = tokenizer.decode([eos])
            if turn_end.startswith(eos_text):
                turn_end = turn_end[len(eos_text):]
                break
    return tokenizer.encode(turn_end + with_observation[len(with_assistant):], add_bos=False)


class EnvironmentActor(Actor):
    async def setup(self):
        self.task = get_task(self.options.get("task", "arithmetic"))
        self.tokenizer = load_tokenizer(self.options.get("model", "tiny"))
        self.step_timeout_s = float(self.options.get("step_timeout_s", 60))
        self.max_total_tokens = int(self.options.get("max_total_tokens", 1024))
        self.env_options = dict(self.options.get("env_options") or {})
        self.generator = await self.lookup(self.options.get("generator", "generator"))
        sandbox_name = self.options.get("sandbox", "sandbox")
        self.sandbox = RemoteSandbox(await self.lookup(sandbox_name)) if sandbox_name else None

    @handler("rollout", concurrent=True)
    async def rollout(self, body):
        timeline = Timeline()
        sandbox = self.sandbox.for_episode(timeline) if self.sandbox else None
        env = self.task.make_env(sandbox=sandbox, options=self.env_options)
        try:
            with timeline.hop("episode", self.name) as episode:
                rollout = await self._episode(env, body["task"], body.get("sampling") or {}, timeline)
                episode["num_turns"] = rollout["num_turns"]
            return {**rollout, "timeline": timeline.to_list()}
        finally:
            await env.close()

    async def _episode(self, env, task: dict, sampling: dict, timeline: Timeline) -> dict:
        tok = self.tokenizer
        conversation = await checked_reset(env, task, timeout_s=self.step_timeout_s)
        ids = tok.encode(tok.apply_chat_template(conversation, add_generation_prompt=True))
        mask, logprobs, versions = [0] * len(ids), [0.0] * len(ids), [-1] * len(ids)
        statuses, reward, num_turns = [], None, 0
        while num_turns < env.max_turns and len(ids) < self.max_total_tokens:
            budget = self.max_total_tokens - len(ids)
            params = {**sampling, "max_new_tokens": min(sampling.get("max_new_tokens", 128), budget), "n": 1}
            with timeline.hop("generate", self.generator.name) as hop:
                sample = (await self.generator.ask("generate", {"prompt_ids": ids, "sampling": params},
                                                   timeout_s=600))["samples"][0]
                hop.update(num_tokens=len(sample["token_ids"]),
                           policy_versions=sorted(set(sample["policy_versions"])))
            ids += sample["token_ids"]
            mask += [1] * len(sample["token_ids"])
            logprobs += sample["logprobs"]
            versions += sample["policy_versions"]
            action = tok.decode(sample["token_ids"], skip_special_tokens=True)
            conversation.append({"role": "assistant", "content": action})
            result = await checked_step(env, action, timeout_s=self.step_timeout_s)
            num_turns += 1
            if result.info and result.info.get("tool_status"):
                statuses.append(result.info["tool_status"])
            if result.done:
                reward = result.reward
                break
            conversation.append({"role": env.observation_role, "content": result.observation})
            ended_with_eos = bool(sample["token_ids"]) and sample["token_ids"][-1] in tok.eos_token_ids
            obs = observation_ids(tok, conversation, ended_with_eos)
            ids += obs
            mask += [0] * len(obs)
            logprobs += [0.0] * len(obs)
            versions += [-1] * len(obs)
        if reward is None:
            reward = await checked_truncated(env, timeout_s=self.step_timeout_s)
        return {"token_ids": ids, "loss_mask": mask, "behavior_logprobs": logprobs,
                "policy_versions": versions, "reward": reward.to_dict(), "num_turns": num_turns,
                "num_policy_tokens": sum(mask), "tool_statuses": statuses}
