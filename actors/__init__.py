"""postrain.actors: the roles of a run and the public Environment API.

One package per role, each naming its actor for configs:

    generator/      postrain.actors.generator:GeneratorActor        sampling rollouts, paged KV cache
    learner/        postrain.actors.learner:LearnerActor            training, checkpoints
    env/            postrain.actors.env:EnvironmentActor            the Environment API, episodes, tools
    orchestrator/   postrain.actors.orchestrator:OrchestratorActor  the run's driver, ledger, run state
    gateway/        postrain.actors.gateway:GatewayActor            the OpenAI API over HTTP, token-in/token-out
    sandbox/        postrain.actors.sandbox:SandboxActor            nsjail runs and sessions for episodes

Shared by the roles:

    records/        every message between roles (typed records)
    weights/        the weight-sync protocol: WeightPublisher, WeightReceiver
    models/         the architectures and their registry; loading, tokenizers, devices
    tasks/          the built-in tasks and the task registry
    configs/        the shipped run configs and UpConfig, what `postrain up` reads

This folder holds packages only (docs/architecture.md, "Layout").
"""

# The public Environment API and the task registry (actors/env/, actors/tasks/).
from .env import (AgentEnvironment, Environment, EnvironmentContractError, EnvironmentFailure, Episode, EpisodePolicy,
                  LocalSandbox, Reward, SandboxHandle, ScorerHandle, Scorers, StepResult, TaskOptionsError,
                  TextPolicy, checked_reset, checked_step, checked_truncated, drop_reason, run_episode,
                  validate_observation, validate_step_result)
from .tasks import TaskError, TaskSpec, get_task, list_tasks, register_task

# Model, engine and learner names import torch, so they load on first use (PEP 562).
_LAZY = {
    "LlamaModel": "models", "ModelConfig": "models", "build_model": "models",
    "load_model": "models", "Tokenizer": "models",
    "Engine": "generator", "SamplingParams": "generator",
    "Learner": "learner", "LearnerConfig": "learner",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
