"""postrain.actors: the roles of a run and the public Environment API.

One package per role, each naming its actor for configs:

    generator/      postrain.actors.generator:GeneratorActor      sampling rollouts, paged KV cache
    learner/        postrain.actors.learner:LearnerActor          training, checkpoints, weight publishing
    env/            postrain.actors.env:EnvironmentActor          the Environment API, episodes, tools
    orchestrator/   postrain.actors.orchestrator:OrchestratorActor    the run's driver
    gateway/        postrain.actors.gateway:GatewayActor          the OpenAI API over HTTP, token-in/token-out
    sandbox_actor   postrain.actors.sandbox_actor:SandboxActor    nsjail runs and sessions for episodes
    models/         the architectures and their registry; loading, tokenizers
    tasks/          the built-in tasks and the task registry

Shared by the roles: records/ (every message between roles), ledger.py, run_state.py,
timeline.py, weight_assembly.py, weight_receiver.py, device.py, atomic_write.py.
Old module paths (before the roles became packages) still import, with a warning: _moved.py.
"""

# The public Environment API and the task registry (actors/env/, actors/tasks/).
from ._moved import install as _install_moved_modules
from .env import (AgentEnvironment, Environment, EnvironmentContractError, EnvironmentFailure, Episode, EpisodePolicy,
                  GeneratorHandle, LocalSandbox, Reward, SandboxHandle, StepResult, TaskOptionsError,
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

_install_moved_modules()


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
