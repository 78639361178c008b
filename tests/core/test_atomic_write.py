"""Checkpoint writes under fault: a writer killed mid-write (SIGKILL, a real child process) or
refused by a full disk (a real tmpfs) leaves the previous checkpoint whole and loadable. Whatever
the umask, a checkpoint's folders are 0700 and its files 0600, a file written here has its mode
from its creation, and a private folder that existed looser is tightened.

Each child saves checkpoint A (extra {"mark": "A"}, step 0), then starts checkpoint B
(step 7) and stops at a chosen point inside the write, says so on stdout, and waits to
be killed there.
"""
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from postrain.core import atomic_write
from postrain.core.atomic_write import (make_private_folder, repair_interrupted_write, write_file_atomically,
                                        write_folder_atomically)
from postrain.actors.learner.learner import Learner, LearnerConfig
from postrain.actors.orchestrator.run_state import read_run_state
from postrain.core.errors import DiskFullError, PostrainError

LEARNER = {"model": "tiny", "lr": 1e-3}

CHILD = textwrap.dedent('''
    import os, sys, time
    from postrain.core import atomic_write
    from postrain.actors.learner import state as learner_state
    from postrain.actors.learner.learner import Learner, LearnerConfig
    from postrain.actors.records import RunState

    def run_state(next_batch):      # the mark of checkpoint A (1) or B (2)
        return RunState(phase="rl", next_batch=next_batch, evals={}, ledger={}, ledger_events_offset=0,
                        metrics_offset=0, data_order={}).to_wire()

    folder, stop_at = sys.argv[1], sys.argv[2]
    learner = Learner(LearnerConfig.from_dict({"model": "tiny", "lr": 1e-3}))
    learner.save_checkpoint(folder, extra=run_state(1))

    def stop(where):
        print(where, flush=True)
        time.sleep(600)

    if stop_at == "files":          # inside the writing of B's files: the weights are written, not the rest
        real_save = learner_state.save_file
        def save_file(tensors, path, metadata=None):
            real_save(tensors, path, metadata=metadata)
            stop("mid-write")
        learner_state.save_file = save_file
    else:                           # the two-rename fallback, between its renames
        atomic_write.enable_exchange = False
        real_rename = os.rename
        def rename(src, dst):
            real_rename(src, dst)
            if ".old-" in str(dst):
                stop("between renames")
        atomic_write.os.rename = rename
    learner.counter.restore(step=7, policy_version=7)
    learner.save_checkpoint(folder, extra=run_state(2))
    print("B written", flush=True)
''')


def kill_inside_a_write(folder, stop_at: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(folder), stop_at], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().strip()
        assert line in ("mid-write", "between renames"), (line, child.stderr.read()[-2000:])
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()


def load(folder) -> tuple[dict, int]:
    learner = Learner(LearnerConfig.from_dict(LEARNER))
    extra = learner.load_checkpoint(folder)
    return extra, learner.step


@pytest.mark.parametrize("stop_at", ["files", "renames"])
def test_a_writer_killed_inside_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path, stop_at):
    folder = tmp_path / "run" / "checkpoint"
    kill_inside_a_write(folder, stop_at)
    leftovers = {p.name.split("-")[0] for p in folder.parent.iterdir() if p.name.startswith(".")}
    if stop_at == "files":
        assert leftovers == {".checkpoint.tmp"} and folder.exists(), "the kill left its hidden folder"
    else:   # the old one renamed aside, the new one not yet in: no checkpoint under its name
        assert leftovers == {".checkpoint.tmp", ".checkpoint.old"} and not folder.exists()
    assert read_run_state(folder).next_batch == 1, "the run state reads the previous checkpoint (A)"
    extra, step = load(folder)
    assert extra["next_batch"] == 1 and step == 0
    assert [p.name for p in folder.parent.iterdir()] == ["checkpoint"], "repaired: nothing hidden is left"


def test_a_full_disk_inside_a_checkpoint_write_leaves_the_previous_one_and_names_the_folder(small_disk):
    folder = small_disk(10 * 1024) / "checkpoint"   # room for one tiny checkpoint (6.3 MB), not for two
    learner = Learner(LearnerConfig.from_dict(LEARNER))
    learner.save_checkpoint(folder, extra={"mark": "A"})
    learner.counter.restore(step=7, policy_version=7)
    with pytest.raises(DiskFullError, match=f"disk full writing {folder} .*MiB free.*free space"):
        learner.save_checkpoint(folder, extra={"mark": "B"})
    assert [p.name for p in folder.parent.iterdir()] == ["checkpoint"], "the half-written one is removed"
    extra, step = load(folder)
    assert extra["mark"] == "A" and step == 0


def test_the_fallback_without_an_exchange_replaces_a_folder_whole(tmp_path, monkeypatch):
    folder = tmp_path / "policy"
    write_folder_atomically(folder, lambda tmp: (tmp / "a").write_text("1"))
    monkeypatch.setattr(atomic_write, "enable_exchange", False)
    write_folder_atomically(folder, lambda tmp: (tmp / "a").write_text("2"))
    assert (folder / "a").read_text() == "2" and [p.name for p in tmp_path.iterdir()] == ["policy"]
    repair_interrupted_write(tmp_path / "never-written")   # nothing to repair: no error


@pytest.fixture
def open_umask():
    """The most permissive umask for the test (0o000), the previous one restored after."""
    previous = os.umask(0o000)
    yield
    os.umask(previous)


def modes(folder) -> dict[str, int]:
    """Permission bits of `folder` and of everything under it, by path relative to its parent."""
    found = {folder.name: stat.S_IMODE(folder.stat().st_mode)}
    for path in folder.rglob("*"):
        found[str(path.relative_to(folder.parent))] = stat.S_IMODE(path.lstat().st_mode)
    return found


def test_a_checkpoints_folders_and_files_are_private_whatever_the_umask(tmp_path, open_umask):
    folder = tmp_path / "checkpoint"
    folder.mkdir(mode=0o755)                 # an earlier checkpoint, written under a looser mode
    Learner(LearnerConfig.from_dict(LEARNER)).save_checkpoint(folder, extra={"mark": "A"})
    found = modes(folder)
    assert {"checkpoint/model.safetensors", "checkpoint/state.json"} <= set(found)
    assert found == {path: 0o700 if (tmp_path / path).is_dir() else 0o600 for path in found}
    write_folder_atomically(folder, lambda tmp: ((tmp / "sub").mkdir(), (tmp / "sub" / "f").write_text("1")))
    assert modes(folder) == {"checkpoint": 0o700, "checkpoint/sub": 0o700, "checkpoint/sub/f": 0o600}


def test_a_file_is_put_in_place_whole_with_its_mode_from_its_creation(tmp_path, open_umask, monkeypatch):
    path = tmp_path / "head.json"
    path.write_text("old")
    os.chmod(path, 0o644)

    def widened(*args, **kwargs):
        raise AssertionError("a mode set after creation: the file was readable by others in between")
    monkeypatch.setattr(os, "chmod", widened)
    monkeypatch.setattr(os, "fchmod", widened)
    assert write_file_atomically(path, b"secret", mode=0o600) == path
    assert path.read_bytes() == b"secret" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["head.json"], "no hidden file is left"


def test_a_private_folder_is_made_0700_tightened_where_looser_and_refused_where_not_ours(
        tmp_path, open_umask):
    made = make_private_folder(tmp_path / "runs" / "new")
    assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "runs").stat().st_mode) == 0o777, "only the folder itself is private"
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    make_private_folder(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    if os.geteuid() != 0:
        pytest.skip("giving a folder to another user takes root")
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o755)
    os.chown(foreign, 54321, 54321)          # another local user's folder
    with pytest.raises(PostrainError, match=f"{foreign} is owned by uid 54321.*private to this user"):
        make_private_folder(foreign)
    assert stat.S_IMODE(foreign.stat().st_mode) == 0o755, "left as it was"
