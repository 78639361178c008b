"""`TinkerOptions`: the Tinker server's settings, one model for `postrain serve --tinker`'s flags
and the `tinker` role's `service` option (docs/tinker.md, "Tenants and limits")."""
from __future__ import annotations

from pydantic import Field

from postrain.core import Options


class TinkerOptions(Options):
    """The Tinker server's settings (`postrain serve --tinker`)."""

    max_training_clients_per_base: int = Field(16, ge=1, description="LoRA tenants resident on one base model "
                                               "at once (evicted ones do not count); past it create_model is "
                                               "answered 429 with Retry-After")
    max_training_memory_mb_per_base: float | None = Field(None, gt=0, description="the training state (LoRA "
                                                          "weights, their gradients and AdamW moments, float32) the "
                                                          "resident tenants of one base hold at most, MiB; a "
                                                          "create_model past it evicts idle tenants, else is answered "
                                                          "429 with Retry-After (400 for one tenant larger than the "
                                                          "whole budget). None: no limit")
    max_queued_requests_per_session: int = Field(1024, ge=1, description="requests of one session accepted and "
                                                 "not yet finished (training ops and samples); past it a new one "
                                                 "is answered 429 with Retry-After")
    evict_after_s: float | None = Field(600.0, ge=0, description="a tenant with no request for this long, "
                                        "seconds, and nothing queued is written to state_dir and leaves its base; "
                                        "its next request restores it. None: never")
    session_timeout_s: float | None = Field(300.0, gt=0, description="a session with no heartbeat for this "
                                            "long, seconds (the SDK sends one every 10 s), is finished as its "
                                            "client's close would: its training clients are freed. None: never")
    state_dir: str | None = Field(None, description="the folder evicted tenants are written to (one file each, "
                                  "deleted when restored or freed); None: a new temporary folder, removed when "
                                  "the server stops")
    seq_gap_timeout_s: float = Field(120.0, gt=0, description="how long a request waits for an earlier seq_id of "
                                     "its training client, seconds; past it the waiting requests fail")
    batch_tenants: bool = Field(True, description="run the forward_backward (and forward) requests of one base's "
                                "training clients that are ready together as one forward and one backward, each "
                                "adapter on its own rows, each loss as it would be alone; False: each request in turn")
    batch_tenants_max_tokens: int = Field(16384, ge=1, description="the padded tokens (rows x the longest row) "
                                          "of one batched forward at most: requests are joined while they fit; a "
                                          "larger request runs alone")
    max_recorded_tokens_per_session: int = Field(4_000_000, ge=1, description="tokens (prompt and sampled, "
                                                 "counted per sequence) of the sequences sampled with "
                                                 "record_stability_info that one session keeps for "
                                                 "stable_reinforce; past it the least recently used go first")
    poll_wait_s: float = Field(10.0, gt=0, description="retrieve_future holds a pending request this long, "
                               "seconds, then answers try_again")
    kv_cache_mb: float = Field(64.0, gt=0, description="each sampler engine's KV cache, MiB")
    retry_after_s: int = Field(5, ge=1, description="Retry-After of a 429, seconds")
    enable_sandbox: bool = Field(True, description="serve the sandbox extension (POST /api/v1/postrain/sandbox/run: "
                                 "code run in nsjail, sandbox_runs.py); False: that endpoint answers 404")
    sandbox_workers: int = Field(2, ge=1, description="warm jails of the sandbox extension, started at its first "
                                 "run: the runs at once; past it a run is answered 429 with Retry-After")
    sandbox_timeout_s: float = Field(10.0, gt=0, description="a sandbox run's wall limit (and CPU limit, rounded "
                                     "up), seconds, when the request names none; at most sandbox_max_timeout_s")
    sandbox_max_timeout_s: float = Field(60.0, gt=0, description="the most timeout_s a sandbox run may ask for, "
                                         "seconds; more is answered 400")
    sandbox_max_output_bytes: int = Field(1 << 20, ge=1024, description="bytes kept of a run's stdout, and of its "
                                          "stderr; past it the run is killed (status output_truncated)")
    sandbox_memory_mb: int = Field(512, ge=32, description="a sandbox run's memory, MiB: address space per "
                                   "process and the cgroup cap of its jail")
