"""postrain.actors.generator: sampling rollouts with a paged KV cache.

    actor.py         GeneratorActor: `generate` requests in, token ids and logprobs out; weight swaps
    engine.py        Engine: continuous batching over the paged KV cache
    sampling.py      SamplingParams, sample_rows, verify_rows: temperature, top-p/top-k, seeds, stops
    speculative.py   SpeculativeOptions and the draft proposers (n-gram, rollout, draft model)

Configs name the actor `postrain.actors.generator:GeneratorActor`.
"""

# Everything here imports torch, so it loads on first use (PEP 562).
_LAZY = {
    "GeneratorActor": "actor", "GeneratorOptions": "actor",
    "Engine": "engine", "EngineError": "engine", "CompletionOutput": "engine", "RequestOutput": "engine",
    "SamplingParams": "sampling", "SpeculativeOptions": "speculative",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
