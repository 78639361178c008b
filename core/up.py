"""`postrain up [--config FILE] [--dry-run]`: start a run and see it through.

The head process (this one) validates the config, checks the run folder,
places every actor (printing the plan; `--dry-run` stops there), starts
them in config order, and then either streams the progress of the run's
driver actor (`[run] driver`) until it finishes, or serves until
`postrain down RUN_DIR`, SIGTERM or Ctrl-C. Leaving stops every actor (a STOP
message, a bounded wait, then a kill).

The run folder (run_dir/name) holds config.toml (the resolved config),
head.json (the head's address, for `postrain status` and `down`), logs/ (one
log per actor), and whatever the actors write (metrics, checkpoints,
summary.json).
"""
from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import anyio

from .config import RunConfig, load_config
from .errors import ActorError, ConfigError, PostrainError
from .scheduler import Scheduler
from .supervisor import Supervisor

HELP = "start a run: the head, then every actor the config names"
DEFAULT_CONFIG = ("postrain.actors", "configs/default.toml")  # package, resource: the built-in run
MIN_FREE_DISK_MB = 200


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="TOML run config (default: the built-in tiny run)")
    parser.add_argument("--dry-run", action="store_true", help="print the placement plan and exit")
    parser.add_argument("--run-dir", help="override [run] run_dir")


def default_config_path() -> Path:
    package, resource = DEFAULT_CONFIG
    return Path(str(importlib.resources.files(package).joinpath(resource)))


def prepare_run_folder(config: RunConfig) -> Path:
    """Create and check the run folder before anything starts: a clear error now, not at step 500."""
    folder = Path(config.run.run_dir) / config.run.name
    try:
        (folder / "logs").mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise PostrainError(f"run folder {folder} is not writable ({exc.strerror}); choose another "
                            "with [run] run_dir or --run-dir") from None
    free_mb = shutil.disk_usage(folder).free // (1 << 20)
    if free_mb < MIN_FREE_DISK_MB:
        raise PostrainError(f"run folder {folder} has {free_mb} MiB free, under the {MIN_FREE_DISK_MB} MiB "
                            "a run needs for logs and checkpoints; free space or choose another run_dir")
    return folder


def main(args) -> int:
    path = Path(args.config) if args.config else default_config_path()
    try:
        config = load_config(path)
        if args.run_dir:
            config.run.run_dir = args.run_dir
        plan = Scheduler().plan(config.actors)
    except (ConfigError, PostrainError) as exc:
        print(f"postrain up: {exc}", file=sys.stderr)
        return 2
    print(f"postrain up: {path} -> {len(plan)} actors")
    for placement in plan:
        print(f"  {placement.describe()}")
    if args.dry_run:
        return 0
    try:
        folder = prepare_run_folder(config)
    except PostrainError as exc:
        print(f"postrain up: {exc}", file=sys.stderr)
        return 2
    shutil.copyfile(path, folder / "config.toml")
    return anyio.run(_run, config, folder, backend="trio")


async def _run(config: RunConfig, folder: Path) -> int:
    async with Supervisor.open(heartbeat_interval_s=config.head.heartbeat_interval_s,
                               heartbeat_timeout_s=config.head.heartbeat_timeout_s,
                               bind=config.head.bind, log_dir=str(folder / "logs")) as supervisor:
        (folder / "head.json").write_text(json.dumps({"address": supervisor.address, "pid": os.getpid(),
                                                      "started": time.time()}))
        for spec in config.actors:
            await supervisor.start(spec)
            print(f"  started {spec.name} (pid {supervisor.records[spec.name].pid})", flush=True)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signal, supervisor, tg.cancel_scope)
            if config.run.driver:
                status = await _follow_driver(supervisor, config.run.driver, folder)
            else:
                print("serving; stop with `postrain down RUN_DIR` or Ctrl-C", flush=True)
                await supervisor.shutdown_requested.wait()
                status = 0
            tg.cancel_scope.cancel()
        print("stopping actors", flush=True)
    (folder / "head.json").unlink(missing_ok=True)
    return status


async def _follow_driver(supervisor: Supervisor, driver: str, folder: Path) -> int:
    """Stream the driver's progress lines; its last item is the run's summary."""
    ref = supervisor.ref(driver)
    summary = None
    async with anyio.create_task_group() as tg:
        async def stop_driver_on_shutdown():
            await supervisor.shutdown_requested.wait()
            await ref.tell("stop")
        tg.start_soon(stop_driver_on_shutdown)
        try:
            async for item in ref.stream("run", {"run_folder": str(folder)}, timeout_s=3600):
                if isinstance(item, dict) and "line" in item:
                    print(item["line"], flush=True)
                if isinstance(item, dict) and "summary" in item:
                    summary = item["summary"]
        except ActorError as exc:
            print(f"postrain up: the run's driver {driver!r} failed: {exc}\n"
                  f"its log: {folder / 'logs' / (driver + '.log')}", file=sys.stderr)
            return 1
        finally:
            tg.cancel_scope.cancel()
    if summary is not None:
        print(json.dumps(summary, indent=2))
    return 0


async def _stop_on_signal(supervisor: Supervisor, scope) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            print(f"received {signal.Signals(signum).name}; stopping the run", flush=True)
            supervisor.shutdown_requested.set()
            return
