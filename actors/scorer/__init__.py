"""postrain.actors.scorer: frozen models beside the policy (teachers, the KL reference, judges,
reward models), served by the generator's engine.

    actor.py   ScorerActor: `score_tokens` (serves = "logprobs"), `generate` and `chat` (serves =
               "generate"), `score_reward` (serves = "reward"); ScorerOptions, ScorerError
    rubric.py  what a judge grades by: rubrics, verdict formats, the escaping of the policy's output
    judge.py   judge rewards: the fenced prompt, strict verdicts (or choice verdicts), the cache
    local.py   an in-process judge handle over an Engine (tests, benches, `postrain eval`)

Configs name the actor `postrain.actors.scorer:ScorerActor`.
"""

# The actor imports torch, so it loads on first use (PEP 562).
_LAZY = {"ScorerActor": "actor", "ScorerOptions": "actor", "ScorerError": "actor"}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
