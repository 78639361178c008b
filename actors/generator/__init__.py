"""postrain.actors.generator: sampling rollouts with a paged KV cache.

    actor.py         GeneratorActor: `generate` requests in, token ids and logprobs out; weight swaps
    engine.py        Engine: the thin loop (schedule -> run -> sample/verify -> update)
    scheduler.py     Scheduler, StepPlan: admission, preemption, the typed plan of each step
    kv_manager.py    KVManager: the paged KV cache tensors over the Cython block allocator
    kv_dtype.py      KV cache dtypes: float32, bfloat16, int8 and float8 (codes + per-token scales)
    runner.py        ModelRunner: executes a StepPlan through an attention backend; logits out
    attention.py     AttentionBackend, PagedMetadata; GatherSdpaBackend (gather + SDPA) and the CPU default
                     PagedDecodeBackend (decode steps read the cache in place: postrain.ext._paged_decode)
    sequence.py      RequestOutput, CompletionOutput, the sequences in flight, EngineError
    verify.py        speculative drafting and exact verification of a step's drafts
    scoring.py       scoring requests: a sequence's teacher rows (top-k logprobs, tail, token) from its prefill
    requests.py      a `generate` message as engine work and its reply (shared with the scorer actor)
    sampling.py      SamplingParams, sample_rows, verify_rows: temperature, top-p/top-k, seeds, stops
    speculative.py   SpeculativeOptions and the draft proposers (n-gram, rollout, draft model)

Configs name the actor `postrain.actors.generator:GeneratorActor`.
"""

# Everything here imports torch, so it loads on first use (PEP 562).
_LAZY = {
    "GeneratorActor": "actor", "GeneratorOptions": "actor",
    "Engine": "engine", "EngineError": "engine", "CompletionOutput": "engine", "RequestOutput": "engine",
    "Scheduler": "scheduler", "StepPlan": "scheduler", "KVManager": "kv_manager", "ModelRunner": "runner",
    "AttentionBackend": "attention", "GatherSdpaBackend": "attention", "PagedDecodeBackend": "attention",
    "PagedMetadata": "attention",
    "SamplingParams": "sampling", "SpeculativeOptions": "speculative",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
