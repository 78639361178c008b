"""Sessions in real nsjail: state that persists across calls, limits per call and per session,
isolation between sessions, the trio face and the audit log."""
from __future__ import annotations

import os
import random
import subprocess
import tempfile

import psutil
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from postrain.sandbox import (PolicyError, Sandbox, SessionClosed, SessionFileError, SessionLimits,
                              Status, read_audit_log)
from postrain.sandbox.session_jail import remove_orphan_images

LIMITS = SessionLimits(call_wall_time_s=3.0, call_cpu_time_s=2, call_max_output_bytes=4096,
                       memory_mb=128, max_processes=24, work_dir_size_mb=4, max_file_size_mb=2,
                       session_wall_time_s=60.0, max_calls=40)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, small_policy):
    audit = tmp_path_factory.mktemp("audit") / "audit.jsonl"
    with Sandbox(small_policy, mode="cold", audit_log=audit, num_spare_sessions=1) as sb:
        sb.prewarm_sessions(LIMITS)
        yield sb


def test_files_cwd_and_exported_environment_persist(sandbox):
    with sandbox.session(files={"repo/app.py": b"VALUE = 41\n", "notes.txt": "hello"}, limits=LIMITS) as s:
        assert s.run("cat notes.txt").stdout == b"hello"
        assert s.run("cd repo && export MODE=fast && LOCAL=1").ok
        result = s.run("pwd; echo $MODE; echo \"[$LOCAL]\"; ls")
        assert result.stdout == b"/work/repo\nfast\n[]\napp.py\n"          # not exported: not kept
        assert s.run("sed -i 's/41/42/' app.py && echo done > ../out.txt").ok
        python = s.run_python("import os, app; print(os.getcwd(), os.environ['MODE'], app.VALUE)")
        assert python.ok and python.stdout == b"/work/repo fast 42\n", python.stderr
        assert s.read_file("out.txt") == b"done\n" and s.read_file("/work/repo/app.py") == b"VALUE = 42\n"
        assert s.write_file("deep/new/file.txt", b"x" * 10) == 10
        assert s.run("cat /work/deep/new/file.txt; stat -c %u /work/deep/new/file.txt").stdout == b"x" * 10 + b"1000\n"
        assert s.run("echo in | cat -", stdin=b"ignored").stdout == b"in\n"
        assert s.run("cat", stdin="from stdin").stdout == b"from stdin"
        assert s.run("exit 7").exit_code == 7 and s.run("pwd").stdout == b"/work/repo\n"
        assert s.num_calls == 13


def test_exported_values_of_any_bytes_persist_exactly(sandbox):
    """Whatever bytes a variable holds (quotes, backslashes, newlines, control and non-UTF-8
    bytes), the next bash call and the next Python call see exactly them; unset goes too."""
    rng = random.Random(18)
    values = [b"", b"it's", b'q"u$o`t\\e', b"a\nb\n", b"\\n\\0\\x", b"$'x'", b"\x7f\x80\xff\t\x01",
              b'declare -x Y="z"\n', "naïve ✓".encode()]
    values += [bytes(rng.randrange(1, 256) for _ in range(rng.randrange(1, 40))) for _ in range(20)]
    files = {f"v{i}": value for i, value in enumerate(values)}
    with sandbox.session(files=files, limits=LIMITS) as s:
        assert s.run(f'for i in $(seq 0 {len(values) - 1}); do X="$(cat v$i; echo .)"; '
                     f'export "X$i=${{X%.}}"; done; export GONE=1').ok
        assert s.run("unset GONE").ok
        assert s.run(f'for i in $(seq 0 {len(values) - 1}); do n=X$i; printf %s "${{!n}}" > o$i; done').ok
        assert [s.read_file(f"o{i}") for i in range(len(values))] == values
        python = s.run_python("import os; print({k: v for k, v in os.environb.items() if k[:1] in b'XG'})")
        assert eval(python.stdout) == {f"X{i}".encode(): value for i, value in enumerate(values)}


def test_the_working_directory_follows_files_written_between_calls(sandbox):
    with sandbox.session(limits=LIMITS) as s:
        assert s.run("mkdir d && cd d && rm -r /work/d").ok   # its cwd is gone: the next call starts in /work
        s.write_file("d/x.txt", b"back")                       # and it is back before that call
        assert s.run("pwd; cat x.txt").stdout == b"/work/d\nback"


def test_file_errors_and_bad_paths(sandbox):
    with sandbox.session(limits=LIMITS) as s:
        with pytest.raises(SessionFileError, match="'missing.txt' failed .*No such file"):
            s.read_file("missing.txt")
        s.run("mkdir d && mkfifo d/fifo")
        with pytest.raises(SessionFileError, match="is a directory"):
            s.read_file("d")
        with pytest.raises(SessionFileError, match="not a regular file"):
            s.read_file("d/fifo")
        for bad in ("/etc/passwd", "../x", "a/../../x", ""):
            with pytest.raises(PolicyError, match="under /work|non-empty"):
                s.read_file(bad)
        with pytest.raises(SessionFileError, match="exceed max_file_size_mb=2"):
            s.write_file("big", b"x" * (3 << 20))
        with pytest.raises(PolicyError, match="timeout_s must be a finite number > 0"):
            s.run("true", timeout_s=-1)
    with pytest.raises(PolicyError, match="unknown session limit"):
        sandbox.session(limits={"memory": 1})
    with pytest.raises(PolicyError, match="SessionLimits.max_calls must be a finite number > 0"):
        SessionLimits(max_calls=0)


def test_a_timed_out_call_ends_its_processes_and_keeps_the_earlier_state(sandbox):
    with sandbox.session(limits=LIMITS) as s:
        s.run("mkdir a && cd a && export KEEP=1")
        result = s.run("cd / && export KEEP=2 && sleep 30", timeout_s=0.5)
        assert result.status is Status.TIMEOUT
        assert s.run("pwd; echo $KEEP").stdout == b"/work/a\n1\n"
        s.run("(sleep 30; echo late > /work/late.txt) & echo started")
        probe = s.run_python("import os\nprint(sorted(p for p in range(1, 4096) if os.path.exists(f'/proc/{p}')))")
        assert s.run("sleep 0.3; ls /work").stdout == b"a\n"   # the background job died with its call
        assert probe.ok


def test_per_call_output_cpu_and_memory_limits(sandbox):
    with sandbox.session(limits=LIMITS) as s:
        flood = s.run("yes")
        assert flood.status is Status.OUTPUT_TRUNCATED and len(flood.stdout) == 4096
        spin = s.run("while :; do :; done", timeout_s=30)  # the shell started ahead holds the CPU limit
        assert spin.status is Status.TIMEOUT and spin.signal == 9
        assert 1.5 <= spin.cpu_s < 5 and spin.wall_s < 30
        memory = s.run_python("x = bytearray(400 * 1024 * 1024)")
        assert memory.status is Status.MEMORY_LIMIT
        assert s.run("echo alive").stdout == b"alive\n"


def test_session_wide_limits_end_the_session(sandbox):
    with sandbox.session(limits={"max_calls": 2}) as s:
        s.run("true")
        s.run("true")
        with pytest.raises(SessionClosed, match=r"\(max_calls\).*raise SessionLimits.max_calls") as info:
            s.run("true")
        assert info.value.reason == "max_calls" and s.closed
    with sandbox.session(limits={"session_wall_time_s": 1.0, "call_wall_time_s": 5.0}) as s:
        assert s.run("sleep 3").status is Status.TIMEOUT   # cut at the session's end, not the call's
        with pytest.raises(SessionClosed) as info:
            s.run("true")
        assert info.value.reason == "session_wall_time_s"
    s = sandbox.session(limits=LIMITS)
    s.close()
    with pytest.raises(SessionClosed, match=r"\(closed\)"):
        s.run("true")
    s = sandbox.session(limits=LIMITS)
    s.close("reaped")        # as the sandbox actor's reaper closes an idle session: the fix names its option
    with pytest.raises(SessionClosed, match=r"\(reaped\); fix: .*raise it in its options"):
        s.run("true")


def test_a_full_disk_fails_writes_and_the_session_recovers(sandbox):
    with sandbox.session(limits=LIMITS) as s:
        fill = s.run("i=0; while dd if=/dev/zero of=fill$i bs=1M count=1 2>/dev/null; do i=$((i+1)); done; "
                     "echo $i; touch x 2>&1; head -c 100000 /dev/zero > y")
        assert fill.status is Status.NONZERO_EXIT and b"No space left" in fill.stderr
        with pytest.raises(SessionFileError, match="No space left"):
            s.write_file("more.txt", b"y" * 100_000)
        assert s.run("rm fill* && echo ok > fine.txt && cat fine.txt").stdout == b"ok\n"


def test_sessions_never_see_each_other(sandbox, host_sandbox_pids):
    before = set(host_sandbox_pids())
    with sandbox.session(limits=LIMITS) as a, sandbox.session(limits=LIMITS) as b:
        a.run("echo secret > mine.txt && export TOKEN=a")
        assert b.run("ls -A /work; echo \"[$TOKEN]\"").stdout == b"[]\n"
        assert a.session_id != b.session_id
    left = []  # closing signals each jail at once; it is reaped in the background within milliseconds
    for pid in set(host_sandbox_pids()) - before:
        try:
            left.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    gone, alive = psutil.wait_procs(left, timeout=5)
    assert alive == []


def test_close_during_a_call_ends_it(sandbox):
    import threading
    s = sandbox.session(limits=LIMITS)
    results = []
    thread = threading.Thread(target=lambda: results.append(_catch(lambda: s.run("sleep 20"))))
    thread.start()
    while not s.in_call:
        pass
    s.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and isinstance(results[0], SessionClosed)


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        return exc


def test_asession_in_trio(sandbox):
    async def main():
        async with sandbox.asession(files={"in.txt": b"3\n"}, limits=LIMITS) as s:
            await s.run("export N=$(cat in.txt)")
            result = await s.run_python("import os; print(int(os.environ['N']) * 2)")
            await s.write_file("out.txt", result.stdout)
            return await s.read_file("out.txt"), s.session.closed
        
    data, closed_inside = trio.run(main)
    assert data == b"6\n" and not closed_inside


def test_audit_records_sessions_and_calls(sandbox):
    with sandbox.session(limits=LIMITS, requester="env-7") as s:
        s.run("echo hi")
        s.run("exit 2")
    entries = [e for e in read_audit_log(sandbox.audit.path) if e.get("session_id") == s.session_id]
    assert [e["kind"] for e in entries] == ["session_open", "session_call", "session_call", "session_close"]
    assert [e["status"] for e in entries[1:3]] == ["ok", "nonzero_exit"]
    assert entries[1]["stdout_bytes"] == 3 and len(entries[1]["sha256"]) == 64
    assert entries[-1]["num_calls"] == 2 and entries[-1]["reason"] == "closed"
    assert all(e["requester"] == "env-7" for e in entries)


def test_stateless_runs_refuse_an_allowlist(small_policy):
    with Sandbox(small_policy.replace(network_allow=("127.0.0.1:9",)), mode="cold") as sb:
        with pytest.raises(PolicyError, match="network_allow applies to sessions only"):
            sb.run("print(1)")


def test_the_task_image_has_the_usual_tools_and_no_host_etc(sandbox):
    with sandbox.session(files={"scores.txt": "a 1\nb 2\nc 4\n"}, limits=LIMITS) as s:
        result = s.run("awk '{s += $2} END {print s}' scores.txt | sed 's/7/seven/'; "
                       "sort -r scores.txt | head -1 | cut -d' ' -f1; grep -c . scores.txt; "
                       "whoami; echo ~; ls /etc")
        assert result.stdout == b"seven\nc\n3\nsandbox\n/work\nalternatives\ngroup\npasswd\n", result.stderr


def test_memory_is_capped_for_the_whole_session_not_only_per_process(sandbox):
    limits = {**LIMITS.to_dict(), "memory_mb": 160, "call_wall_time_s": 10.0}
    grab = "python3 -c 'a = bytearray(110 << 20); import time; time.sleep(1.5); print(\"done\")'"
    with sandbox.session(limits=limits) as s:
        alone = s.run(grab)
        assert alone.stdout == b"done\n", alone.stderr      # one fits under memory_mb
        together = s.run(f"{grab} & {grab} & {grab} & wait")
        assert together.stdout.count(b"done") < 3             # three do not fit in the session's cap
        assert s.run("echo still serving").stdout == b"still serving\n"


@given(st.text(alphabet="ab./", min_size=1, max_size=12))
def test_a_session_path_never_leaves_work(path):
    from postrain.sandbox.session import work_path
    try:
        relative = work_path(path)
    except PolicyError:
        return
    resolved = os.path.normpath(os.path.join("/work", relative))
    assert resolved.startswith("/work/") and ".." not in relative.split("/")


def test_a_killed_processs_image_folder_is_removed_by_the_next_process_that_makes_one(tmp_path, monkeypatch):
    """The session jails' image folder is removed at exit; a SIGKILLed process never runs that, so
    the next process removes the folders of pids no longer running, and no other folder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    names = [f"postrain-image-{dead.pid}-abc", f"postrain-image-{os.getpid()}-def", "postrain-image-xyz", "other"]
    for name in names:
        (tmp_path / name).mkdir()
    remove_orphan_images()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[1:])
