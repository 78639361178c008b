"""postrain.ext"""

# The paged KV-cache block allocator (compiled, or its pure-Python twin; see kvpool.py).
from .kvpool import (  # noqa: F401
    IMPLEMENTATION as KVPOOL_IMPLEMENTATION, CheckedKVBlockPool, InvalidArgumentError, InvalidBlockError,
    KVBlockPool, KVPoolError, OutOfBlocksError, SequenceExistsError, UnknownSequenceError,
)

# RL ops (advantages, policy loss, KL, chunked logprobs, CuPy kernels): re-exported lazily
# (PEP 562) so `import postrain.ext` for the KV allocator does not import torch.
_RL_OPS_NAMES = (
    "ADVANTAGE_MODES", "AGG_MODES", "GRPO_EPS", "KL_KINDS", "AdaptiveKLController", "AdvantageResult",
    "FixedKLController", "GroupFilter", "OverlongPenalty", "PolicyLossConfig", "RLOpsError",
    "aggregate_loss", "compute_advantages", "cupy_available", "filter_groups", "fold_kl_into_rewards",
    "global_grad_norm", "group_advantages", "kl_estimate", "naive_token_logprobs", "overlong_penalty",
    "policy_loss", "row_weights", "shape_rewards", "token_logprobs", "token_logprobs_from_hidden",
)


def __getattr__(name: str):
    if name in _RL_OPS_NAMES:
        from . import rl_ops

        return getattr(rl_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
