"""`postrain up [--config FILE] [--set KEY=VALUE ...] [--dry-run]`: start a run and see it through.

The head process (this one) validates the config (with the `--set` overrides applied:
cli/overrides.py), checks the run folder, fills in what the config leaves unset that the
model sizes (kv_cache_mb, memory_mb, start_timeout_s, heartbeat_timeout_s;
actors/configs/sizing.py, printed with the RL step's time estimate), places every actor
(printing the plan; `--dry-run` stops there), starts
them in config order, and then either streams the progress of the run's
driver actor (`[run] driver`) until it finishes, or serves until
`postrain down RUN_DIR`, SIGTERM or Ctrl-C. Leaving stops every actor (a STOP
message, a bounded wait, then a kill of its process group) and removes the
run's shared memory and head.json.

Stopping, in any phase: `postrain down` or the first SIGINT/SIGTERM asks for a
clean stop (during start-up: no further actor is started; while the driver
runs: it finishes its step, checkpoints and sends its summary, within [head]
stop_grace_s, past which every actor is stopped anyway); a second signal
stops every actor at once. The exit status is 0 after `postrain down`,
128 + the signal's number after a signal, 1 when an actor failed, 2 for a
config or run-folder error. An actor's failure is always one line (the actor,
the reason, its log), never a traceback.

While the driver runs, a terminal shows a live view (figures, queue depths,
every actor's health: cli/live.py); `--quiet`, or a stdout that is not a
terminal, gives the plain progress lines. The head serves Prometheus metrics
at the URL it prints ([head] metrics_port; cli/exporter.py).

While the actors run, the head's balancer (cli/balancer.py, `[balancer]`)
adds sandbox workers when tool calls queue and removes them when idle, and
logs the orchestrator's backpressure; each decision is a line and a
"balance" metrics row. With a `[tracking]` section, the rows of metrics.jsonl
and the summary go to W&B, MLflow or trackio too (cli/tracking.py).

The run folder (run_dir/name) holds config.toml (a copy of the config),
source.json (where it came from), head.json (the head's address and metrics
URL, for `postrain status` and `down`), logs/ (one log per actor), and whatever
the actors write (metrics, checkpoints, summary.json). A folder that already
holds a run is refused (`--dry-run` too), naming `--resume` and `--overwrite`
(which deletes the run's files, RUN_FILES in cli/run_folder.py, first). The config's own folder is
on the import path of the head and every actor (actors/configs/run_config.py).

With a `[cluster]` section the actors run on the nodes of a Ray cluster instead: the plan
is printed node by node, one node agent per node starts each actor on its node, and the
head follows the driver there (cli/cluster_up.py, docs/cluster.md).

`postrain up --resume RUN_DIR` starts the run in RUN_DIR again from its
config.toml and asks the driver to continue from the run's last checkpoint
(the orchestrator's resume: actors/orchestrator/driver.py). With `--set`, only what the run's
data and checkpoint do not depend on may change, for this start (cli/run_folder.py,
RESUMABLE_SECTIONS and RESUMABLE_FIELDS); a run started with `--set` keeps its config as run in config.toml. Actors
die with their head (core/runtime.py), so a head killed with SIGKILL leaves no orphans to stop
first.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

import anyio

from postrain.actors.configs.run_config import default_config_path, write_run_source
from postrain.actors.records import RUN, STOP_RUN, RunRequest
from postrain.core.atomic_write import write_file_atomically
from postrain.core.errors import ActorError, ActorStartError, ConfigError, PostrainError
from postrain.core.scheduler import Scheduler
from postrain.core.supervisor import Supervisor, run_tag_for
from postrain.core.config import complete_rendezvous
from postrain.core.transport import CurveKeys, free_tcp_port

from .balancer import Balancer
from .cluster_up import ClusterLaunch, meeting_point_on_node, node_agents, plan_on_cluster, start_on_node
from .config import UpConfig
from .control import control_client_keys
from .monitor import RunMonitor
from .node_watch import NodeWatch
from .run_folder import (check_run_folder_unused, clear_run_folder, prepare_run_folder, print_sizing,
                         read_up_config, resume_config, size, write_run_config)
from .tracking import RunTracking

HELP = "start a run: the head, then every actor the config names"
DESCRIPTION = """Start a run: check the config, place every actor, start them, follow the run to its end.

examples:
  postrain up                                    the built-in run (a tiny model, arithmetic; runs/default)
  postrain up --config my_run.toml --dry-run     check a config, print the sizing and placement; starts nothing
  postrain up --set orchestrator.num_steps=5     the config with one value changed (repeatable; TOML values)
  postrain up --resume runs/default              continue a stopped run from its last checkpoint

A run folder (run_dir/name) that already holds a run is refused: --resume it or --overwrite it.
Modules a config names by import path may sit beside the config file. More: docs/operations.md."""


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="TOML run config (default: the built-in tiny run)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the sizing derived from the model and the placement plan, and exit")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="change one value of the config, e.g. orchestrator.num_steps=5 or "
                        "generator.memory_mb=4096 (repeatable; a TOML value; the rule: cli/overrides.py)")
    parser.add_argument("--run-dir", help="override [run] run_dir")
    parser.add_argument("--resume", metavar="RUN_DIR",
                        help="continue the run in RUN_DIR (its config.toml) from its last checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in a run folder that holds a run: its files are deleted first")
    parser.add_argument("--quiet", action="store_true",
                        help="plain progress lines instead of the live view (always so when stdout is not a terminal)")


def main(args) -> int:
    path = Path(args.config) if args.config else default_config_path()
    if args.resume:
        path = Path(args.resume) / "config.toml"
    try:
        if args.resume and args.overwrite:
            raise PostrainError("--resume continues a run and --overwrite deletes one; give one of them")
        if args.resume:
            config, doc = resume_config(Path(args.resume), args.set), None
        else:
            config, doc = read_up_config(path, args.set)
        if args.run_dir and not args.resume:
            config.run.run_dir = args.run_dir
        if not args.resume:   # a second run into a run's folder would mix their files
            check_run_folder_unused(config, args.overwrite)
        print_sizing(size(config))   # before the placement, which may refuse what it derived
        launch = plan_on_cluster(config, path) if config.cluster is not None else None
        plan = Scheduler().plan(config.actors) if launch is None else []
    except (ConfigError, PostrainError) as exc:
        print(f"postrain up: {exc}", file=sys.stderr)
        return 2
    if launch is None:
        print(f"postrain up: {path} -> {len(plan)} actors")
    for placement in plan:
        print(f"  {placement.describe()}")
    if args.dry_run:
        if launch is not None:
            launch.cluster.disconnect()
        return 0
    if args.overwrite:
        removed = clear_run_folder(Path(config.run.run_dir) / config.run.name)
        print(f"postrain up: --overwrite: deleted {', '.join(removed)}")
    try:
        folder = prepare_run_folder(config)
    except PostrainError as exc:
        print(f"postrain up: {exc}", file=sys.stderr)
        return 2
    if not args.resume:
        assert doc is not None  # read_up_config's document: a new run
        write_run_config(folder, path, args.set, doc)
        write_run_source(folder, path)
    try:
        monitor = RunMonitor(folder, config, quiet=args.quiet).start()  # a taken metrics port fails here
    except PostrainError as exc:
        print(f"postrain up: {exc}", file=sys.stderr)
        return 2
    with monitor:
        try:   # a tracker that is not installed or will not open fails here, before any actor
            tracking = RunTracking(folder, config.tracking, config.run.name,
                                   config.model_dump(mode="json")).start()
        except PostrainError as exc:
            print(f"postrain up: {exc}", file=sys.stderr)
            return 2
        with tracking:
            return _run_and_report(config, folder, monitor, bool(args.resume), launch)


def _run_and_report(config: UpConfig, folder: Path, monitor: RunMonitor, resume: bool,
                    launch: ClusterLaunch | None = None) -> int:
    """The run's exit status; an actor's failure as one line per cause, not a traceback."""
    status = 1  # what an actor that failed leaves
    try:
        status = anyio.run(_run, config, folder, monitor, resume, launch, backend="trio")
    except* ActorStartError as group:  # one line per cause, not a traceback of task groups
        for exc in _leaves(group):
            print(f"postrain up: {describe_start_error(exc)}", file=sys.stderr)
    except* PostrainError as group:  # an actor's failure in a later phase: one line each too
        for exc in _leaves(group):
            print(f"postrain up: {exc}", file=sys.stderr)
    return status


def describe_start_error(exc: ActorStartError) -> str:
    """One line: the actor, what went wrong, where its log is."""
    log_path = f"; its log: {exc.log_path}" if exc.log_path else ""
    return f"actor {exc.actor} ({exc.cls}) failed to start: {exc.reason}{log_path}"


def _leaves(group: BaseExceptionGroup) -> list:
    """The exceptions of a (nested) exception group, in order."""
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return leaves


class _Stopper:
    """What SIGINT and SIGTERM do to the head, in every phase: the first asks for a clean stop
    (the supervisor's shutdown_requested, as `postrain down` does), the second cancels `scope`
    (every actor is then stopped at once), later ones are ignored. Its handlers stay installed
    until the actors are stopped and the run's shared memory removed, so that no signal ends
    the head halfway through its cleanup. Invariant: signum is None iff no signal came."""

    def __init__(self):
        self.signum: int | None = None
        self.num_signals = 0
        self.supervisor: Supervisor | None = None
        self.scope: anyio.CancelScope | None = None

    @contextmanager
    def installed(self):
        """Route SIGINT and SIGTERM to `on_signal` in the event loop for the body of the `with`."""
        import trio
        token = trio.lowlevel.current_trio_token()

        def handle(signum, frame):  # run_sync_soon is safe to call from a signal handler
            token.run_sync_soon(self.on_signal, signum)
        previous = {signum: signal.signal(signum, handle) for signum in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield self
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def attach(self, supervisor: Supervisor, scope: anyio.CancelScope) -> None:
        self.supervisor, self.scope = supervisor, scope
        if self.signum is not None:  # a signal came while the head opened
            supervisor.shutdown_requested.set()

    def on_signal(self, signum: int) -> None:
        self.num_signals += 1
        name = signal.Signals(signum).name
        if self.num_signals == 1:
            self.signum = signum
            print(f"received {name}; stopping the run cleanly (again to stop every actor at once)", flush=True)
            if self.supervisor is not None:
                self.supervisor.shutdown_requested.set()
        elif self.num_signals == 2 and self.scope is not None:
            print(f"received {name} again; stopping every actor now", flush=True)
            self.scope.cancel()
        else:
            print(f"received {name}; already stopping", flush=True)


async def _run(config: UpConfig, folder: Path, monitor: RunMonitor, resume: bool = False,
               launch: ClusterLaunch | None = None) -> int:
    """Start the actors, follow the run, stop them. Cancelled (a failed start): every actor is
    stopped and head.json removed all the same; a second signal cancels only the run's scope."""
    stopper = _Stopper()
    try:
        with stopper.installed():
            status = await _run_actors(config, folder, monitor, resume, stopper, launch)
    finally:
        (folder / "head.json").unlink(missing_ok=True)
    return 128 + stopper.signum if stopper.signum is not None else status


def _binds_tcp(config: UpConfig) -> bool:
    """Whether a socket of the run listens on tcp, where it needs Curve keys even on loopback
    (any local user can reach 127.0.0.1; ipc sockets live in the run's private folder)."""
    return any(bind.startswith("tcp://") for bind in [config.head.bind, *(a.bind for a in config.actors)])


async def _run_actors(config: UpConfig, folder: Path, monitor: RunMonitor, resume: bool,
                      stopper: _Stopper, launch: ClusterLaunch | None = None) -> int:
    """Start every actor in config order (with `launch`: on its node, through the node agents),
    then follow the driver or serve until asked to stop. Cancelled: leaving the supervisor (and
    the agents) stops every actor started so far (shielded), kills their process groups and
    removes the run's shared memory."""
    status = 0
    watch = None   # a cluster run's NodeWatch
    async with Supervisor.open(heartbeat_interval_s=config.head.heartbeat_interval_s,
                               heartbeat_timeout_s=config.head.heartbeat_timeout_s,
                               bind=config.head.bind, log_dir=str(folder / "logs"),
                               keys=CurveKeys.generate() if launch is not None or _binds_tcp(config) else None,
                               run_tag=run_tag_for(str(folder.resolve()))) as supervisor, \
            AsyncExitStack() as stack:
        if launch is None:
            async def start_all(specs):
                """The actors on this host, in order, their imports overlapping. Cancelled: those
                not READY are killed (Supervisor.start_in_order)."""
                await supervisor.start_in_order(specs, lambda spec: print(
                    f"  started {spec.name} (pid {supervisor.records[spec.name].pid})", flush=True))
        else:
            agents = await stack.enter_async_context(node_agents(launch, supervisor, folder))
            watch = NodeWatch(agents, launch, config, supervisor, folder, emit=monitor.line)

            async def start_all(specs):
                """Each actor on its node, in order. Cancelled: see start_on_node."""
                for spec in specs:
                    print(await start_on_node(agents, launch, spec, supervisor), flush=True)
        # the collective groups' meeting points (an entry with ranks > 1): rank 0's node, a free port
        meeting_point = (meeting_point_on_node(agents, launch) if launch is not None
                         else lambda name: ("127.0.0.1", free_tcp_port("127.0.0.1")))
        await anyio.to_thread.run_sync(complete_rendezvous, config.actors, meeting_point)
        with anyio.CancelScope() as scope:
            stopper.attach(supervisor, scope)
            monitor.attach(supervisor)
            write_file_atomically(folder / "head.json", json.dumps({   # the control key: 0600
                "address": supervisor.address, "pid": os.getpid(), "started": time.time(),
                "metrics_url": monitor.metrics_url, "run_tag": supervisor.run_tag,
                "client_keys": control_client_keys(supervisor.keys)}).encode(), mode=0o600)
            if monitor.metrics_url:
                print(f"  metrics: {monitor.metrics_url}", flush=True)
            if await _start_actors(supervisor, config, start_all):
                status = await _serve(config, folder, monitor, resume, supervisor, watch)
            else:
                print(f"stopped during start-up; resume with `postrain up --resume {folder}`", flush=True)
        print("stopping actors", flush=True)
    return status


async def _start_actors(supervisor: Supervisor, config: UpConfig, start_all) -> bool:
    """Start the actors in config order (`start_all(specs)` prints a line as each is READY);
    False when a stop was asked (`postrain down`, a signal) before all were READY. Raises
    ActorStartError. Cancelled: the actors not READY are killed (on a cluster the one being
    started may start all the same); those started stay, for the supervisor's (and the
    agents') shutdown."""
    async with anyio.create_task_group() as tg:
        async def cancel_on_shutdown():
            """Stop starting actors once a stop is asked. Cancelled: nothing to undo."""
            await supervisor.shutdown_requested.wait()
            tg.cancel_scope.cancel()
        tg.start_soon(cancel_on_shutdown)
        await start_all(config.actors)
        tg.cancel_scope.cancel()
    return not supervisor.shutdown_requested.is_set()


async def _serve(config: UpConfig, folder: Path, monitor: RunMonitor, resume: bool,
                 supervisor: Supervisor, watch: NodeWatch | None = None) -> int:
    """Follow the driver to its end, or serve until a stop is asked; the monitor, the balancer
    and (a cluster run) the node watch run alongside. Cancelled: they stop; the actors run on
    for the supervisor's shutdown."""
    status = 0  # what a stop that ran past stop_grace_s leaves
    async with anyio.create_task_group() as tg:
        tg.start_soon(monitor.watch)
        if watch is not None:
            tg.start_soon(watch.run)
        if config.balancer.enabled:
            tg.start_soon(Balancer(supervisor, config.balancer, folder, emit=monitor.line).run)
        if config.run.driver:
            tg.start_soon(_limit_stop_grace, supervisor, config.head.stop_grace_s, tg.cancel_scope)
            status = await _follow_driver(supervisor, config.run.driver, folder, monitor, resume, watch)
        else:
            print("serving; stop with `postrain down RUN_DIR` or Ctrl-C", flush=True)
            await supervisor.shutdown_requested.wait()
            status = 0
        tg.cancel_scope.cancel()
    return status


def _add_to_summary(folder: Path, summary: dict, figures: dict) -> dict:
    """`summary` with `figures`, also written into the driver's summary.json when it wrote one."""
    summary = {**summary, **figures}
    path = folder / "summary.json"
    if path.exists():
        path.write_text(json.dumps({**json.loads(path.read_text()), **figures}, indent=2))
    return summary


async def _limit_stop_grace(supervisor: Supervisor, grace_s: float, scope: anyio.CancelScope) -> None:
    """Once a stop is asked, give the driver `grace_s` to end its run (a step, a checkpoint),
    then cancel `scope`: every actor is stopped anyway. Cancelled: nothing to undo."""
    await supervisor.shutdown_requested.wait()
    await anyio.sleep(grace_s)
    print(f"the driver did not end within stop_grace_s = {grace_s:g} s of the stop; stopping every "
          "actor now", flush=True)
    scope.cancel()


async def _follow_driver(supervisor: Supervisor, driver: str, folder: Path, monitor: RunMonitor,
                         resume: bool = False, watch: NodeWatch | None = None) -> int:
    """Stream the driver's progress lines and figures to the monitor; its last item is the run's
    summary. A driver that fails in a cluster run may have lost a peer with a node: the node
    watch gets its time to say so first (`NodeWatch.explain`, which raises the node's loss).
    Cancelled: the stream is abandoned (the driver runs on until its actor is stopped) and the
    live view is closed; no summary is printed."""
    ref = supervisor.ref(driver)
    summary = None
    async with anyio.create_task_group() as tg:
        async def stop_driver_on_shutdown():
            """On `postrain down`, tell the driver to stop. Cancelled: the driver is not told."""
            await supervisor.shutdown_requested.wait()
            try:
                await ref.send(STOP_RUN)
            except ActorError as exc:  # a dead driver ends the stream, which says why
                print(f"could not tell the driver to stop: {exc}", flush=True)
        tg.start_soon(stop_driver_on_shutdown)
        try:
            with monitor.view:
                request = RunRequest(run_folder=str(folder), resume=resume)
                async for update in ref.call_stream(RUN, request, timeout_s=3600):
                    if update.line is not None:
                        monitor.line(update.line)
                    if update.figures is not None:
                        monitor.figures(update.figures)
                    if update.summary is not None:
                        summary = update.summary
        except ActorError as exc:
            if watch is not None:
                await watch.explain()
            print(f"postrain up: the run's driver {driver!r} failed: {exc}\n"
                  f"its log: {folder / 'logs' / (driver + '.log')}", file=sys.stderr)
            return 1
        finally:
            tg.cancel_scope.cancel()
    if summary is None:   # the driver ended without a summary: stopped inside the warm start
        print(f"stopped during the warm start; resume with `postrain up --resume {folder}`", flush=True)
    else:
        if watch is not None:   # the head's own counts (a cluster's node losses)
            summary = _add_to_summary(folder, summary, watch.summary_figures())
        print(json.dumps(summary, indent=2))
        if not summary.get("complete", True):   # a stop (Ctrl-C, `postrain down`) ended it early
            print(f"stopped at step {summary.get('steps')} of {summary.get('num_steps')}; resume with "
                  f"`postrain up --resume {folder}`", flush=True)
    return 0

