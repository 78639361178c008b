"""MessageTransport: each target gets a publish's version as one `load_weights` message.

    transport = MessageTransport()                      # weight_transport = "message" (or "auto", near)
    delivered = await transport.deliver(plan, {"gen0": ref}, request, errors)

The message is the plan's for that target (sync_plan.py): a patch on what it holds where the
plan has one, else the whole weights; a target that refuses the patch (it lacks the base, or
the result's digest differs: patch.py) gets the whole weights at once. The wire moves the
tensors as it moves any message's to that target (core/wire.py): through /dev/shm where the two
ends share a host (one write and one mapped read per tensor), inline on the connection
otherwise. `request.chunk_mb` does not apply: a sync is one message.
"""
from __future__ import annotations

import logging
import time

import anyio

from ..records import LOAD_WEIGHTS, PublishRequest, WeightSync
from .sync_plan import PublishPlan
from .transport import Delivery

log = logging.getLogger("postrain.learner")


class MessageTransport:
    """The WeightTransport of one `load_weights` message per target; it holds no state."""

    num_pieces_sealed = 0

    async def deliver(self, plan: PublishPlan, targets: dict, request: PublishRequest,
                      errors: dict[str, Exception]) -> dict[str, Delivery]:
        """WeightTransport.deliver, every target at once. Cancelled: a target whose call was in
        flight may or may not hold the version."""
        delivered: dict[str, Delivery] = {}

        async def push(name: str, target) -> None:
            try:
                message = await self._push(plan, name, target, request.timeout_s)
            except Exception as exc:
                errors[name] = exc
                return
            delivered[name] = Delivery(num_messages=1, done_at=time.perf_counter(), message=message)

        async with anyio.create_task_group() as tg:
            for name, target in targets.items():
                tg.start_soon(push, name, target)
        return delivered

    @staticmethod
    async def _push(plan: PublishPlan, name: str, target, timeout_s: float) -> WeightSync:
        """The message `name` took: its patch, or the whole weights if it refused the patch."""
        message = plan.message_for(name)
        try:
            await target.call(LOAD_WEIGHTS, message, timeout_s=timeout_s)
        except Exception as exc:
            if not plan.is_patch(message):
                raise
            log.info("%s refused a weight patch (%s); sending the whole weights", name, exc)
            message = plan.full_message()
            await target.call(LOAD_WEIGHTS, message, timeout_s=timeout_s)
        return message

    def close(self) -> None:
        """Nothing to release."""
