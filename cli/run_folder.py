"""The run folder and the config of `postrain up`, before any process starts.

    config, doc = read_up_config(path, sets)          # the file with its --set overrides, checked
    check_run_folder_unused(config, overwrite)        # a folder holding a run is refused
    print_sizing(size(config))                        # what the model sizes (actors/configs/sizing.py)
    folder = prepare_run_folder(config)               # created private, writable, with disk to spare
    write_run_config(folder, path, sets, doc)         # config.toml as run
    config = resume_config(run_folder, sets)          # `--resume`: the run's own config

cli/up.py runs the head over what this module prepared.
"""
from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from postrain.actors.configs.run_config import add_import_dir, parse_up_config, run_import_dir
from postrain.core.atomic_write import make_private_folder
from postrain.core.config import read_toml
from postrain.core.errors import PostrainError
from postrain.core.shm import process_lives

from .config import UpConfig
from .overrides import parse_override, set_path

if TYPE_CHECKING:
    from postrain.actors.configs.sizing import RunSizing

MIN_FREE_DISK_MB = 200


def prepare_run_folder(config: UpConfig) -> Path:
    """Create and check the run folder before anything starts: a clear error now, not at step 500."""
    folder = Path(config.run.run_dir) / config.run.name
    try:
        for path in (folder, folder / "logs"):  # the run's user only: logs, checkpoints, secrets
            make_private_folder(path)
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


# What a run writes into its folder (the actors, the head, the trackers): `--overwrite` deletes
# these and nothing else; any of RUN_MARKERS means the folder holds a run.
RUN_FILES = ("config.toml", "source.json", "head.json", "summary.json", "*.jsonl", "logs", "checkpoint",
             "policy", "plots", "report.html", "tensorboard", "mlruns", "wandb", ".checkpoint*", ".policy*")
RUN_MARKERS = ("config.toml", "summary.json", "metrics.jsonl", "ledger.jsonl", "checkpoint", "policy")


def check_run_folder_unused(config: UpConfig, overwrite: bool) -> Path:
    """The run folder of `config`; PostrainError when it holds a run (one of RUN_MARKERS) that
    `overwrite` does not allow replacing, or whose head still lives."""
    folder = Path(config.run.run_dir) / config.run.name
    held = [name for name in RUN_MARKERS if (folder / name).exists()]
    if not held:
        return folder
    pid = _live_head_pid(folder)
    if pid is not None:
        raise PostrainError(f"the run in {folder} is still going (head pid {pid}); stop it with "
                            f"`postrain down {folder}` first, or choose another [run] name or --run-dir")
    if not overwrite:
        raise PostrainError(f"run folder {folder} already holds a run ({', '.join(held)}); continue it "
                            f"with `postrain up --resume {folder}`, start it over with --overwrite (deletes "
                            "its files), or choose another [run] name or --run-dir")
    return folder


def clear_run_folder(folder: Path) -> list[str]:
    """Delete the files a run wrote into `folder` (RUN_FILES); the names deleted."""
    removed = []
    for pattern in RUN_FILES:
        for path in sorted(folder.glob(pattern)):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path.name)
    return removed


def _live_head_pid(folder: Path) -> int | None:
    """The pid of the head of the run in `folder` while it lives (its head.json), else None."""
    try:
        pid = json.loads((folder / "head.json").read_text()).get("pid")
    except (OSError, ValueError):
        return None
    return pid if pid and process_lives(pid) else None


# What `--set` may change on `--resume` (this start only): nothing that the run's data order, model
# or checkpoint depend on. Sections of the head, and fields of an [[actors]] entry.
RESUMABLE_SECTIONS = ("head", "balancer", "tracking")
RESUMABLE_FIELDS = ("cpus", "memory_mb", "start_timeout_s", "stop_timeout_s", "max_restarts", "restart_backoff_s")


def read_up_config(path: Path, sets: list[str], import_dir: Path | None = None,
                   resuming: bool = False) -> tuple[UpConfig, dict]:
    """The run config at `path` with the `--set KEY=VALUE` overrides applied, checked as the file
    alone is (ConfigError naming every bad field), and its document. `import_dir` (default: the
    config's folder) goes on the import path; `resuming`: PostrainError for an override that
    RESUMABLE_SECTIONS and RESUMABLE_FIELDS do not allow."""
    doc = read_toml(path)
    for item in sets:
        key, value = parse_override(item)
        where = set_path(doc, key, value)
        head, last = key.split(".")[0], key.split(".")[-1]
        if resuming and not (where == "section" and head in RESUMABLE_SECTIONS
                             or where == "actor" and last in RESUMABLE_FIELDS):
            raise PostrainError(f"--set {key} with --resume: a resumed run keeps the options it started with "
                                "(its data order and checkpoint depend on them); only "
                                f"{', '.join(RESUMABLE_SECTIONS)} settings and an actor's "
                                f"{', '.join(RESUMABLE_FIELDS)} may change; start a new run to change the rest")
    add_import_dir(path.parent if import_dir is None else import_dir)
    return parse_up_config(doc, f"{path} with --set {' '.join(sets)}" if sets else str(path)), doc


def resume_config(run_folder: Path, sets: Sequence[str] = ()) -> UpConfig:
    """The config of the run in `run_folder` (with the `--set` overrides RESUMABLE_* allow, for this
    start only), pointed at that folder; refuses a run whose head lives."""
    path = run_folder / "config.toml"
    if not path.exists():
        raise PostrainError(f"{run_folder} holds no config.toml; --resume takes the folder of a run "
                            "that `postrain up` started (run_dir/name)")
    head = run_folder / "head.json"
    if head.exists():
        pid = json.loads(head.read_text()).get("pid")
        if pid and process_lives(pid):
            raise PostrainError(f"the run in {run_folder} is still going (head pid {pid}); stop it with "
                                f"`postrain down {run_folder}` before resuming it")
    config, _ = read_up_config(path, list(sets), import_dir=run_import_dir(run_folder), resuming=True)
    config.run.run_dir, config.run.name = str(run_folder.resolve().parent), run_folder.resolve().name
    if not config.run.driver:
        raise PostrainError(f"{path} names no [run] driver; only a driven run (an orchestrator) can resume")
    return config


# The roles that hold a model; a run of other classes is not sized (nor is torch imported for it).
MODEL_ROLE_MODULES = ("postrain.actors.generator.actor", "postrain.actors.learner.actor")


def size(config: UpConfig) -> RunSizing | None:
    """Fill in what `config` leaves to the model's sizing (actors/configs/sizing.py), where one of
    its actors holds a model: the config check imported every actor class, so a generator or
    learner (or a subclass) among them has its role's module loaded by now."""
    if not any(name in sys.modules for name in MODEL_ROLE_MODULES):
        return None
    from postrain.actors.configs.sizing import size_run
    return size_run(config)


def print_sizing(sizing: RunSizing | None) -> None:
    """What the config left to `postrain up` and it derived from the model, one line per actor."""
    if sizing is not None:
        print(f"postrain up: sized from {sizing.model} (unset or \"auto\" fields; docs/your-model.md#sizing):")
        for line in sizing.lines():
            print(f"  {line}")


def write_run_config(folder: Path, path: Path, sets: list[str], doc: dict) -> None:
    """The run folder's config.toml: the file as written, or with `--set` its document as run."""
    if not sets:
        shutil.copyfile(path, folder / "config.toml")
        return
    from postrain.core.testing import to_toml
    header = f"# {path} with --set {' '.join(sets)} (written by postrain up)\n"
    (folder / "config.toml").write_text(header + to_toml(doc))
