"""The error type of the RL ops (advantages, policy loss, KL, logprobs, kernels).

Every misuse raises `RLOpsError` with a message that names the rule, the value
and the fix, e.g. ``group_size must be >= 2 for group-relative advantages, got 1``.
"""
from __future__ import annotations

from postrain.core.errors import PostrainError


class RLOpsError(PostrainError, ValueError):
    """An RL op was called with arguments that break one of its rules."""
