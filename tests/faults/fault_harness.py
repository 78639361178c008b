"""The fault-injection harness: a real `postrain up` on a tiny config, a fault at a seeded moment of a
named phase, and the checks every case makes afterwards.

    run = FaultRun.start(tmp_path, seed=7)         # `python -m postrain.cli up --quiet --config ...`
    run.wait_phase("rl")                           # the run's own output, metrics rows, files
    run.kill("learner")                            # SIGKILL the role's current process
    run.wait()                                     # the head's exit, with a deadline
    run.check_finished()                           # ledger balanced, checkpoint loads, nothing left

Phases are found from what the run itself writes, never from sleeps: its progress lines
(stdout), `metrics.jsonl` rows (`sft`, `train`, `eval`), the learner's temporary checkpoint
folder (`.checkpoint.tmp-*`) and the head's status (each actor's pid and load, asked over
ZeroMQ as `postrain status` does). The only sleeps are the seeded random delays that place
a fault at a random moment inside a phase (chaos, not a wait for a process) and polling
intervals under a deadline.

Leftovers: a watcher thread records every descendant of the head (with its start time, so
a reused pid is not mistaken for one of ours) while the run lives; after it ends none of
them may be alive, no process may name the run folder on its command line, and /dev/shm
may hold no `postrain-PID-*` segment of any of them.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import psutil

from postrain.actors.orchestrator.ledger import read_events
from postrain.cli.control import ask_head
from postrain.core.control import STATUS
from postrain.cli.up import default_config_path
from postrain.core.testing import to_toml

ROLES = ("sandbox", "generator", "learner", "env", "orchestrator")
PHASES = ("startup", "sft", "rl", "eval", "checkpoint", "shutdown")
RUN_NAME = "faults"
RUN_DEADLINE_S = 400.0       # a whole tiny run, faults and restarts included, on a loaded 2-core machine
PHASE_DEADLINE_S = 300.0     # reaching one phase
LEFTOVER_DEADLINE_S = 30.0   # PDEATHSIG kills and the head's clean-up are asynchronous


class PhaseMissed(AssertionError):
    """The run moved past the phase (or ended) before the fault could land in it."""


# ----------------------------------------------------------------------------- the tiny config


def tiny_config(run_dir: Path, **orchestrator) -> dict:
    """The built-in default run (actors/configs/default.toml) shrunk to a tiny fast one: 1-digit
    sums, a few SFT and RL steps, a few evaluation tasks, one sandbox worker, no memory
    reservations, generous restart budgets."""
    doc = tomllib.loads(default_config_path().read_text())
    doc["run"].update(name=RUN_NAME, run_dir=str(run_dir))
    doc["shared"]["task_options"] = {"include_instructions": False, "max_digits": 1, "max_operands": 2}
    doc["head"].update(heartbeat_interval_s=0.5, heartbeat_timeout_s=120.0)
    small = {"sandbox": {"num_workers": 1}, "generator": {"kv_cache_mb": 16, "max_num_seqs": 16},
             "orchestrator": {"num_steps": 4, "prompts_per_step": 2, "samples_per_prompt": 2, "max_staleness": 1,
                              "sft_steps": 4, "sft_batch_size": 4, "num_eval_tasks": 6,
                              "eval_samples_per_task": 0, "checkpoint_every": 2,
                              "sampling": {"temperature": 1.0, "max_new_tokens": 24}, **orchestrator}}
    for actor in doc["actors"]:
        actor.update(memory_mb=0, max_restarts=10, restart_backoff_s=0.05)
        actor["options"] = {**actor.get("options", {}), **small.get(actor["name"], {})}
    return doc


# ----------------------------------------------------------------------------- one run


@dataclass
class FaultRun:
    """One `postrain up` under test and what the harness saw of it."""

    tmp: Path
    config: dict
    rng: random.Random
    head: subprocess.Popen | None = None
    lines: list[str] = field(default_factory=list)       # stdout, as it arrives
    errors: list[str] = field(default_factory=list)      # stderr, as it arrives
    seen: dict[int, float] = field(default_factory=dict)  # pid -> create_time of every descendant seen
    faults: list[str] = field(default_factory=list)      # what was done, for messages and reports
    outputs: list[str] = field(default_factory=list)     # earlier heads' stdout + stderr (a resume)
    where: str = "-"                                     # the phase of the last fault, as placed
    _done: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(cls, tmp: Path, seed: int, run_dir: Path | None = None, head: dict | None = None,
              **orchestrator) -> "FaultRun":
        config = tiny_config(run_dir or tmp / "runs", **orchestrator)
        config["head"].update(head or {})
        run = cls(tmp=tmp, config=config, rng=random.Random(seed))
        (tmp / "run.toml").write_text(to_toml(config))
        run._launch(["up", "--quiet", "--config", str(tmp / "run.toml")])
        return run

    @property
    def folder(self) -> Path:
        return Path(self.config["run"]["run_dir"]) / RUN_NAME

    @property
    def options(self) -> dict:
        return next(a for a in self.config["actors"] if a["name"] == "orchestrator")["options"]

    def _launch(self, args: list[str]) -> None:
        """Start a head (a new session, so a failed test can kill what is left) and its readers."""
        if self.head is not None:
            self.outputs.append("".join(self.lines) + "".join(self.errors))
        self.lines, self.errors, self._done = [], [], threading.Event()
        self.head = subprocess.Popen([sys.executable, "-m", "postrain.cli", *args], cwd=self.tmp, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        for stream, sink in ((self.head.stdout, self.lines), (self.head.stderr, self.errors)):
            threading.Thread(target=_read_lines, args=(stream, sink), daemon=True).start()
        threading.Thread(target=self._watch_descendants, args=(self.head, self._done), daemon=True).start()

    def _watch_descendants(self, head: subprocess.Popen, done: threading.Event) -> None:
        """Record every process below the head while it lives (polls; the head's own exit ends it)."""
        try:
            root = psutil.Process(head.pid)
            self.seen[head.pid] = root.create_time()
        except psutil.NoSuchProcess:
            return
        while head.poll() is None and not done.is_set():
            try:
                for child in root.children(recursive=True):
                    try:
                        self.seen.setdefault(child.pid, child.create_time())
                    except psutil.NoSuchProcess:
                        pass
            except psutil.NoSuchProcess:
                return
            time.sleep(0.05)

    # -- reading the run ---------------------------------------------------------

    def output(self) -> str:
        return "".join(self.outputs) + "".join(self.lines) + "".join(self.errors)

    def tail(self, n: int = 60) -> str:
        return "".join(self.lines[-n:]) + "--- stderr ---\n" + "".join(self.errors[-n:])

    def has_line(self, pattern: str) -> bool:
        return any(re.search(pattern, line) for line in list(self.lines))

    def rows(self, kind: str) -> list[dict]:
        """Complete metrics rows of `kind` (a line being written is skipped)."""
        path = self.folder / "metrics.jsonl"
        rows = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if row.get("kind") == kind:
                    rows.append(row)
        return rows

    def until(self, predicate, what: str, timeout_s: float = PHASE_DEADLINE_S, interval_s: float = 0.05):
        """Poll `predicate` until it returns something true; PhaseMissed when the head exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = predicate()
            if got:
                return got
            if self.head.poll() is not None:
                got = predicate()
                if got:
                    return got
                raise PhaseMissed(f"the run ended before {what} (exit {self.head.returncode}):\n{self.tail()}")
            time.sleep(interval_s)
        raise AssertionError(f"no {what} within {timeout_s} s:\n{self.tail()}")

    def status(self) -> dict | None:
        """The head's status (`postrain status --json`), or None while it cannot answer."""
        if not (self.folder / "head.json").exists():
            return None
        try:
            return anyio.run(ask_head, str(self.folder), STATUS, backend="trio").to_wire()
        except (SystemExit, Exception):
            return None

    def actor(self, name: str) -> dict | None:
        status = self.status()
        return next((a for a in status["actors"] if a["name"] == name), None) if status else None

    def pid_of(self, name: str) -> int:
        """The role's current pid (starting or running) from the head's status."""
        def current():
            actor = self.actor(name)
            return actor["pid"] if actor and actor["pid"] and actor["state"] in ("starting", "running") else None
        return self.until(current, f"a live {name} process", interval_s=0.05)

    # -- faults ------------------------------------------------------------------

    def kill(self, name: str, sig: int = signal.SIGKILL, pid: int | None = None) -> int:
        pid = pid or self.pid_of(name)
        ready = self.has_line(rf"started {name} \(pid {pid}\)")
        os.kill(pid, sig)
        self.faults.append(f"{signal.Signals(sig).name} {name} (pid {pid}, {'after' if ready else 'before'} "
                           f"READY) in {self.where}")
        return pid

    def pause(self, low_s: float, high_s: float) -> None:
        """A seeded random moment: chaos, not a wait for a process."""
        time.sleep(self.rng.uniform(low_s, high_s))

    def wait_phase(self, phase: str) -> str:
        """Block until the run is inside `phase`, at a seeded random moment of it; returns a note
        on where exactly (for messages)."""
        self.where = getattr(self, f"_enter_{phase}")()
        return self.where

    def _enter_startup(self) -> str:
        """Start-up: from `postrain up` until the driver's first line. Any role: some time after
        its process appears (it may be importing, loading its model, or READY already)."""
        self.until(lambda: (self.folder / "head.json").exists(), "head.json")
        return "startup"

    def enter_startup_of(self, name: str) -> int:
        """The pid of `name` at a seeded moment of its start (0..1.5 s after it was spawned)."""
        self._enter_startup()
        pid = self.pid_of(name)
        self.pause(0.0, 1.5)
        if self.has_line("evaluating the initial policy"):
            raise PhaseMissed(f"start-up was over before {name} could be killed:\n{self.tail()}")
        self.where = "startup"
        return pid

    def _enter_sft(self) -> str:
        k = self.rng.randint(1, self.options["sft_steps"] - 1)
        self.until(lambda: len(self.rows("sft")) >= k, f"SFT step {k}", interval_s=0.02)
        if len(self.rows("sft")) >= self.options["sft_steps"]:
            raise PhaseMissed(f"the warm start was over before the fault:\n{self.tail()}")
        return f"sft after step {len(self.rows('sft'))}/{self.options['sft_steps']}"

    def _enter_rl(self) -> str:
        k = self.rng.randint(1, self.options["num_steps"] - 1)
        self.until(lambda: len(self.rows("train")) >= k, f"RL step {k}", interval_s=0.02)
        self.pause(0.0, 0.5)
        return f"rl after step {len(self.rows('train'))}/{self.options['num_steps']}"

    def _enter_eval(self) -> str:
        """An evaluation under way: the one before training or the one after the warm start
        (seeded; the next one when the run is past it), 0-0.1 s after its start line, checked
        to be still running (its accuracy line not yet printed)."""
        evals = [("before", r"evaluating the initial policy"),
                 ("after the warm start", rf"sft step {self.options['sft_steps']}/")]
        first = self.rng.randrange(len(evals))
        for which, start in evals[first:]:
            self.until(lambda: self.has_line(start), f"the evaluation {which}", interval_s=0.005)
            self.pause(0.0, 0.1)
            if not self.has_line(f"held-out accuracy {which}"):
                return f"eval {which}"
        raise PhaseMissed(f"every evaluation ended before the fault could land in one:\n{self.tail()}")

    def _enter_checkpoint(self) -> str:
        """A checkpoint being written: its temporary folder exists (polled every millisecond);
        the k-th one seen (seeded) is the moment."""
        k = self.rng.randint(1, 2)
        seen = 0
        while True:
            self.until(self._checkpoint_tmp, f"checkpoint write {seen + 1}", interval_s=0.001)
            seen += 1
            if seen >= k:
                return "checkpoint write"
            self.until(lambda: not self._checkpoint_tmp(), "the checkpoint's rename", interval_s=0.001)

    def _checkpoint_tmp(self) -> bool:
        try:
            return any(n.startswith(".checkpoint.tmp-") for n in os.listdir(self.folder))
        except FileNotFoundError:
            return False

    def _enter_shutdown(self) -> str:
        """The head is stopping its actors (after the summary); returns once it says so."""
        self.until(lambda: self.has_line(r"^\{"), "the summary", interval_s=0.01)
        return "shutdown"

    def pids_now(self) -> dict[str, int]:
        status = self.status() or {"actors": []}
        return {a["name"]: a["pid"] for a in status["actors"] if a.get("pid")}

    # -- the end -----------------------------------------------------------------

    def wait(self, timeout_s: float = RUN_DEADLINE_S) -> int:
        try:
            return self.head.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the run did not end within {timeout_s} s:\n{self.tail()}") from None
        finally:
            self._done.set()

    def resume(self) -> int:
        """`postrain up --quiet --resume RUN_DIR`, to its end."""
        self._launch(["up", "--quiet", "--resume", str(self.folder)])
        return self.wait()

    def close(self) -> None:
        """Whatever the test's outcome: no head or actor of this run outlives it."""
        if self.head is not None and self.head.poll() is None:
            try:
                os.killpg(self.head.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.head.wait(timeout=30)
        self._done.set()
        for pid, created in list(self.seen.items()):
            proc = _same_process(pid, created)
            if proc is not None:
                try:
                    proc.kill()
                except psutil.Error:
                    pass

    # -- the checks every case makes ---------------------------------------------

    def check_clean_exit(self, returncode: int, expect_ok: bool = True) -> None:
        """The head ended as a command should: no traceback; exit 0 when `expect_ok`, else a
        non-zero status with a one-line reason on stderr."""
        self.check_no_traceback()
        if expect_ok:
            assert returncode == 0, f"the run failed after {self.faults} (exit {returncode}):\n{self.tail()}"
        else:
            assert returncode != 0 and "".join(self.errors).strip(), \
                f"a stopped run says why on stderr (exit {returncode}):\n{self.tail()}"

    def check_no_traceback(self) -> None:
        """No exception reached the user: no traceback or exception group printed by the head
        (a log line quoting an actor's traceback inside a message is not one)."""
        shown = [line for line in self.output().splitlines()
                 if line.lstrip(" |+").startswith(("Traceback (most recent call last)", "Exception Group Traceback"))
                 or re.match(r"\s*\|?\s*(Base)?ExceptionGroup:", line)]
        assert not shown, f"an exception reached the user after {self.faults}:\n{self.tail()}"

    def check_finished(self) -> dict:
        """The run reached its end: summary, balanced ledger, every step trained once, a
        checkpoint that loads, readable files, nothing left behind."""
        summary = json.loads((self.folder / "summary.json").read_text())
        assert summary["steps"] == self.options["num_steps"], (summary, self.faults)
        check_ledger(self.folder, summary)
        learner = load_last_checkpoint(self.folder, self.config)
        assert learner.step == self.options["sft_steps"] + self.options["num_steps"], \
            f"every SFT and RL step applied once: step {learner.step} after {self.faults}"
        check_files(self.folder)
        self.check_nothing_left()
        return summary

    def check_nothing_left(self) -> None:
        leftovers = self.leftovers(LEFTOVER_DEADLINE_S)
        assert not leftovers, f"left behind after {self.faults}: {leftovers}"

    def leftovers(self, timeout_s: float) -> list[str]:
        """Processes and /dev/shm segments of this run still there after `timeout_s` (polled):
        the descendants the watcher saw, processes naming the run folder, `postrain-PID-*`
        segments of any of them, and what the kernel's own check finds by the run's tag
        (postrain.core.testing.leftovers)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [f"process {p.pid} {_command(p)!r}" for p in self._live_processes()]
            found += [f"/dev/shm/{name}" for name in self._segments()]
            tagged = _tagged_leftovers(self.folder)
            found += [f"process {p}" for p in tagged.processes if f"process {p.split()[0]} " not in " ".join(found)]
            found += [s for s in tagged.segments if f"/dev/shm/{Path(s).name}" not in found]
            if not found or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def _live_processes(self) -> list[psutil.Process]:
        live = {pid: p for pid, created in self.seen.items() if (p := _same_process(pid, created))}
        needle = str(self.folder)
        for p in psutil.process_iter(["cmdline"]):
            try:
                if p.pid != os.getpid() and needle in " ".join(p.info["cmdline"] or []) and p.status() != "zombie":
                    live.setdefault(p.pid, p)
            except psutil.Error:
                pass
        return list(live.values())

    def _segments(self) -> list[str]:
        if not os.path.isdir("/dev/shm"):
            return []
        prefixes = tuple(f"postrain-{pid}-" for pid in self.seen)
        return [n for n in os.listdir("/dev/shm") if prefixes and n.startswith(prefixes)]


def _tagged_leftovers(folder: Path):
    """Processes and segments carrying the run's tag (every actor and its children inherit it)."""
    from postrain.core.supervisor import run_tag_for
    from postrain.core.testing import leftovers

    return leftovers(run_tag_for(str(folder.resolve())))


def _command(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:120]
    except psutil.Error:   # gone, or a zombie, since it was listed
        return "?"


def _read_lines(stream, sink: list[str]) -> None:
    for line in stream:
        sink.append(line)
    stream.close()


def _same_process(pid: int, created: float) -> psutil.Process | None:
    """The live process `pid` if it is the one created at `created` (not a reuse), not a zombie."""
    try:
        p = psutil.Process(pid)
        if abs(p.create_time() - created) < 0.01 and p.status() != psutil.STATUS_ZOMBIE:
            return p
    except psutil.Error:   # gone (a zombie included)
        pass
    return None


def check_ledger(folder: Path, summary: dict) -> None:
    """created == in_flight + trained + dropped, nothing in flight, and the events file agrees."""
    ledger = summary["ledger"]
    assert ledger["created"] == ledger["in_flight"] + ledger["trained"] + ledger["dropped"], ledger
    assert ledger["in_flight"] == 0, ledger
    events = read_events(folder / "ledger.jsonl")
    created = {e["sample_id"] for e in events if e["event"] == "created"}
    ended = [e["sample_id"] for e in events if e["event"] in ("trained", "dropped")]
    assert len(ended) == len(set(ended)), "a sample trained or dropped twice"
    assert set(ended) == created, f"samples created but never trained or dropped: {sorted(created - set(ended))}"


def check_files(folder: Path) -> None:
    """Every line of the ledger and metrics files is whole JSON."""
    for name in ("ledger.jsonl", "metrics.jsonl"):
        for number, line in enumerate((folder / name).read_text().splitlines(), 1):
            try:
                json.loads(line)
            except json.JSONDecodeError:
                raise AssertionError(f"{name} line {number} is not whole: {line[:120]!r}") from None


def load_last_checkpoint(folder: Path, config: dict):
    """A learner from the run's last checkpoint (raises if it does not load)."""
    from postrain.actors.learner.learner import Learner, LearnerConfig

    learner_options = next(a for a in config["actors"] if a["name"] == "learner")["options"]["learner"]
    learner = Learner(LearnerConfig.from_dict({**learner_options, "model": config["shared"]["model"]}))
    learner.load_checkpoint(str(folder / "checkpoint"))
    return learner


# ----------------------------------------------------------------------------- a full disk


def fill_disk(folder: Path, leave_bytes: int) -> Path:
    """Fill the file system of `folder` (a small tmpfs: tests/conftest.py `small_disk`) until
    `leave_bytes` are free, with one filler file; returns its path (unlink it to make room)."""
    filler = folder / "filler"
    stat = os.statvfs(folder)
    remaining = max(0, stat.f_bavail * stat.f_frsize - leave_bytes)
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb") as f:
        while remaining > 0:
            remaining -= f.write(chunk[:min(len(chunk), remaining)])
    return filler
