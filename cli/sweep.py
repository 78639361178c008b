"""`postrain sweep --config C --seeds 0-9 [--set KEY=V1,V2 ...] [--parallel N] [--resume] [--target ACC]`: one
run config over seeds x overrides, and the spread of what it gives.

Each combination of the `--set` values and each seed is one `postrain up` run, in its own folder
under the sweep folder (`--sweep-dir`, default runs/sweep-<config name>), one after another or
`--parallel N` at once. The seed goes to the config's [shared] seed (every role that declares
it: the model's init, the data order, the sampling). When they have ended, every run's
summary.json goes into one table, min / median / max over the seeds of each accuracy, RL's own
gain, wall time, and the count of collapses (cli/sweep_table.py), printed, written to
sweep.json, and drawn in sweep.png (one dot per run). `--target 0.6`: how many runs reached
held-out accuracy 0.6, and at which RL step and after how many RL seconds.

--set KEY=V1,V2: KEY is a dotted path into the config, as for `postrain up --set` (cli/overrides.py):
a section and its key (`shared.seed`, `run.name`), an actor's name and a field of its entry
(`learner.cpus`) or one of its options (`orchestrator.num_steps`); an option table named like its
actor may be skipped, so `learner.rl_lr` is `learner.learner.rl_lr`, the learner actor's
LearnerConfig. Values are TOML (1e-4, "gspo", true, a table: '{ max_digits = 3, min_operands = 2 }');
a comma inside a table, an array or a string belongs to the value. Several --set: every combination. Every
run's config is checked before the first starts.

--resume continues a sweep: runs with a summary.json of a complete run are kept, an unfinished
run (stopped in its warm start or before its last RL step) continues from its checkpoint
(`postrain up --resume`) or starts over, the rest run. Ctrl-C (SIGINT) or SIGTERM
(`kill`, a job scheduler's stop) stops the runs in flight cleanly (each `postrain up` gets one
SIGINT: it finishes its step and checkpoints), writes sweep.json with what finished, and exits 130;
a second signal is passed on too (the runs stop at once, still cleaning up). The sweep exits only
after every run it started.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from postrain.core.errors import PostrainError

from .overrides import OverrideError, set_path, toml_value
from .sweep_table import PLOT_FILE, build_table, collapsed, format_table, plot_spread, target_figures

HELP = "run one config over several seeds and overrides; the spread of the results"
SWEEP_FILE = "sweep.json"


class SweepError(PostrainError, ValueError):
    """A sweep's arguments or folder are not usable."""


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="TOML run config (default: the built-in run)")
    parser.add_argument("--seeds", default="0-4", help="seeds: 0-9, 0,3,7 or 0-4,9 (default 0-4)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2",
                        help="an override and its values, e.g. learner.rl_lr=1e-4,3e-4 (repeatable)")
    parser.add_argument("--parallel", type=int, default=1, help="runs at once (default 1)")
    parser.add_argument("--sweep-dir", help="the sweep's folder (default: runs/sweep-<config name>)")
    parser.add_argument("--resume", action="store_true", help="continue the sweep in its folder")
    parser.add_argument("--target", type=float, metavar="ACC",
                        help="held-out accuracy to time: each run's first step (and RL seconds) at or above it")


def parse_seeds(text: str) -> list[int]:
    """'0-9', '0,3,7', '0-4,9' -> sorted distinct seeds; SweepError naming the bad part."""
    seeds: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise SweepError(f"--seeds: {part!r} is not a seed or a range; write e.g. 0-9 or 0,3,7")
        seeds.update(range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1))
    return sorted(seeds)


def parse_sets(items: list[str]) -> list[tuple[str, list]]:
    """['learner.rl_lr=1e-4,3e-4'] -> [('learner.rl_lr', [0.0001, 0.0003])]."""
    out = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise SweepError(f"--set {item!r}: write KEY=V1,V2, e.g. learner.rl_lr=1e-4,3e-4")
        out.append((key.strip(), sweep_values(values)))
    return out


def sweep_values(text: str) -> list:
    """'1e-4,3e-4' -> [0.0001, 0.0003]; a comma inside a TOML table, array or string does not
    separate values ('{ a = 1, b = 2 }' is one table); bare words are strings ('gspo,cispo')."""
    try:
        return tomllib.loads(f"v = [{text}]")["v"]
    except tomllib.TOMLDecodeError:
        return [toml_value(v) for v in text.split(",")]


def run_name(overrides: dict, seed: int) -> str:
    """A [run] name (a letter first, letters, digits, _ and -, at most 40): seed3_rl_lr-0p0001."""
    label = "".join(f"_{k.split('.')[-1]}-{v}" for k, v in overrides.items())
    name = re.sub(r"[^A-Za-z0-9_-]", "_", f"seed{seed}{label}".replace(".", "p"))
    if len(name) > 40:   # distinct still: a digest of the whole label
        name = f"{name[:31]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


def plan_runs(config_path: Path, seeds: list[int], sets: list[tuple[str, list]], sweep_dir: Path) -> list[dict]:
    """Every run of the sweep: its name, seed, overrides and config document (checked here)."""
    from postrain.actors.configs.run_config import add_import_dir, parse_up_config

    add_import_dir(config_path.resolve().parent)   # modules the config names may sit beside it
    base = tomllib.loads(config_path.read_text())
    runs = []
    for combo in itertools.product(*[values for _, values in sets]):
        overrides = {key: value for (key, _), value in zip(sets, combo)}
        for seed in seeds:
            doc = json.loads(json.dumps(base))
            for key, value in overrides.items():
                set_path(doc, key, value)
            name = run_name(overrides, seed)
            doc.setdefault("shared", {})["seed"] = seed
            doc.setdefault("run", {}).update(name=name, run_dir=str(sweep_dir))
            try:
                parse_up_config(doc, f"{config_path} with {overrides or 'no overrides'}, seed {seed}")
            except PostrainError as exc:
                raise SweepError(" ".join(line.strip() for line in str(exc).splitlines() if line.strip())) from None
            runs.append({"name": name, "seed": seed, "overrides": overrides, "doc": doc,
                         "folder": str(sweep_dir / name)})
    return runs


def _command(run: dict, config_file: Path) -> list[str]:
    folder = Path(run["folder"])
    up = [sys.executable, "-m", "postrain.cli", "up", "--quiet"]
    if (folder / "checkpoint").exists() and (folder / "config.toml").exists():
        return up + ["--resume", str(folder)]
    return up + ["--config", str(config_file)] + (["--overwrite"] if folder.exists() else [])


def _start(run: dict, sweep_dir: Path, import_dir: Path) -> subprocess.Popen:
    from postrain.core.testing import to_toml

    config_file = sweep_dir / "_configs" / f"{run['name']}.toml"
    config_file.parent.mkdir(parents=True, exist_ok=True)
    config_file.write_text(to_toml(run["doc"]))
    log = (sweep_dir / "_logs").joinpath(f"{run['name']}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(import_dir), os.environ.get("PYTHONPATH")]))}
    with log.open("a") as out:   # the child keeps its own copy of the descriptor
        return subprocess.Popen(_command(run, config_file), stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)   # Ctrl-C reaches the sweep, which forwards one SIGINT


def _finish(run: dict, code: int) -> None:
    folder = Path(run["folder"])
    summary_file = folder / "summary.json"
    run["exit_code"] = code
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else None
    if summary is not None and summary.get("complete", True):
        run["summary"] = summary
        run["status"] = "finished"
        run["collapsed"] = collapsed(summary, folder)
    else:   # no summary, or one from a run stopped before its last step: not in the table
        stopped = code in (130, -signal.SIGINT) or summary is not None
        run["status"] = "interrupted" if stopped else "failed"
    print(f"sweep: {run['name']}: {run['status']} (exit {code}, log {Path(run['folder']).parent / '_logs' / run['name']}.log)",
          flush=True)


def execute(runs: list[dict], parallel: int, sweep_dir: Path, import_dir: Path) -> bool:
    """Run the pending runs, `parallel` at once. Returns False when interrupted.

    SIGINT and SIGTERM only append to `signals`: the loop reads it between its own steps, so a
    signal never lands inside a run's start (an exception there would leave a child running that
    the sweep no longer tracks). Each signal is passed on as one SIGINT to every run in flight (the
    runs are in sessions of their own, so only the sweep can stop them): the first stops a
    `postrain up` after its step, with a checkpoint; a second stops it at once, still cleaning up.
    No run starts after the first signal, and the sweep returns only when every run it started
    has exited."""
    pending = [r for r in runs if r["status"] != "finished"]
    running: list[tuple[dict, subprocess.Popen]] = []
    signals: list[int] = []
    passed_on = 0
    previous = {s: signal.signal(s, lambda signum, frame: signals.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while running or (pending and not signals):
            while pending and not signals and len(running) < parallel:
                run = pending.pop(0)
                print(f"sweep: {run['name']}: started", flush=True)
                running.append((run, _start(run, sweep_dir, import_dir)))
            while passed_on < len(signals):
                passed_on += 1
                for _, proc in running:
                    if proc.poll() is None:
                        proc.send_signal(signal.SIGINT)
            still = []
            for run, proc in running:
                code = proc.poll()
                if code is None:
                    still.append((run, proc))
                else:
                    _finish(run, code)
            if len(still) == len(running):
                time.sleep(0.2)
            running = still
        return not signals
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def write_sweep(sweep_dir: Path, config_path: Path, runs: list[dict], interrupted: bool,
                target: float | None = None) -> dict:
    for run in runs:
        if target is not None and run.get("summary") is not None:
            run["target_figures"] = target_figures(Path(run["folder"]), target)
    table = build_table(runs, target)
    plot = plot_spread(table, runs, sweep_dir / PLOT_FILE)
    doc = {"config": str(config_path), "interrupted": interrupted, "plot": str(plot) if plot else None,
           "table": table, "runs": [{k: v for k, v in r.items() if k != "doc"} for r in runs]}
    tmp = sweep_dir / (SWEEP_FILE + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    tmp.replace(sweep_dir / SWEEP_FILE)
    return doc


def main(args) -> int:
    from postrain.actors.configs.run_config import default_config_path

    try:
        if args.parallel < 1:
            raise SweepError(f"--parallel must be >= 1, got {args.parallel}")
        config_path = Path(args.config) if args.config else default_config_path()
        if not config_path.is_file():
            raise SweepError(f"--config {config_path}: no such file")
        sweep_dir = Path(args.sweep_dir or Path("runs") / f"sweep-{config_path.stem}").resolve()
        if (sweep_dir / "_configs").exists() and not args.resume:
            raise SweepError(f"{sweep_dir} already holds a sweep; pass --resume to continue it, or choose "
                             "another --sweep-dir")
        runs = plan_runs(config_path, parse_seeds(args.seeds), parse_sets(args.set), sweep_dir)
    except (SweepError, OverrideError) as exc:
        raise SystemExit(f"postrain sweep: {exc}") from None
    sweep_dir.mkdir(parents=True, exist_ok=True)
    for run in runs:
        run["status"] = "pending"
        if args.resume and (Path(run["folder"]) / "summary.json").exists():
            _finish(run, 0)
    print(f"sweep: {len(runs)} runs in {sweep_dir} ({sum(r['status'] == 'finished' for r in runs)} already "
          f"finished), {args.parallel} at once", flush=True)
    completed = execute(runs, args.parallel, sweep_dir, config_path.resolve().parent)
    doc = write_sweep(sweep_dir, config_path, runs, interrupted=not completed, target=args.target)
    for line in format_table(doc["table"]):
        print(line)
    print(f"wrote {sweep_dir / SWEEP_FILE}" + (f" and {doc['plot']}" if doc["plot"] else ""))
    if not completed:
        print("sweep interrupted: `postrain sweep ... --resume` continues it", file=sys.stderr)
        return 130
    return 0 if all(r["status"] == "finished" for r in runs) else 1
