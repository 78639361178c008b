"""WeightPublisher: the sending end of the weight-sync protocol, one per learner actor.

    transport = weight_transport("auto", actor.name, node.keys)       # transport_choice.py
    publisher = WeightPublisher(actor.lookup, SyncPlanner("auto", lora), transport)
    plan = publisher.planner.prepare(learner.base_weights(), learner.policy_version)
    report = await publisher.publish(plan, PublishRequest(targets=["gen0", "gen1"]))

Design note. One publish sends one version to every target at once. The publisher keeps what
every way of sending shares: it looks the targets up, hands them to its transport (chosen by
the learner's `weight_transport`, transport_choice.py: by message, sealed, or each by its
host), and books what each target confirmed with the planner, so a target that took a message
can get a patch next time (sync_plan.py). It never knows which transport runs. A target that fails does
not stop the others: they all finish, then the publish fails naming every target that failed
and why (the others hold the new version), and the planner forgets what the failed ones held.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio

from postrain.core.errors import PostrainError

from ..records import PublishReport, PublishRequest
from .sync_plan import PublishPlan, SyncPlanner, tensor_bytes
from .transport import WeightTransport

log = logging.getLogger("postrain.learner")


class WeightPublisher:
    """The targets a learner publishes to, its planner and transport, the last report.

    Invariant: `targets[name]` is the reference last looked up for `name`."""

    def __init__(self, lookup: Callable[[str], Awaitable], planner: SyncPlanner, transport: WeightTransport):
        self.lookup = lookup
        self.planner = planner
        self.transport = transport
        self.targets: dict[str, object] = {}
        self.last_publish: PublishReport | None = None

    @property
    def num_pieces_sealed(self) -> int:
        return self.transport.num_pieces_sealed

    def close(self) -> None:
        self.transport.close()

    async def publish(self, plan: PublishPlan, request: PublishRequest) -> PublishReport:
        """Push `plan`'s version to every target of `request`, concurrently (module docstring).
        timeout_s is per message (a chunked sync's last reply waits for all its chunks); chunk_mb
        bounds a sealed chunk (None: one chunk). Cancelled: targets that already replied hold the
        new version; the others may or may not; the planner keeps what it knew before (a patch built
        on that loads only where its digest checks, else the whole weights follow: patch.py)."""
        names = list(request.targets)
        errors: dict[str, Exception] = {}
        start = time.perf_counter()
        found = await self._find(names, errors)
        delivered = await self.transport.deliver(plan, found, request, errors)
        num_bytes = tensor_bytes(plan.weights)
        num_bytes_sent = self._book(plan, delivered, errors, num_bytes)
        plan.finish()
        if errors:
            raise PostrainError(f"publish of version {plan.version} failed for {len(errors)} of {len(names)} "
                                "targets (the others hold it): " + "; ".join(
                                    f"{name}: {type(exc).__name__}: {exc}" for name, exc in errors.items()))
        self.last_publish = PublishReport(
            version=plan.version, num_bytes=num_bytes, num_bytes_sent=num_bytes_sent,
            num_messages=sum(d.num_messages for d in delivered.values()),
            sync_s={name: d.done_at - start for name, d in delivered.items()},
            total_s=time.perf_counter() - start)
        log.info("published weights v%d (%.1f MiB, %.1f MiB sent) to %s in %.3f s", plan.version,
                 num_bytes / 2**20, num_bytes_sent / 2**20,
                 ", ".join(f"{k} {v:.3f} s" for k, v in self.last_publish.sync_s.items()) or "no targets",
                 self.last_publish.total_s)
        return self.last_publish

    def _book(self, plan: PublishPlan, delivered: dict, errors: dict[str, Exception], num_bytes: int) -> int:
        """Tell the planner what each target holds now (a target that took one message may get a
        patch on it next; one that took the whole weights otherwise, or failed, holds nothing we
        know of); returns the tensor bytes sent to the targets that confirmed."""
        num_bytes_sent = 0
        for name, delivery in delivered.items():
            if delivery.message is not None:
                num_bytes_sent += plan.sent(name, delivery.message)
            else:
                self.planner.forget(name)
                num_bytes_sent += num_bytes
        for name in errors:
            self.planner.forget(name)
        return num_bytes_sent

    async def _find(self, names: list[str], errors: dict[str, Exception]) -> dict[str, object]:
        """{name: its reference} of the targets found (each looked up once, then kept); the
        others go in `errors`."""
        async def find(name: str) -> None:
            try:
                if name not in self.targets:
                    self.targets[name] = await self.lookup(name)
            except Exception as exc:
                errors[name] = exc

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(find, name)
        return {name: self.targets[name] for name in names if name not in errors}
