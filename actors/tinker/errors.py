"""The Tinker API's errors, as the SDK reads them.

    raise TinkerAPIError(404, "unknown model_id 'm-1'; create it with create_lora_training_client")
    raise TinkerAPIError(429, "...", retry_after_s=1)

A refused HTTP request is answered with its status and the JSON body `{"detail": MESSAGE}` (the
hosted service's FastAPI shape; the SDK shows it as `Error code: 400 - {'detail': ...}`); 429
and 503 carry `Retry-After`. A request accepted and then failed (a bad loss input found while it
runs, a `seq_id` gap that never filled) fails its future instead: `retrieve_future` answers
`{"error": MESSAGE, "category": "user" | "server"}` (the SDK's `RequestFailedResponse`) and the
SDK raises `RequestFailedError`. Which statuses the SDK retries (408, 409, 429, 5xx) and which
it raises at once (other 4xx) is why a user's mistake is always a 4xx here.
"""
from __future__ import annotations

from postrain.core.errors import PostrainError

SUPPORTED_SDK_VERSION = "0.38.0"


class TinkerAPIError(PostrainError):
    """A request refused with `status`; the message names the rule, the value and the fix."""

    def __init__(self, status: int, message: str, *, retry_after_s: float | None = None,
                 category: str = "user"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s
        self.category = category     # "user" (the caller's mistake) or "server" (ours), for a failed future

    def body(self) -> dict:
        return {"detail": self.message}

    def failed_future(self) -> dict:
        """The body `retrieve_future` answers for a request that failed with this error."""
        return {"error": self.message, "category": self.category}


def check_sdk_version(version: str | None, where: str) -> None:
    """TinkerAPIError 400 unless `version` is the one SDK this server speaks."""
    if version != SUPPORTED_SDK_VERSION:
        raise TinkerAPIError(400, f"{where}: tinker SDK {version!r} is not supported; this postrain server "
                                  f"speaks tinker=={SUPPORTED_SDK_VERSION}; fix: pip install "
                                  f"tinker=={SUPPORTED_SDK_VERSION}")
