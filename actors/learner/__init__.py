"""postrain.actors.learner: training the policy on rollouts, and publishing its weights.

    actor.py           LearnerActor: train / sft / checkpoints / export / publish handlers
    learner.py         Learner, LearnerConfig: one optimizer step of a GRPO-family objective
    step.py            the step's loop: micro-batches, policy loss, gradient accumulation, AdamW
    fsdp.py            strategy "fsdp": FSDP2 sharding, gathering weights one tensor at a time
    batch.py           pack_batch: a train batch as padded tensors (one schema)
    shared_prefix.py   group training: each prompt's prefix run once for its samples
    routing.py         MoE policies: routing replay (R3), the router's aux loss, routing metrics
    group.py           LearnerGroup: data-parallel ranks, rendezvous, collectives with timeouts
    state.py           learner checkpoints (weights, optimizer, RNG, extra) and Hugging Face export
    sharded_state.py   DCP checkpoints of a sharded learner, resumable at any rank count
    recovery.py        LearnerKeeper: the orchestrator's side of a learner that died and came back
    publish.py         the sending side of a weight sync: messages, chunks, sealed pieces, digests

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
