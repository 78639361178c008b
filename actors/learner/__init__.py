"""postrain.actors.learner: training the policy on rollouts.

    actor.py           LearnerActor: train / sft / checkpoints / export / publish handlers
    learner.py         Learner: the policy and its parts, one optimizer step of a GRPO-family objective
    config.py          LearnerConfig: every knob, validated; the learning-rate schedule
    counter.py         StepCounter: step and policy_version, their one writer
    collectives.py     Collectives: ranks, rings, all-reduces, broadcasts
    policy_forward.py  PolicyForward: logprobs (LM head, autocast, shared prefixes, rings)
    optimizer.py       PolicyOptimizer: AdamW, clipping, the schedule's lr
    reference.py       KLReference: the frozen KL reference
    step.py            StepLoop: micro-batches, policy loss, gradient accumulation, one AdamW step
    checkpoint_io.py   CheckpointIO: the formats; state.py (whole model) and sharded_state.py (DCP)
    streamed_export.py Hugging Face export one unit at a time (sharded learners, offline)
    fsdp.py            strategy "fsdp": FSDP2 sharding, gathering weights one tensor at a time
    batch.py           pack_batch: a train batch as padded tensors (one schema)
    shared_prefix.py   group training: each prompt's prefix run once for its samples
    routing.py         MoE policies: routing replay (R3), the router's aux loss, routing metrics
    group.py           LearnerGroup: data-parallel ranks, rendezvous, collectives with timeouts
    context_parallel*  ring attention and the context-parallel step's rings
    recovery.py        LearnerKeeper: the orchestrator's side of a learner that died and came back

Weights are published through postrain.actors.weights (WeightPublisher).
Configs name the actor `postrain.actors.learner:LearnerActor`.
"""

# Everything here imports torch, so it loads on first use (PEP 562).
_LAZY = {
    "LearnerActor": "actor", "LearnerOptions": "actor", "PolicyVersionMismatch": "actor",
    "Learner": "learner", "LearnerConfig": "config", "LearnerError": "batch",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
