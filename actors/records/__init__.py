"""Every message that crosses between roles, on one page: typed records that encode to plain msgpack dicts.

    orchestrator --RolloutRequest--> env --GenerateRequest--> generator
    orchestrator <-------Rollout---- env <----GenerateReply--- generator
    orchestrator --TrainBatch / SftBatch--> learner (through LearnerKeeper, actors/learner/recovery.py)
    learner --WeightSync--> generator (`load_weights`), replies WeightSyncReply
    learner --PublishReport--> orchestrator (the `publish` reply)
    head --RunRequest--> orchestrator (`run`), replies a stream of RunUpdate; `stop` replies StopRun
    orchestrator --SaveCheckpoint, LoadCheckpoint, ExportHf, PublishRequest--> learner (records/learner.py)
    env --ExecRequest, RunTestsRequest, Session*Request--> sandbox, replies ExecReply, ... (records/sandbox.py)

Each record is a frozen dataclass. Construction checks every field's type (and the
record's own rules, such as per-token lists of one length), so a wrong key or value
fails where the message is made, with an error naming the record, the field, the
value and the rule. `to_wire()` gives the dict that travels (what the handlers
received before these records existed, so the wire format is unchanged: a field that
is None is left out); `from_wire(dict)` is its inverse, refusing unknown keys by name.
Tensors and arrays pass through untouched (the wire moves them as extra frames).

`SamplingParams` lives here too (records/generate.py) (re-exported by actors/generator/sampling.py, which holds the
sampler): it is part of two messages, and this module must not import torch, so that
the orchestrator and environment processes stay light.

One module per exchange: base.py (the machinery), generate.py, rollout.py, train.py,
weights.py, learner.py, run.py, sandbox.py; import every record from `postrain.actors.records`.
"""
from .base import Record, RecordError, Vector, codec
from .generate import (SAMPLING_CODEC, GeneratedSample, GenerateReply, GenerateRequest, GeneratorStats,
                       SamplingParams, SamplingParamsError)
from .rollout import Rollout, RolloutRequest, RolloutSegment
from .train import SftBatch, StepMetrics, TrainBatch
from .learner import (CheckpointLoaded, CheckpointSaved, ExportedHf, ExportHf, GroupState, JoinGroup, LearnerStats,
                      LoadCheckpoint, PublishRequest, RankStep, SaveCheckpoint)
from .weights import (PublishReport, SealedChunk, WeightPatch, WeightsChannel, WeightsDigest, WeightSync,
                      WeightSyncReply)
from .run import RUN_STATE_FORMAT, RunRequest, RunState, RunUpdate, StopRun
from .sandbox import (LIMIT_FIELDS, ExecReply, ExecRequest, ExecStreamItem, RunIoCasesReply,
                      RunIoCasesRequest, RunTestsReply, RunTestsRequest, SandboxStats, SessionCloseRequest,
                      SessionClosed, SessionExecRequest, SessionFileData, SessionFileWritten, SessionOpened,
                      SessionOpenRequest, SessionReadFileRequest, SessionSnapshotRequest,
                      SessionWriteFileRequest)

__all__ = ["SAMPLING_CODEC", "GenerateReply", "GenerateRequest", "GeneratedSample", "PublishReport", "Record",
           "RecordError", "Rollout", "RolloutRequest", "RunRequest", "SamplingParams", "SamplingParamsError",
           "SealedChunk", "SftBatch", "StepMetrics", "TrainBatch", "Vector", "WeightSync", "WeightSyncReply", "codec"]
__all__ += ["CheckpointLoaded", "CheckpointSaved", "ExportHf", "ExportedHf", "GroupState", "JoinGroup",
            "LearnerStats", "LoadCheckpoint", "PublishRequest", "RankStep", "SaveCheckpoint",
            "RUN_STATE_FORMAT", "RunState", "RunUpdate", "StopRun"]
__all__ += ["GeneratorStats", "WeightPatch", "WeightsChannel", "WeightsDigest"]
__all__ += ["RolloutSegment"]
__all__ += ["ExecReply", "ExecRequest", "ExecStreamItem", "LIMIT_FIELDS", "RunIoCasesReply",
            "RunIoCasesRequest", "RunTestsReply", "RunTestsRequest", "SandboxStats", "SessionCloseRequest",
            "SessionClosed", "SessionExecRequest", "SessionFileData", "SessionFileWritten", "SessionOpenRequest",
            "SessionOpened", "SessionReadFileRequest", "SessionSnapshotRequest", "SessionWriteFileRequest"]
