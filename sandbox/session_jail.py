"""Session jails: one nsjail per session, running the session agent, and a pool of spares.

Design note. A session is a whole nsjail of its own (`SessionJail`: its own user, PID, mount, IPC,
UTS and network namespaces, its own cgroup caps on memory and processes, its own tmpfs /work of
`work_dir_size_mb`), running the session agent (`_session_agent.py`); closing it ends the nsjail
process, and with it every process, mount and file of the session. Sessions never share a jail,
so one cannot see another. Starting a jail costs tens of milliseconds, so a `SessionPool` keeps
spare jails started ahead for each jail shape in use (the session-wide limits and the network
routes are fixed when a jail starts); opening a session takes a spare and background threads
start its replacement.
"""
from __future__ import annotations

import atexit
import functools
import os
import py_compile
import shutil
import tempfile
import threading
import time
from collections import OrderedDict

from .netproxy import NetworkProxy
from .policy import SANDBOX_UID, Policy, SandboxError, nsjail_argv, python_flags, site_paths
from .warm import JailedAgent, jailed_source

_AGENT_SOURCE = jailed_source("_session_agent.py")
_AGENT_DIR, _AGENT_MODULE = "/run/postrain-agent", "postrain_session_agent"
_AGENT_MEMORY_MB = 48    # the agent and its helpers, on top of the session's memory_mb in the cgroup
_AGENT_PROCESSES = 8     # the agent, the forwarder, one call's launcher and init, a file helper
_MAX_SHAPES = 4          # jail shapes the pool keeps spares for (the most recently used)


_IMAGE_PREFIX = "postrain-image-"


def remove_orphan_images() -> None:
    """Remove the image folders (`image_mounts`) of processes no longer running (killed, so their
    atexit removal never ran)."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = name[len(_IMAGE_PREFIX):].partition("-")[0]
        if not (name.startswith(_IMAGE_PREFIX) and pid.isdigit()):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except PermissionError:   # alive, another user's
            pass


@functools.lru_cache(maxsize=1)
def image_mounts() -> tuple[str, ...]:
    """nsjail flags for what every session jail sees beside the read-only host mounts: in /etc the
    host's /etc/alternatives (symlinks that Debian tools such as awk go through) and a
    passwd/group that name the sandbox user, nothing else of the host's /etc; and the agent as a
    module with its bytecode compiled here (at /run/postrain-agent, read-only), which saves every
    jail start compiling it. The files live in a temp folder named by this process's pid, removed
    when it exits; a killed process's folder is removed by the next process that makes one."""
    remove_orphan_images()
    folder = tempfile.mkdtemp(prefix=f"{_IMAGE_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, folder, True)
    os.chmod(folder, 0o755)
    agent_dir = os.path.join(folder, "agent")
    os.mkdir(agent_dir, 0o755)
    agent = os.path.join(agent_dir, f"{_AGENT_MODULE}.py")
    with open(agent, "w") as f:
        f.write(_AGENT_SOURCE)
    py_compile.compile(agent, doraise=True)  # for the host's Python; another one compiles in memory
    for root, dirs, names in os.walk(agent_dir):
        for name in dirs + names:
            os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)
    files = {"passwd": f"root:x:0:0::/:/bin/false\nsandbox:x:{SANDBOX_UID}:{SANDBOX_UID}::/work:/bin/bash\n",
             "group": f"root:x:0:\nsandbox:x:{SANDBOX_UID}:\n"}
    flags = []
    for name, text in files.items():
        path = os.path.join(folder, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, 0o644)
        flags += ["--bindmount_ro", f"{path}:/etc/{name}"]
    if os.path.isdir("/etc/alternatives"):
        flags += ["--bindmount_ro", "/etc/alternatives"]
    flags += ["--bindmount_ro", f"{agent_dir}:{_AGENT_DIR}"]
    return tuple(flags)


def _bash() -> str:
    for path in ("/bin/bash", "/usr/bin/bash"):
        if os.path.exists(path):
            return path
    raise SandboxError("bash not found at /bin/bash or /usr/bin/bash; sessions run commands with "
                       "bash; fix: install bash on the host")


class SessionJail(JailedAgent):
    """One nsjail running the session agent, started ahead (spare) and used by one session."""

    what = "session jail"

    def __init__(self, policy: Policy, shape: tuple[int, int, int]) -> None:
        super().__init__(policy)
        self.shape = shape
        self.proxy = NetworkProxy(policy.network_allow) if policy.network_allow else None
        try:
            self.start()
        except BaseException:
            self._close_proxy()
            raise

    def _argv(self) -> list[str]:
        memory_mb, max_processes, work_dir_size_mb = self.shape
        extra = ["--mount", "none:/run/postrain:tmpfs:size=4194304,mode=0777", *image_mounts()]
        if self.proxy is not None:
            extra += self.proxy.nsjail_mounts()
        argv = nsjail_argv(self.policy, cold=False, work_dir_size_mb=work_dir_size_mb, extra=tuple(extra),
                           memory_cap_mb=memory_mb + work_dir_size_mb + _AGENT_MEMORY_MB,
                           pids_cap=max_processes + _AGENT_PROCESSES)
        boot = f"import sys; sys.path.insert(0, {_AGENT_DIR!r}); import {_AGENT_MODULE}"
        return argv + [self.policy.python, *python_flags(self.policy), "-c", boot, *site_paths(self.policy)]

    def _config(self) -> dict:
        return {"uid": SANDBOX_UID, "gid": SANDBOX_UID, "env": dict(self.policy.env),
                "bash": _bash(), "python": self.policy.python,
                "routes": self.proxy.routes() if self.proxy is not None else []}

    def request(self, req: dict, timeout_s: float) -> dict:
        """One request and its reply; OSError/TimeoutError/EOFError when the jail is gone."""
        if self._proc is None:
            raise EOFError("the session's jail is closed")
        self._send(req)
        return self._recv(time.monotonic() + timeout_s)

    def terminate(self) -> None:
        """Signal the jail to end now (safe from another thread while a request waits)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()

    def close(self) -> None:
        self._kill()  # nothing of a session is kept: no graceful exit to wait for
        self._close_proxy()

    def _close_proxy(self) -> None:
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None


class SessionPool:
    """Spare session jails per shape, so that opening a session takes a started jail.

    `num_spare` background threads keep `num_spare` spares for each of the `_MAX_SHAPES` most
    recently asked shapes (a start is mostly the jail's Python starting, so starts overlap
    well). Invariants (under _lock): every jail in _spares is started and unused;
    len(_spares[shape]) + _starting[shape] <= num_spare."""

    def __init__(self, policy: Policy, num_spare: int = 2) -> None:
        self.policy = policy
        self.num_spare = num_spare
        self._spares: OrderedDict[tuple, list[SessionJail]] = OrderedDict()
        self._lock = threading.Condition()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._starting: dict[tuple, int] = {}  # jails being started per shape
        self._retiring: list[threading.Thread] = []  # used jails being reaped
        self.num_cold_starts = 0  # sessions that found no spare

    def take(self, shape: tuple) -> SessionJail:
        """A started jail of `shape`: a spare if there is one, else one started now."""
        with self._lock:
            if self._closed:
                raise SandboxError("the sandbox is closed; fix: open sessions before closing it")
            spares = self._want(shape)
            jail = spares.pop() if spares else None
            self._lock.notify_all()
        if jail is None:
            self.num_cold_starts += 1
            jail = SessionJail(self.policy, shape)
        return jail

    def num_spares(self, shape: tuple) -> int:
        """Started jails of `shape` waiting for a session now."""
        with self._lock:
            return len(self._spares.get(shape, ()))

    def prewarm(self, shape: tuple) -> None:
        """Start keeping spares of `shape` (in the background)."""
        with self._lock:
            self._want(shape)
            self._lock.notify_all()

    def _want(self, shape: tuple) -> list[SessionJail]:
        spares = self._spares.setdefault(shape, [])
        self._spares.move_to_end(shape)
        while len(self._spares) > _MAX_SHAPES:
            _, dropped = self._spares.popitem(last=False)
            threading.Thread(target=_close_all, args=(dropped,), daemon=True).start()
        while len(self._threads) < self.num_spare:
            thread = threading.Thread(target=self._refill, name="session-pool", daemon=True)
            thread.start()
            self._threads.append(thread)
        return spares

    def _refill(self) -> None:
        while True:
            with self._lock:
                shape = None
                while not self._closed:
                    shape = next((s for s, jails in reversed(self._spares.items())
                                  if len(jails) + self._starting.get(s, 0) < self.num_spare), None)
                    if shape is not None:
                        break
                    self._lock.wait()
                if self._closed:
                    return
                assert shape is not None  # not closed: the loop above broke on a shape
                self._starting[shape] = self._starting.get(shape, 0) + 1
            try:
                jail = SessionJail(self.policy, shape)
            except SandboxError:
                jail = None
            with self._lock:
                self._starting[shape] -= 1
            if jail is None:
                time.sleep(1.0)  # the host is short of something; the next take starts one itself
                continue
            with self._lock:
                if self._closed or shape not in self._spares:
                    jail.close()
                else:
                    self._spares[shape].append(jail)

    def retire(self, jail: SessionJail) -> None:
        """End a used jail: signalled now, reaped in the background (nsjail's teardown of the
        jail's cgroups takes milliseconds that its session's caller need not wait for); `close`
        waits for every retiring jail."""
        jail.terminate()
        thread = threading.Thread(target=jail.close, name="session-retire", daemon=True)
        with self._lock:
            self._retiring = [t for t in self._retiring if t.is_alive()] + [thread]
        thread.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spares = [jail for jails in self._spares.values() for jail in jails]
            self._spares.clear()
            self._lock.notify_all()
            retiring = list(self._retiring)
        for thread in self._threads + retiring:
            thread.join(timeout=30)
        _close_all(spares)


def _close_all(jails) -> None:
    for jail in jails:
        jail.close()
