"""postrain.actors: the roles of a run and the public Environment API.

Actors (each started by the supervisor from a config's import path):
`generator_actor:GeneratorActor`, `learner_actor:LearnerActor`,
`env_actor:EnvironmentActor`, `sandbox_actor:SandboxActor`,
`orchestrator:OrchestratorActor` (the run's driver).
"""

# The public Environment API and the task registry (actors/environment.py, actors/tasks/).
from .environment import (Environment, EnvironmentContractError, EnvironmentFailure, Episode,
                          EpisodePolicy, GeneratorHandle, LocalSandbox, Reward, SandboxHandle,
                          StepResult, TaskOptionsError, TextPolicy, checked_reset, checked_step,
                          checked_truncated, drop_reason, run_episode, validate_observation,
                          validate_step_result)
from .tasks import TaskError, TaskSpec, get_task, list_tasks, register_task

# Model, engine and learner names import torch, so they load on first use (PEP 562).
_LAZY = {
    "LlamaModel": "model", "ModelConfig": "model", "build_model": "model",
    "load_model": "checkpoint", "Tokenizer": "tokenizer",
    "Engine": "engine", "SamplingParams": "sampling",
    "Learner": "learner", "LearnerConfig": "learner",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
