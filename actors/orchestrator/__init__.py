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
    progress.py      PhaseProgress: a phase's done / total, elapsed and ETA
    learning_signal.py  LearningSignalWatch: warns on steps without a learning signal

Configs name the actor `postrain.actors.orchestrator:OrchestratorActor`.
"""
from .actor import OrchestratorActor
from .admission import Admission, AdmittedBatch
from .driver import RunDriver
from .options import OrchestratorOptions
from .rollout_pool import RolloutPool
from .scored_sample import ScoredSample
from .train_step import TrainStep
from .warm_start import chat_to_tokens

__all__ = ["Admission", "AdmittedBatch", "OrchestratorActor", "OrchestratorOptions", "RolloutPool",
           "RunDriver", "ScoredSample", "TrainStep", "chat_to_tokens"]
