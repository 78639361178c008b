"""Tenants batched into one forward (service.py's "Batching tenants"): the op a batch is made of,
which pending ops make one batch, and the batch run in a worker thread.

    batch = take_batch(pending, options.batch_tenants_max_tokens)   # the first op, and those that fit
    results, num_batched = compute_batch(batch)                       # one Result per op, in order

An op's own work (`outcome`) is what an op alone runs, and what a batch falls back to when its
forward fails; a failed backward fails only its training ops.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio

from .errors import TinkerAPIError
from .futures import Result
from .ordering import Op
from .tenants import BackwardFailed, TenantJob, forward_backward_together
from .wire import encode_forward_backward_output

log = logging.getLogger("postrain.tinker")


@dataclass
class BatchableOp(Op):
    """A forward_backward (or forward) op that may run in one forward with other tenants' ops
    (module docstring, "Batching tenants"); `work` runs it alone. `done` is set once its future
    is resolved."""

    job: TenantJob
    done: trio.Event = field(default_factory=trio.Event)

    @property
    def rows_and_width(self) -> tuple[int, int]:
        """(its datums, the longest one's tokens + 1): its padded batch is the product."""
        return len(self.job.datums), max(len(d.tokens) for d in self.job.datums) + 1


def take_batch(pending: list[BatchableOp], max_tokens: int) -> list[BatchableOp]:
    """The first pending op and each later one (in arrival order) while the batch's padded
    tokens stay within `max_tokens` (batch_tenants_max_tokens); they leave `pending`."""
    batch = [pending.pop(0)]
    num_rows, width = batch[0].rows_and_width
    for op in list(pending):
        rows, op_width = op.rows_and_width
        if (num_rows + rows) * max(width, op_width) <= max_tokens:
            pending.remove(op)
            batch.append(op)
            num_rows, width = num_rows + rows, max(width, op_width)
    return batch

def compute_batch(batch: list[BatchableOp]) -> tuple[list[Result], int]:
    """Each op's result, from one forward_backward_together of the ops whose tenants are
    resident (resumed first; one that cannot be fails alone); in a worker thread, under the
    compute limiter. An op alone runs its own work, as without batching. Also returns how many
    ops shared one forward (0: none did)."""
    if len(batch) == 1:
        return [outcome(batch[0])], 0
    results: list[Result | None] = [None] * len(batch)
    num_batched = 0
    ready = []
    for k, op in enumerate(batch):
        try:
            op.job.tenant.resume()
            ready.append(k)
        except Exception as exc:
            results[k] = failure(op, exc)
    if len(ready) >= 2:
        try:
            outs = forward_backward_together([batch[k].job for k in ready])
        except BackwardFailed as exc:
            log.exception("tinker: a batched backward of %d requests failed", len(ready))
            for k in ready:
                results[k] = outcome(batch[k]) if batch[k].job.forward_only else failure(batch[k], exc)
        except Exception:
            log.exception("tinker: a batched forward of %d requests failed; running them one by one", len(ready))
            for k in ready:
                results[k] = outcome(batch[k])
        else:
            num_batched = len(ready)
            for k, (outputs, metrics) in zip(ready, outs):
                results[k] = Result.proto(encode_forward_backward_output(outputs, metrics))
    for k in ready:
        if results[k] is None:     # one op left: alone
            results[k] = outcome(batch[k])
    assert all(isinstance(r, Result) for r in results), "every op of a batch has a result"
    return [r for r in results if r is not None], num_batched


def outcome(op: Op) -> Result:
    """The op's work's Result, or its failure's (the request's own: its future says so)."""
    try:
        result = op.work()
    except Exception as exc:
        return failure(op, exc)
    assert isinstance(result, Result), "an op's work returns a Result"
    return result


def failure(op: Op, exc: Exception) -> Result:
    """A failed Result: a TinkerAPIError as it is, anything else an internal error (logged)."""
    if isinstance(exc, TinkerAPIError):
        return Result.failed(exc)
    log.error("tinker: request %s failed", op.request_id, exc_info=exc)
    return Result.failed(TinkerAPIError(500, f"internal error: {type(exc).__name__}: {exc}", category="server"))
