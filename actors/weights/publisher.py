"""WeightPublisher: the sending end of the weight-sync protocol, one per learner actor.

    publisher = WeightPublisher(actor.name, node.keys, actor.lookup, SyncPlanner("auto", lora))
    plan = publisher.planner.prepare(learner.base_weights(), learner.policy_version)
    report = await publisher.publish(plan, PublishRequest(targets=["gen0", "gen1"]))

Design note. One publish sends one version to every target at once, each by the delivery its
place calls for: a target on this host (by node identity or address) gets one `load_weights`
message whose tensors cross through /dev/shm (the wire does it), a patch where the plan has
one for it (sync_plan.py) and the whole weights if it refuses the patch; the targets on other
nodes get the version whole, as chunks whose bytes are sealed once for all of them and sent
on each target's sealed channel (`_push_sealed`, core/sealed.py). A target that fails does not
stop the others: they all finish, then the publish fails naming every target that failed and
why (the others hold the new version), and the planner forgets what the failed ones held.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Awaitable, Callable

import anyio

from postrain.core.errors import PostrainError

from ..records import LOAD_WEIGHTS, WEIGHTS_CHANNEL, PublishReport, PublishRequest
from .messages import sealed_sync
from .sync_plan import PublishPlan, SyncPlanner

log = logging.getLogger("postrain.learner")


class WeightPublisher:
    """The targets a learner publishes to, the sealed sender to the far ones, the last report.

    Invariants: `targets[name]` is the reference last looked up for `name`; `channel_addresses[name]`
    is the sealed channel `name` named at its last far sync; `sealed` is None until a far sync."""

    def __init__(self, sender_name: str, keys, lookup: Callable[[str], Awaitable], planner: SyncPlanner):
        self.sender_name = sender_name
        self.keys = keys
        self.lookup = lookup
        self.planner = planner
        self.targets: dict[str, object] = {}
        self.sealed = None                      # the SealedSender to targets on other nodes, once needed
        self.channel_addresses: dict[str, str] = {}   # target name -> its sealed channel's last address
        self.last_publish: PublishReport | None = None

    @property
    def num_pieces_sealed(self) -> int:
        return self.sealed.num_pieces_sealed if self.sealed is not None else 0

    def close(self) -> None:
        if self.sealed is not None:
            self.sealed.close()

    async def publish(self, plan: PublishPlan, request: PublishRequest) -> PublishReport:
        """Push `plan`'s version to every target of `request`, concurrently (module docstring).
        timeout_s is per message (a chunked sync's last reply waits for all its chunks); chunk_mb
        bounds a far chunk (None: one chunk). Cancelled: targets that already replied hold the
        new version; the others may or may not."""
        names = list(request.targets)
        timeout_s = request.timeout_s
        weights, version = plan.weights, plan.version
        num_bytes_sent = 0
        sync_s: dict[str, float] = {}
        errors: dict[str, Exception] = {}
        far: dict[str, tuple] = {}                  # name -> (its reference, its sealed channel's address)
        num_messages = 0
        start = time.perf_counter()

        async def find(name: str) -> None:
            """Look `name` up; a target on another node names its sealed channel (into `far`)."""
            try:
                if name not in self.targets:
                    self.targets[name] = await self.lookup(name)
                target = self.targets[name]
                if not target.same_host:
                    channel = await target.call(WEIGHTS_CHANNEL, timeout_s=timeout_s)
                    far[name] = (target, channel.address)
            except Exception as exc:
                errors[name] = exc

        async def push_near(name: str) -> None:
            """One message to `name` (this host: /dev/shm). Cancelled: it may or may not hold the
            new version."""
            nonlocal num_messages, num_bytes_sent
            try:
                message = plan.message_for(name)
                try:
                    await self.targets[name].call(LOAD_WEIGHTS, message, timeout_s=timeout_s)
                except Exception as exc:          # a patch refused (it missed the base?): the whole weights
                    if not plan.is_patch(message):
                        raise
                    log.info("%s refused a weight patch (%s); sending the whole weights", name, exc)
                    message = plan.full_message()
                    await self.targets[name].call(LOAD_WEIGHTS, message, timeout_s=timeout_s)
            except Exception as exc:
                self.planner.forget(name)
                errors[name] = exc
                return
            num_bytes_sent += plan.sent(name, message)
            num_messages += 1
            sync_s[name] = time.perf_counter() - start

        async def push_far() -> None:
            nonlocal num_messages
            done = await self._push_sealed(far, weights, version, request.chunk_mb, timeout_s, errors)
            for name, (num_sent, done_at) in done.items():
                self.planner.forget(name)      # other nodes get whole weights, not patches
                num_messages += num_sent
                sync_s[name] = done_at - start

        async with anyio.create_task_group() as tg:
            for name in names:
                tg.start_soon(find, name)
        async with anyio.create_task_group() as tg:
            for name in names:
                if name not in errors and name not in far:
                    tg.start_soon(push_near, name)
            if far:
                tg.start_soon(push_far)
        plan.finish()
        if errors:
            raise PostrainError(f"publish of version {version} failed for {len(errors)} of {len(names)} "
                                "targets (the others hold it): " + "; ".join(
                                    f"{name}: {type(exc).__name__}: {exc}" for name, exc in errors.items()))
        num_bytes = sum(t.numel() * t.element_size() for t in weights.values())
        num_bytes_sent += num_bytes * sum(1 for name in far if name not in errors)
        self.last_publish = PublishReport(version=version, num_bytes=num_bytes, num_messages=num_messages,
                                          num_bytes_sent=num_bytes_sent,
                                          sync_s=sync_s, total_s=time.perf_counter() - start)
        log.info("published weights v%d (%.1f MiB, %.1f MiB sent) to %s in %.3f s", version,
                 num_bytes / 2**20, num_bytes_sent / 2**20,
                 ", ".join(f"{k} {v:.3f} s" for k, v in sync_s.items()) or "no targets",
                 self.last_publish.total_s)
        return self.last_publish

    async def _push_sealed(self, far: dict[str, tuple], weights: dict, version: int, chunk_mb: float | None,
                           timeout_s: float, errors: dict[str, Exception]) -> dict[str, tuple[int, float]]:
        """One sync to the targets on other nodes (`far`: name -> (reference, the address its
        `weights_channel` named, asked every sync: one started again has a new one)); the
        number of messages of each target that took it whole. The others go in `errors`. The
        chunks go in order on each target's Curve connection, every one but the last as a tell,
        so the link never idles waiting for a reply (a target handles them one at a time in
        arrival order); their bytes are sealed once, piece by piece, in one worker thread and
        the same sealed pieces go to every target's channel while ZeroMQ sends the last
        (core/sealed.py). A target's last reply confirms its whole sync; a chunk refused or
        lost leaves its last one refused: an error, never a part applied
        (assembly.py). A target whose pieces fail is cut off (its confirmation
        cancelled), one whose confirmation fails stops getting pieces; the others go on.
        Cancelled: the sending thread stops within 0.1 s; the targets drop the sync."""
        from postrain.core.sealed import SealedSender

        if self.sealed is None:
            self.sealed = SealedSender(self.keys.bulk_key)
        sender = self.sealed
        for name, (_, address) in far.items():
            old = self.channel_addresses.get(name)
            if old is not None and old != address:
                sender.forget(old)            # the target started again: a new channel
            self.channel_addresses[name] = address
        messages, streams = sealed_sync(weights, version, chunk_mb, self.sender_name, sender.piece_bytes, timeout_s)
        abandon = {name: threading.Event() for name in far}
        scopes = {name: anyio.CancelScope() for name in far}
        done: dict[str, tuple[int, float]] = {}

        def send_all() -> dict[str, Exception]:
            names_of = {address: name for name, (_, address) in far.items()}
            failed: dict[str, Exception] = {}
            for stream, buffers in streams:
                live = {address: abandon[name] for address, name in names_of.items() if name not in failed}
                if not live:
                    break
                for address, exc in sender.send(stream, buffers, live, timeout_s).items():
                    failed[names_of[address]] = exc
            return failed

        async def send_pieces() -> None:
            for name, exc in (await anyio.to_thread.run_sync(send_all)).items():
                errors.setdefault(name, exc)
                scopes[name].cancel()

        async def confirm(name: str, target) -> None:
            with scopes[name]:
                try:
                    for message in messages[:-1]:
                        await target.send(LOAD_WEIGHTS, message, timeout_s=timeout_s)
                    await target.call(LOAD_WEIGHTS, messages[-1], timeout_s=timeout_s)
                    done[name] = (len(messages), time.perf_counter())
                except Exception as exc:
                    errors.setdefault(name, exc)
                    abandon[name].set()
                except BaseException:         # cancelled: its pieces stop too
                    abandon[name].set()
                    raise

        async with anyio.create_task_group() as tg:
            tg.start_soon(send_pieces)
            for name, (target, _) in far.items():
                tg.start_soon(confirm, name, target)
        return {name: num for name, num in done.items() if name not in errors}
