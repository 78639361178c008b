"""The runner's contract, warm and cold: outputs, inputs, files, errors, audit, trio."""
from __future__ import annotations

import threading
import time

import pytest
import trio

from postrain.sandbox import (PolicyError, Sandbox, SandboxError, Status, code_sha256,
                              read_audit_log)


def test_ok_with_stdin_files_and_argv(sandbox):
    code = "import sys\nprint(input()[::-1], open('data/x.txt').read(), sys.argv[1:])\n"
    result = sandbox.run(code, stdin=b"abc\n", files={"data/x.txt": b"file"}, argv=["--k", "v"])
    assert result.status is Status.OK, result.stderr
    assert result.stdout == b"cba file ['--k', 'v']\n"
    assert result.exit_code == 0 and result.signal is None and result.mode == sandbox.mode
    assert result.wall_s > 0 and result.cpu_s > 0


def test_exit_code_and_exception(sandbox):
    assert sandbox.run("import sys; sys.exit(7)").exit_code == 7
    result = sandbox.run("def f():\n    raise KeyError('boom')\nf()\n")
    assert result.status is Status.NONZERO_EXIT and result.exit_code == 1
    assert b"KeyError: 'boom'" in result.stderr and b'File "/work/main.py", line 2' in result.stderr
    assert sandbox.run("print(").status is Status.NONZERO_EXIT  # a SyntaxError is the code's fault
    assert b"<string>" not in result.stderr  # no frame of the sandbox's own start-up code
    assert sandbox.run("exit(5)").exit_code == 5  # the site builtins exist without site hooks


def test_threads_and_subprocesses_work(sandbox):
    code = ("import subprocess, threading\nout = []\nt = threading.Thread(target=out.append, args=(1,))\n"
            "t.start(); t.join()\n"
            "print(out, subprocess.run(['/bin/echo', 'x'], capture_output=True).stdout)\n")
    result = sandbox.run(code)
    assert result.status is Status.OK and result.stdout == b"[1] b'x\\n'\n", result.stderr


def test_site_packages_are_importable(sandbox):
    result = sandbox.run("import msgpack, numpy\nprint(numpy.arange(3).sum())\n")
    assert result.status is Status.OK and result.stdout == b"3\n", result.stderr


def test_large_stdin_and_output_under_the_cap(sandbox):
    data = b"y" * 200_000
    result = sandbox.run("import sys\nd = sys.stdin.buffer.read()\nprint(len(d))\n", stdin=data)
    assert result.stdout == b"200000\n"


def test_stderr_flood_is_truncated_too(sandbox, small_policy):
    result = sandbox.run("import sys\nwhile True:\n    sys.stderr.write('e' * 4096)\n")
    assert result.status is Status.OUTPUT_TRUNCATED and result.stderr_truncated
    assert len(result.stderr) == small_policy.max_output_bytes


@pytest.mark.parametrize("name", ["/etc/passwd", "../up", "a/../../b", "main.py", "sp ace"])
def test_unsafe_file_names_are_refused(sandbox, name):
    with pytest.raises(PolicyError, match="is not allowed"):
        sandbox.run("pass", files={name: b"x"})


def test_unknown_language_is_refused(warm_sandbox):
    with pytest.raises(PolicyError, match="lang must be one of"):
        warm_sandbox.run("int main(){}", lang="c")


def test_warm_policy_may_change_limits_only(warm_sandbox, small_policy):
    assert warm_sandbox.run("print(1)", policy=small_policy.replace(wall_time_s=3)).ok
    with pytest.raises(PolicyError, match="may change limits only"):
        warm_sandbox.run("print(1)", policy=small_policy.replace(enable_network=True))


def test_missing_nsjail_is_a_sandbox_error(monkeypatch, small_policy):
    monkeypatch.setenv("POSTRAIN_NSJAIL", "/bin/false")
    with Sandbox(small_policy, mode="cold") as cold:
        result = cold.run("print(1)")
    assert result.status is Status.SANDBOX_ERROR and "nsjail" in result.error
    with pytest.raises(SandboxError, match="warm worker did not start"):
        Sandbox(small_policy, mode="warm")


def test_a_dead_worker_fails_its_run_and_is_restarted(small_policy, host_sandbox_pids):
    with Sandbox(small_policy.replace(wall_time_s=5), mode="warm") as sandbox:
        worker = sandbox._pool.workers[0]
        started = threading.Event()
        results = []

        def slow_run():
            started.set()
            results.append(sandbox.run("import time\ntime.sleep(4)\n"))

        thread = threading.Thread(target=slow_run)
        thread.start()
        started.wait()
        deadline = time.monotonic() + 4
        while not host_sandbox_pids() and time.monotonic() < deadline:
            pass  # the code is running once a process of the sandbox uid exists
        worker._proc.kill()  # the zygote's jail dies mid-run
        thread.join()
        assert results[0].status is Status.SANDBOX_ERROR
        assert worker.num_restarts == 1
        assert sandbox.run("print('back')").stdout == b"back\n"


def test_audit_log_records_every_run(tmp_path, small_policy):
    log = tmp_path / "audit.jsonl"
    with Sandbox(small_policy, mode="warm", audit_log=log) as sandbox:
        sandbox.run("print(1)", requester="env-3")
        sandbox.run("import sys; sys.exit(2)", stdin=b"in", files={"f": b"x"}, requester="cli")
    first, second = read_audit_log(log)
    assert first["requester"] == "env-3" and first["status"] == "ok" and first["mode"] == "warm"
    assert first["sha256"] == code_sha256("print(1)")
    assert second["status"] == "nonzero_exit" and second["exit_code"] == 2
    assert second["sha256"] == code_sha256("import sys; sys.exit(2)", b"in", {"f": b"x"})
    assert second["policy"]["memory_mb"] == small_policy.memory_mb
    assert {"wall_s", "cpu_s", "queued_s", "stdout_bytes"} <= set(first)


def test_arun_from_trio_runs_many(small_policy):
    async def main():
        with Sandbox(small_policy, mode="warm", num_workers=2) as sandbox:
            results = [None] * 5

            async def one(i):
                results[i] = await sandbox.arun(f"print({i} * {i})")

            async with trio.open_nursery() as nursery:
                for i in range(5):
                    nursery.start_soon(one, i)
            return results

    results = trio.run(main)
    assert [r.stdout for r in results] == [f"{i * i}\n".encode() for i in range(5)]


def test_output_streams_as_it_arrives(sandbox):
    chunks = []
    code = "import sys\nfor i in range(3):\n    print(i, flush=True)\n    print('e', file=sys.stderr)\n"
    result = sandbox.run(code, on_output=lambda name, data: chunks.append((name, data)))
    assert result.status is Status.OK
    assert b"".join(d for n, d in chunks if n == "stdout") == result.stdout == b"0\n1\n2\n"
    assert b"".join(d for n, d in chunks if n == "stderr") == result.stderr == b"e\ne\ne\n"


def test_resize_grows_at_once_and_retires_a_busy_worker_when_its_run_ends(small_policy):
    with Sandbox(small_policy.replace(wall_time_s=5), mode="warm", num_workers=1) as sandbox:
        assert sandbox.resize(2) == 2 and len(sandbox._pool.workers) == 2
        started = [threading.Event(), threading.Event()]
        results = []

        def slow(index):
            results.append(sandbox.run("import time; print('go', flush=True); time.sleep(1); print(1)",
                                       on_output=lambda name, data: started[index].set()))
        threads = [threading.Thread(target=slow, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        assert all(event.wait(timeout=30) for event in started), "both workers are busy"
        sandbox.resize(1)  # no idle worker: the first to finish its run is closed then
        assert sandbox.num_workers == 1 and len(sandbox._pool.workers) == 2
        for thread in threads:
            thread.join(timeout=30)
        assert [r.status for r in results] == [Status.OK, Status.OK]
        assert len(sandbox._pool.workers) == 1, "the surplus worker closed when its run ended"
        assert sandbox.run("print(3)").stdout == b"3\n"
    with pytest.raises(PolicyError, match="num_workers must be >= 1, got 0"):
        Sandbox(small_policy, mode="cold").resize(0)
