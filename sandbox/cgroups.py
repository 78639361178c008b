"""cgroup caps for jails: which cgroup version enforces a jail's memory and pids caps on this host,
and the nsjail flags that set them.

Design note. nsjail caps a jail's memory and number of processes through cgroups: v1 (one
hierarchy per controller, e.g. /sys/fs/cgroup/memory) or v2 (one unified hierarchy), one version
for all of a jail's caps (`--use_cgroupv2`). A controller attached to a v1 hierarchy is not
offered by v2 (a hybrid host lists it in no v2 `cgroup.controllers`), so `choose_cgroups` takes v1
where every wanted controller has a v1 hierarchy, else v2 where the unified hierarchy offers
every one, and otherwise REFUSES (`CgroupError`, which `nsjail_argv` raises as a `SandboxError`):
a policy that asks for caps (`enable_cgroups`, the default) never silently runs without them;
`Policy(enable_cgroups=False)` is the explicit way to. The choice is a pure function of the
mount table (`/proc/self/mountinfo`'s text) and of what the v2 root offers, so tests feed it any
host's layout. Per-jail groups are made by nsjail under a parent group `NSJAIL` (v1: in each
controller's hierarchy; v2: a child of the unified root with the controllers enabled for its
children), which this module creates.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Callable

from postrain.core.errors import PostrainError



class CgroupError(PostrainError, RuntimeError):
    """This host cannot enforce the cgroup caps a policy asks for; the message says why and the fix."""


CONTROLLERS = ("memory", "pids")  # what a policy's caps need
PARENT = "NSJAIL"                 # the parent group per-jail groups go in (nsjail's default name)


@dataclasses.dataclass(frozen=True)
class CgroupChoice:
    """How this host caps jails: `version` 1 or 2; `mounts`: controller -> the directory its
    parent group goes in (v1: that controller's hierarchy; v2: the unified hierarchy, the same
    for every controller)."""

    version: int
    mounts: dict[str, str]


def parse_mountinfo(text: str) -> tuple[dict[str, str], str | None]:
    """({controller: mount point} of the v1 hierarchies, mount point of the v2 hierarchy or None)
    from the text of a /proc/PID/mountinfo (first mount of each wins)."""
    v1: dict[str, str] = {}
    v2 = None
    for line in text.splitlines():
        head, sep, rest = line.partition(" - ")
        fields, tail = head.split(), rest.split()
        if not sep or len(fields) < 5 or len(tail) < 3:
            continue
        mount_point, fstype, super_options = _unescape(fields[4]), tail[0], tail[2].split(",")
        if fstype == "cgroup":
            for name in super_options:
                v1.setdefault(name, mount_point)
        elif fstype == "cgroup2" and v2 is None:
            v2 = mount_point
    return v1, v2


def _unescape(path: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        path = path.replace(code, char)
    return path


def _read_v2_controllers(mount: str) -> str:
    try:
        with open(os.path.join(mount, "cgroup.controllers")) as f:
            return f.read()
    except OSError:
        return ""


def choose_cgroups(mountinfo: str, wanted: tuple[str, ...] = CONTROLLERS,
                   v2_controllers: Callable[[str], str] = _read_v2_controllers) -> CgroupChoice:
    """The cgroup version that enforces every controller in `wanted` here, from the mount table
    `mountinfo`; `v2_controllers(mount)` returns the text of a v2 root's cgroup.controllers.
    CgroupError (naming what is missing and the fix) where neither version can."""
    v1, v2 = parse_mountinfo(mountinfo)
    if all(name in v1 for name in wanted):
        return CgroupChoice(1, {name: v1[name] for name in wanted})
    offered = set(v2_controllers(v2).split()) if v2 else set()
    if v2 and all(name in offered for name in wanted):
        return CgroupChoice(2, {name: v2 for name in wanted})
    missing_v1 = [name for name in wanted if name not in v1]
    v2_says = (f"the cgroup v2 hierarchy at {v2} offers {sorted(offered) or 'none of them'}" if v2
               else "no cgroup v2 hierarchy is mounted")
    raise CgroupError(
        f"the policy asks for cgroup caps on {' and '.join(wanted)} (Policy.enable_cgroups=True), "
        f"but this host cannot enforce them: no cgroup v1 hierarchy for {', '.join(missing_v1)}, "
        f"and {v2_says}; fix: mount those controllers (cgroup v1, or cgroup2 with them in its root's "
        f"cgroup.controllers) and run as root, or pass Policy(enable_cgroups=False) to run without "
        f"the caps (the per-process rlimits still apply)")


@functools.lru_cache(maxsize=1)
def host_cgroups() -> CgroupChoice:
    """This host's choice (read once per process); CgroupError where it has none."""
    try:
        with open("/proc/self/mountinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    return choose_cgroups(text)


def cgroup_flags(choice: CgroupChoice, *, memory_bytes: int, max_pids: int) -> list[str]:
    """nsjail flags that cap a jail's memory at `memory_bytes` and its processes at `max_pids`
    the way `choice` says; CgroupError where a parent group cannot be made (not root)."""
    if choice.version == 2:
        parent = _v2_parent(choice.mounts["memory"])
        return ["--use_cgroupv2", "--cgroupv2_mount", parent,
                "--cgroup_mem_max", str(memory_bytes), "--cgroup_pids_max", str(max_pids)]
    memory, pids = choice.mounts["memory"], choice.mounts["pids"]
    return ["--cgroup_mem_mount", memory, "--cgroup_mem_parent", _v1_parent(memory),
            "--cgroup_mem_max", str(memory_bytes),
            "--cgroup_pids_mount", pids, "--cgroup_pids_parent", _v1_parent(pids),
            "--cgroup_pids_max", str(max_pids)]


def _refuse(where: str, exc: OSError | None) -> CgroupError:
    why = f": {exc.strerror}" if exc is not None else ": not writable"
    return CgroupError(f"cannot make the sandbox's cgroup {where}{why}; the policy's memory and pids "
                        f"caps need it; fix: run as root, or pass Policy(enable_cgroups=False) to run "
                        f"without the caps")


def _v1_parent(mount: str) -> str:
    """The v1 parent group's name in hierarchy `mount`, made if need be."""
    path = os.path.join(mount, PARENT)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise _refuse(path, exc) from exc
    if not os.access(os.path.join(path, "tasks"), os.W_OK):
        raise _refuse(path, None)
    _remove_stale_groups(path)
    return PARENT


def _v2_parent(mount: str) -> str:
    """The v2 parent group's path under the unified root `mount`, made if need be, with the
    controllers enabled in the root (exempt from the no-internal-process rule) and in it (it
    holds no process, only the per-jail groups), so that nsjail never moves itself."""
    path = os.path.join(mount, PARENT)
    try:
        os.makedirs(path, exist_ok=True)
        for group in (mount, path):
            _enable_controllers(group)
    except OSError as exc:
        raise _refuse(path, exc) from exc
    _remove_stale_groups(path)
    return path


def _enable_controllers(group: str) -> None:
    control = os.path.join(group, "cgroup.subtree_control")
    with open(control) as f:
        enabled = set(f.read().split())
    if not set(CONTROLLERS) <= enabled:
        with open(control, "w") as f:
            f.write(" ".join(f"+{name}" for name in CONTROLLERS))


_cleaned: set[str] = set()


def _remove_stale_groups(parent_dir: str) -> None:
    """Remove per-jail groups left by an nsjail that was SIGKILLed (once per process)."""
    if parent_dir in _cleaned:
        return
    _cleaned.add(parent_dir)
    for name in os.listdir(parent_dir):
        if name.startswith("NSJAIL.") and name[7:].isdigit() and not os.path.exists(f"/proc/{name[7:]}"):
            try:
                os.rmdir(os.path.join(parent_dir, name))  # fails (EBUSY) if it still has tasks
            except OSError:
                pass
