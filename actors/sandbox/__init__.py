"""postrain.actors.sandbox: the sandbox role, nsjail runs and sessions for episodes, and its client.

    actor.py     SandboxActor: exec, run_tests, run_io_cases and sessions over postrain.sandbox
    client.py    remote_session: a session on a sandbox actor, with AsyncSession's methods

Configs name the actor `postrain.actors.sandbox:SandboxActor`.
"""
from .actor import SandboxActor, SandboxOptions, SandboxQueueFull, UnknownSession
from .client import RemoteSession, remote_session

__all__ = ["RemoteSession", "SandboxActor", "SandboxOptions", "SandboxQueueFull", "UnknownSession", "remote_session"]
