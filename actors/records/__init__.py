"""Every message that crosses between roles, on one page: typed records that encode to plain msgpack dicts.

    orchestrator --RolloutRequest--> env --GenerateRequest--> generator
    orchestrator <-------Rollout---- env <----GenerateReply--- generator
    orchestrator --TrainBatch / SftBatch--> learner (through LearnerKeeper, actors/learner/recovery.py)
    learner --WeightSync--> generator (`load_weights`), replies WeightSyncReply
    learner --PublishReport--> orchestrator (the `publish` reply)
    head --RunRequest--> orchestrator (`run`), replies a stream of RunUpdate; `stop` replies StopRun
    orchestrator --SaveCheckpoint, LoadCheckpoint, ExportHf, PublishRequest--> learner (records/learner.py)
    env --ExecRequest, RunTestsRequest, Session*Request--> sandbox, replies ExecReply, ... (records/sandbox.py)
    orchestrator --TokenScoresRequest / RewardScoresRequest--> scorer, replies TokenScoresReply, ... (records/scorer.py)
    agent harness --OpenEpisode, CloseEpisode--> gateway, replies EpisodeSegments (records/gateway.py)

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

One module per exchange: gateway.py, generate.py, rollout.py (and reward.py), train.py, weights.py,
learner.py, run.py, sandbox.py, scorer.py; the machinery is the kernel's (core/record.py). Import every
record, and every message kind, from `postrain.actors.records`.
"""
from postrain.core.record import RecordError
from .gateway import CloseEpisode, EpisodeCall, EpisodeSegment, EpisodeSegments, GatewayAddress, OpenEpisode
from .generate import (SAMPLING_CODEC, GeneratedSample, GenerateReply, GenerateRequest, GeneratorStats,
                       SamplingParams, SamplingParamsError)
from .reward import EnvironmentContractError, Reward
from .rollout import Rollout, RolloutRequest, RolloutSegment
from .train import SftBatch, StepMetrics, TrainBatch
from .learner import (CheckpointLoaded, CheckpointSaved, ExportedHf, ExportHf, GroupState, JoinGroup,
                      LearnerStats, LoadCheckpoint, PublishRequest, RankStep, SaveCheckpoint)
from .weights import (PublishReport, SealedChunk, WeightPatch, WeightsChannel, WeightsDigest, WeightSync,
                      WeightSyncReply)
from .chat import CHAT, SCORE_CONTINUATIONS, ChatReply, ChatRequest, ContinuationsReply, ContinuationsRequest
from .run import RUN_STATE_FORMAT, RunRequest, RunState, RunUpdate, StopRun
from .sandbox import (LIMIT_FIELDS, ExecReply, ExecRequest, ExecStreamItem, RunIoCasesReply,
                      RunIoCasesRequest, RunTestsReply, RunTestsRequest, SandboxStats, SessionClosed,
                      SessionCloseRequest, SessionExecRequest, SessionFileData, SessionFileWritten,
                      SessionOpened, SessionOpenRequest, SessionReadFileRequest, SessionSnapshotRequest,
                      SessionWriteFileRequest)
from .scorer import (TAIL_LOGMASS_FLOOR, RewardScoresReply, RewardScoresRequest, SequenceScores,
                     TokenScoresReply, TokenScoresRequest)

__all__ = ["SAMPLING_CODEC", "GenerateReply", "GenerateRequest", "GeneratedSample", "PublishReport",
           "RecordError", "Rollout", "RolloutRequest", "RunRequest", "SamplingParams", "SamplingParamsError",
           "SealedChunk", "SftBatch", "StepMetrics", "TrainBatch", "WeightSync", "WeightSyncReply"]
__all__ += ["CheckpointLoaded", "CheckpointSaved", "ExportHf", "ExportedHf", "GroupState", "JoinGroup",
            "LearnerStats", "LoadCheckpoint", "PublishRequest", "RankStep", "SaveCheckpoint",
            "RUN_STATE_FORMAT", "RunState", "RunUpdate", "StopRun"]
__all__ += ["GeneratorStats", "WeightPatch", "WeightsChannel", "WeightsDigest"]
__all__ += ["EnvironmentContractError", "Reward", "RolloutSegment"]
__all__ += ["ExecReply", "ExecRequest", "ExecStreamItem", "LIMIT_FIELDS", "RunIoCasesReply",
            "RunIoCasesRequest", "RunTestsReply", "RunTestsRequest", "SandboxStats", "SessionCloseRequest",
            "SessionClosed", "SessionExecRequest", "SessionFileData", "SessionFileWritten", "SessionOpenRequest",
            "SessionOpened", "SessionReadFileRequest", "SessionSnapshotRequest", "SessionWriteFileRequest"]
__all__ += ["RewardScoresReply", "RewardScoresRequest", "SequenceScores", "TAIL_LOGMASS_FLOOR", "TokenScoresReply",
            "TokenScoresRequest"]

# Every message kind between roles, declared once beside its records (core/messages.py).
from .generate import GENERATE, GENERATOR_STATS
from .weights import LOAD_WEIGHTS, WEIGHTS_DIGEST, WEIGHTS_CHANNEL
from .train import TRAIN, SFT
from .learner import (EXPORT_HF, GET_WEIGHTS, GROUP_STATE, JOIN_GROUP, LEARNER_STATS, LOAD_CHECKPOINT,
                      PUBLISH, RANK_STEP, SAVE_CHECKPOINT)
from .gateway import CLOSE_EPISODE, GATEWAY_ADDRESS, OPEN_EPISODE, TINKER_ADDRESS
from .rollout import ROLLOUT
from .run import RUN, STOP_RUN
from .sandbox import (EXEC, EXEC_STREAM, RUN_IO_CASES, RUN_TESTS, SANDBOX_STATS, SESSION_CLOSE, SESSION_EXEC,
                      SESSION_OPEN, SESSION_READ_FILE, SESSION_SNAPSHOT, SESSION_WRITE_FILE)
from .scorer import SCORE_REWARD, SCORE_TOKENS

__all__ += ["CloseEpisode", "EpisodeCall", "EpisodeSegment", "EpisodeSegments", "GatewayAddress", "OpenEpisode"]
__all__ += ["CLOSE_EPISODE", "GATEWAY_ADDRESS", "OPEN_EPISODE", "TINKER_ADDRESS"]
__all__ += ["SCORE_REWARD", "SCORE_TOKENS"]
__all__ += ["CHAT", "ChatReply", "ChatRequest", "SCORE_CONTINUATIONS", "ContinuationsReply", "ContinuationsRequest"]
__all__ += ["EXEC", "EXEC_STREAM", "EXPORT_HF", "GENERATE", "GENERATOR_STATS", "GET_WEIGHTS", "GROUP_STATE",
           "JOIN_GROUP", "LEARNER_STATS", "LOAD_CHECKPOINT", "LOAD_WEIGHTS", "PUBLISH", "RANK_STEP", "ROLLOUT",
           "RUN", "RUN_IO_CASES", "RUN_TESTS", "SANDBOX_STATS", "SAVE_CHECKPOINT", "SESSION_CLOSE",
           "SESSION_EXEC", "SESSION_OPEN", "SESSION_READ_FILE", "SESSION_SNAPSHOT", "SESSION_WRITE_FILE",
           "SFT", "STOP_RUN", "TRAIN", "WEIGHTS_CHANNEL", "WEIGHTS_DIGEST"]
