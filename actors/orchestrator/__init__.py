"""The orchestrator: the actor that drives an RL run, and its parts (one module each).

    actor.py         OrchestratorActor: `run` and `stop`, its heartbeat load
    options.py       OrchestratorOptions: every option, its default and its rule
    driver.py        RunDriver: the run's phases, checkpoints and resume, the RL loop
    admission.py     Admission: when batch b may start (staleness, buffer), backpressure
    rollout_pool.py  RolloutPool: episodes on the environment actors, retries, ledger transitions
    scored_sample.py ScoredSample: a sample whose rollout came back (pool -> admission -> train step)
    train_step.py    TrainStep: complete groups -> learner step -> publish -> metrics
    evaluation.py    Evaluator: held-out accuracy, greedy and sampled
    warm_start.py    the supervised warm start, chat_to_tokens
    sample_log.py    SampleLog: samples.jsonl, each RL sample's text, reward and advantage
    learning_signal.py  LearningSignalWatch: warns on steps without a learning signal

Configs name the actor `postrain.actors.orchestrator:OrchestratorActor`.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .actor import OrchestratorActor
    from .admission import Admission, AdmittedBatch
    from .driver import RunDriver
    from .options import OrchestratorOptions
    from .rollout_pool import RolloutPool
    from .scored_sample import ScoredSample
    from .train_step import TrainStep
    from .warm_start import chat_to_tokens

# Imported on first use, so that the CLI reading a run's files (ledger.py, sample_log.py) does not
# import the actor and with it torch (about 1.5 s for every `postrain` command).
_EXPORTS = {"OrchestratorActor": "actor", "Admission": "admission", "AdmittedBatch": "admission",
            "RunDriver": "driver", "OrchestratorOptions": "options", "RolloutPool": "rollout_pool",
            "ScoredSample": "scored_sample", "TrainStep": "train_step", "chat_to_tokens": "warm_start"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
