"""The sandbox extension of the Tinker server (postrain.actors.tinker.sandbox_runs, sandbox_client.py):
a loop that holds only the base URL and the key grades code in the server's real nsjail jails, a
timeout is reported and the server goes on, escapes are contained, the key is required, and past
sandbox_workers a run gets 429. Skipped, with nsjail's reason, where nsjail cannot run."""
import asyncio
import logging
import re
import threading

import httpx
import pytest

from postrain.actors.tinker import SandboxClient, TinkerAPIError, TinkerOptions
from postrain.sandbox import Policy, Sandbox, SandboxError, Status
from tinker_server import API_KEY, tinker_served

KEY = {"X-API-Key": API_KEY}
RUN = "/api/v1/postrain/sandbox/run"
OUTPUT_CAP = 4096
OPTIONS = TinkerOptions(sandbox_workers=1, sandbox_max_timeout_s=20, sandbox_max_output_bytes=OUTPUT_CAP)

SOLUTION_TESTS = """\
import json
from solution import add
cases = [((2, 3), 5), ((-1, 1), 0), ((10, 20), 30)]
passed = sum(add(*args) == want for args, want in cases)
print(json.dumps({"passed": passed, "total": len(cases)}))
assert passed == len(cases), f"{len(cases) - passed} case(s) failed"
"""


@pytest.fixture(scope="module", autouse=True)
def nsjail_runs():
    """Skip the module, with the reason, where nsjail cannot start a warm jail here."""
    try:
        with Sandbox(Policy(wall_time_s=10), mode="warm") as sandbox:
            probe = sandbox.run("print(1)")
    except SandboxError as exc:
        pytest.skip(f"nsjail cannot run here: {exc}")
    if probe.status is not Status.OK:
        pytest.skip(f"nsjail cannot run here: {probe.status}: {probe.error or probe.stderr.decode()[-300:]}")


@pytest.fixture(scope="module")
def graded(tiny_bases):
    """(base URL, TinkerService) of a server with one sandbox worker and a 4 KiB output cap."""
    with tinker_served(tiny_bases, OPTIONS) as out:
        yield out


def grade(client: SandboxClient, solution: str) -> float:
    """A loop's reward: 1.0 when every case passes in the jail, else 0.0 (the verdict read back)."""
    result = client.run(SOLUTION_TESTS, files={"solution.py": solution}, timeout_s=10)
    return 1.0 if result.exit_code == 0 and '"passed": 3' in result.stdout else 0.0


def test_a_loop_grades_a_correct_and_a_wrong_solution(graded):
    url, _ = graded
    with SandboxClient(url, API_KEY) as client:
        rewards = [grade(client, "def add(a, b):\n    return a + b\n"),
                   grade(client, "def add(a, b):\n    return a - b\n")]
        assert rewards == [1.0, 0.0]
        wrong = client.run(SOLUTION_TESTS, files={"solution.py": "def add(a, b):\n    return a * b\n"})
    assert wrong.status == "nonzero_exit" and wrong.exit_code == 1 and not wrong.timed_out
    assert '"passed": 0' in wrong.stdout and "AssertionError: 3 case(s) failed" in wrong.stderr
    echoed = asyncio.run(SandboxClient(url, API_KEY).arun("print(input()[::-1])", stdin="abc\n"))
    assert (echoed.status, echoed.stdout, echoed.exit_code) == ("ok", "cba\n", 0)


def test_the_client_reads_the_url_and_key_the_sdk_reads(graded, monkeypatch):
    monkeypatch.setenv("TINKER_BASE_URL", graded[0])
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    assert SandboxClient().run("print(6 * 7)").stdout == "42\n"


def test_a_timeout_is_reported_and_the_server_goes_on(graded):
    url, _ = graded
    with SandboxClient(url, API_KEY) as client:
        spin = client.run("while True:\n    pass\n", timeout_s=1)
        assert spin.timed_out and spin.status == "timeout" and spin.exit_code is None
        assert client.run("print('after')").stdout == "after\n"
        with pytest.raises(TinkerAPIError, match=r"timeout_s=30 is past the server's cap "
                                                 r"\(sandbox_max_timeout_s=20\).*--sandbox-max-timeout-s") as caught:
            client.run("print(1)", timeout_s=30)
        assert caught.value.status == 400


def test_output_past_the_cap_is_cut_there(graded):
    with SandboxClient(graded[0], API_KEY) as client:
        flood = client.run("import sys\nsys.stdout.write('x' * 100000)\n")
    assert flood.status == "output_truncated" and flood.stdout_truncated
    assert flood.stdout == "x" * OUTPUT_CAP


ESCAPES = {
    "read /etc/shadow": """
try:
    print("ESCAPED", open("/etc/shadow").read()[:40])
except OSError as exc:
    print("blocked", type(exc).__name__)
""",
    "read the server's files": """
import os
found = [p for p in PATHS if os.path.exists(p)]
print("ESCAPED" if found else "blocked", found, os.path.exists("/proc/self/environ"))
print("ESCAPED key" if any("KEY_TEXT" in v for v in os.environ.values()) else "blocked env", sorted(os.environ))
""",
    "connect to the server's port": """
import socket
for host in ("127.0.0.1", "localhost"):
    try:
        socket.create_connection((host, PORT), timeout=2).close()
        print("ESCAPED", host)
    except OSError as exc:
        print("blocked", host, type(exc).__name__)
""",
    "fork bomb": """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
""",
}


@pytest.mark.parametrize("attack", list(ESCAPES))
def test_code_that_tries_to_escape_is_contained_and_the_server_keeps_answering(graded, attack):
    url, service = graded
    port = int(url.rsplit(":", 1)[1])
    canary = service.state_dir / "server-secret.txt"
    canary.write_text("server state")
    import postrain.actors.tinker.service as server_module
    paths = [str(canary), server_module.__file__, __file__]
    code = (ESCAPES[attack].replace("PATHS", repr(paths)).replace("PORT", str(port))
            .replace("KEY_TEXT", API_KEY))
    with SandboxClient(url, API_KEY) as client:
        result = client.run(code, timeout_s=3)
        assert "ESCAPED" not in result.stdout, result
        if attack == "fork bomb":
            assert result.status in ("timeout", "killed_by_signal", "memory_limit"), result
        else:
            assert result.status == "ok" and "blocked" in result.stdout, result
        assert client.run("print('next')").stdout == "next\n"           # the jail's worker serves again
    with httpx.Client(base_url=url, headers=KEY) as http:               # and so does the Tinker API
        assert http.get("/api/v1/healthz").json() == {"status": "ok"}
        assert http.post("/api/v1/create_session", json={"tags": [], "user_metadata": {},
                                                         "sdk_version": "0.38.0"}).status_code == 200
    canary.unlink()


def test_a_missing_or_wrong_key_is_refused(graded):
    url, _ = graded
    with httpx.Client(base_url=url) as http:
        missing = http.post(RUN, json={"code": "print(1)"})
        wrong = http.post(RUN, json={"code": "print(1)"}, headers={"X-API-Key": "tml-not-this-one"})
    assert missing.status_code == 401 and "no API key was sent" in missing.json()["detail"]
    assert wrong.status_code == 401 and "the API key is not this server's" in wrong.json()["detail"]
    with pytest.raises(TinkerAPIError, match="the API key is not this server's") as caught:
        SandboxClient(url, "tml-not-this-one").run("print(1)")
    assert caught.value.status == 401


@pytest.mark.parametrize("body, status, message", [
    ({"files": {}}, 400, r"code: Field required"),
    ({"code": "print(1)", "files": {"../escape.py": "x"}}, 400, r"file name '\.\./escape\.py' is not allowed"),
    ({"code": "print(1)", "timeout_s": -1}, 400, r"timeout_s: Input should be greater than 0"),
    ({"code": "print(1)", "command": "ls"}, 400, r"command: Extra inputs are not permitted"),
])
def test_a_bad_request_is_refused_in_the_apis_shape(graded, body, status, message):
    with httpx.Client(base_url=graded[0], headers=KEY) as http:
        refused = http.post(RUN, json=body)
    assert refused.status_code == status
    assert refused.headers["content-type"] == "application/json"
    assert re.search(message, refused.json()["detail"]), refused.json()


class _Admitted(logging.Handler):
    """Sets `event` when the server admits a sandbox run (postrain.tinker, debug)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.event = threading.Event()

    def emit(self, record):
        if "sandbox run admitted" in record.getMessage():
            self.event.set()


def test_a_run_past_the_workers_gets_429_with_retry_after(graded):
    """One worker: while a run holds it, another is refused at once; the first still ends."""
    url, _ = graded
    logger, seen = logging.getLogger("postrain.tinker"), _Admitted()
    level = logger.level
    logger.addHandler(seen)
    logger.setLevel(logging.DEBUG)
    held: dict = {}
    holder = threading.Thread(target=lambda: held.update(result=SandboxClient(url, API_KEY, max_retries=0).run(
        "import time\ntime.sleep(60)\n", timeout_s=5)))
    try:
        holder.start()
        assert seen.event.wait(60), "the first run was never admitted"
        with httpx.Client(base_url=url, headers=KEY) as http:
            refused = http.post(RUN, json={"code": "print(1)"})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
        detail = refused.json()["detail"]
        assert "the most it runs at once (sandbox_workers=1)" in detail and "--sandbox-workers N" in detail
        with pytest.raises(TinkerAPIError, match=r"sandbox_workers=1") as caught:
            SandboxClient(url, API_KEY, max_retries=0).run("print(1)")
        assert caught.value.status == 429 and caught.value.retry_after_s == 5
    finally:
        holder.join(60)
        logger.removeHandler(seen)
        logger.setLevel(level)
    assert held["result"].timed_out
    assert SandboxClient(url, API_KEY).run("print('free again')").stdout == "free again\n"


def test_the_extension_off_answers_404_naming_the_option(tiny_bases):
    with tinker_served(tiny_bases, TinkerOptions(enable_sandbox=False)) as (url, _):
        with pytest.raises(TinkerAPIError, match=r"the sandbox extension is off on this server.*--no-sandbox") \
                as caught:
            SandboxClient(url, API_KEY).run("print(1)")
    assert caught.value.status == 404
