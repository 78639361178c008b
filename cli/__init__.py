"""postrain.cli: the application layer above the roles: what the head does for a user.

The `postrain` command (`main`), one subcommand per module: `up` (the head:
supervisor, scheduler, balancer, live view, metrics exporter), `status` and
`down` (talk to a running head), `eval`, `generate`, `plot`, `trace`, `samples`,
`report` (one HTML page of a run), `init` (scaffold an environment package), `bench`
and `sandbox`. It may import every layer below it (core, ext, sandbox,
actors); nothing below imports it.
"""
from .main import main

__all__ = ["main"]
