"""The gateway's generators: each request goes to the one with the fewest of the gateway's requests
in flight, and the gateway refuses work past its bound instead of queueing without end.

Invariant: `num_in_flight == sum(in_flight.values())`, each count decremented in a `finally`,
so a cancelled or failed request never leaks a slot.
"""
from __future__ import annotations

import logging

from postrain.core.errors import ActorDiedError, ActorTimeoutError, RemoteError

from ..records import GENERATE, GenerateReply, GenerateRequest
from .protocol import APIError

log = logging.getLogger("postrain.gateway")

RETRY_AFTER_S = 1.0


class GeneratorPool:
    """`refs`: anything with `.name` and `async ask(kind, body, timeout_s=...)` (an ActorRef of a
    generator actor)."""

    def __init__(self, refs: list, max_pending_requests: int, timeout_s: float = 600.0):
        if not refs:
            raise ValueError("a gateway needs at least one generator; name them in options.generators")
        self.refs = list(refs)
        self.max_pending_requests, self.timeout_s = max_pending_requests, timeout_s
        self.in_flight = {ref.name: 0 for ref in self.refs}
        self.num_in_flight = 0

    async def generate(self, request: GenerateRequest) -> GenerateReply:
        """The reply of the least busy generator. Raises APIError: 429 past max_pending_requests,
        503 when the generator died or timed out, 400 when it refused the request. Cancelled:
        the request is abandoned (the generator aborts it at its next step); its slot is freed."""
        if self.num_in_flight >= self.max_pending_requests:
            raise APIError(429, f"the gateway has {self.num_in_flight} requests in flight (its bound, "
                                f"max_pending_requests = {self.max_pending_requests}); retry later",
                           kind="rate_limit_error", code="overloaded", retry_after_s=RETRY_AFTER_S)
        ref = min(self.refs, key=lambda r: self.in_flight[r.name])
        self.in_flight[ref.name] += 1
        self.num_in_flight += 1
        try:
            return await ref.call(GENERATE, request, timeout_s=self.timeout_s)
        except (ActorDiedError, ActorTimeoutError) as exc:
            log.warning("generator %s failed a request: %s", ref.name, exc)
            raise APIError(503, f"generator {ref.name!r} is unavailable ({type(exc).__name__}); retry later",
                           kind="server_error", code="unavailable", retry_after_s=RETRY_AFTER_S) from None
        except RemoteError as exc:
            raise APIError(400, f"the generator refused the request: {exc}") from None
        finally:
            self.in_flight[ref.name] -= 1
            self.num_in_flight -= 1
