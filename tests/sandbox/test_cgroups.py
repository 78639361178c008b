"""Which cgroup version caps a jail (v1, v2, or a refusal), from a host's mount table; and that a
real jail here gets its caps (issue 32: on a v2-only host the caps used to vanish silently)."""
from __future__ import annotations

import pytest

from postrain.sandbox import Policy
from postrain.sandbox.cgroups import CgroupError, cgroup_flags, choose_cgroups, host_cgroups, parse_mountinfo
from postrain.sandbox.policy import SandboxError, nsjail_argv

V1_HOST = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_HOST = """\
22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/root rw
30 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""
V2_ALL = "cpuset cpu io memory hugetlb pids rdma misc\n"
NO_CGROUPS = "22 1 259:1 / / rw,relatime shared:1 - ext4 /dev/root rw\n"


def test_parse_mountinfo_finds_v1_hierarchies_and_the_v2_root():
    v1, v2 = parse_mountinfo(V1_HOST)
    assert v1["memory"] == "/sys/fs/cgroup/memory" and v1["pids"] == "/sys/fs/cgroup/pids"
    assert v2 == "/sys/fs/cgroup/unified"
    assert parse_mountinfo(V2_HOST) == ({}, "/sys/fs/cgroup")
    odd = "40 31 0:37 / /mnt/my\\040cgroups rw - cgroup cgroup rw,memory,pids\n"
    assert parse_mountinfo(odd)[0]["memory"] == "/mnt/my cgroups"


def test_v1_is_chosen_where_it_has_every_controller():
    choice = choose_cgroups(V1_HOST, v2_controllers=lambda mount: "hugetlb\n")
    assert choice.version == 1
    assert choice.mounts == {"memory": "/sys/fs/cgroup/memory", "pids": "/sys/fs/cgroup/pids"}


def test_v2_is_chosen_on_a_v2_only_host():
    asked = []
    choice = choose_cgroups(V2_HOST, v2_controllers=lambda mount: asked.append(mount) or V2_ALL)
    assert asked == ["/sys/fs/cgroup"]
    assert choice.version == 2 and choice.mounts == {"memory": "/sys/fs/cgroup", "pids": "/sys/fs/cgroup"}


@pytest.mark.parametrize("mountinfo, offered, says", [
    (NO_CGROUPS, "", "no cgroup v2 hierarchy is mounted"),
    (V2_HOST, "cpu io\n", "offers ['cpu', 'io']"),                  # v2 without memory and pids
    (V1_HOST.replace("rw,pids", "rw,rdma"), "hugetlb", "no cgroup v1 hierarchy for pids"),
])
def test_refused_where_neither_version_can_enforce_the_caps(mountinfo, offered, says):
    with pytest.raises(CgroupError, match="cannot enforce them") as info:
        choose_cgroups(mountinfo, v2_controllers=lambda mount: offered)
    assert says in str(info.value) and "enable_cgroups=False" in str(info.value)


def test_v2_flags_make_the_parent_group_with_its_controllers(tmp_path):
    for group in (tmp_path, tmp_path / "NSJAIL"):
        group.mkdir(exist_ok=True)
        (group / "cgroup.subtree_control").write_text("cpu\n")  # a v2 group's file, faked
    choice = choose_cgroups(V2_HOST.replace("/sys/fs/cgroup", str(tmp_path)), v2_controllers=lambda m: V2_ALL)
    flags = cgroup_flags(choice, memory_bytes=1 << 27, max_pids=9)
    assert flags == ["--use_cgroupv2", "--cgroupv2_mount", str(tmp_path / "NSJAIL"),
                     "--cgroup_mem_max", str(1 << 27), "--cgroup_pids_max", "9"]
    for group in (tmp_path, tmp_path / "NSJAIL"):
        assert (group / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_this_hosts_jails_get_both_caps():
    choice = host_cgroups()
    argv = nsjail_argv(Policy(memory_mb=128, max_processes=7), cold=True)
    assert "--cgroup_mem_max" in argv and argv[argv.index("--cgroup_pids_max") + 1] == "7"
    assert ("--use_cgroupv2" in argv) == (choice.version == 2)
    assert "--cgroup_mem_max" not in nsjail_argv(Policy(enable_cgroups=False), cold=True)


def test_a_jail_is_refused_rather_than_run_without_its_caps(monkeypatch):
    import postrain.sandbox.policy as policy_module

    def no_cgroups():
        return choose_cgroups(NO_CGROUPS, v2_controllers=lambda mount: "")
    monkeypatch.setattr(policy_module, "host_cgroups", no_cgroups)  # a host without cgroups
    with pytest.raises(SandboxError, match="cannot enforce them.*enable_cgroups=False"):
        nsjail_argv(Policy(), cold=True)
    assert "--cgroup_mem_max" not in nsjail_argv(Policy(enable_cgroups=False), cold=True)


def _real_v2_mount() -> str | None:
    with open("/proc/self/mountinfo") as f:
        return parse_mountinfo(f.read())[1]


@pytest.mark.skipif(_real_v2_mount() is None, reason="no cgroup2 hierarchy mounted on this host")
def test_a_real_cgroup2_mount_without_the_controllers_is_refused_not_silently_used():
    """This host's own cgroup2 mount, seen as a v2-only host (its v1 hierarchies left out): the
    kernel's own cgroup.controllers decides. Where it lacks memory or pids (here they are bound to
    v1), the choice is a refusal, and so is enabling them in a parent group (the kernel says no)."""
    import os

    from postrain.sandbox.cgroups import CgroupChoice
    mount = _real_v2_mount()
    with open("/proc/self/mountinfo") as f:
        only_v2 = "".join(line for line in f if " - cgroup2 " in line)
    with open(os.path.join(mount, "cgroup.controllers")) as f:
        offered = set(f.read().split())
    if {"memory", "pids"} <= offered:
        assert choose_cgroups(only_v2).version == 2         # a v2 host: the caps are enforced
        return
    with pytest.raises(CgroupError, match=r"cannot enforce them.*offers"):
        choose_cgroups(only_v2)
    parent = os.path.join(mount, "NSJAIL")
    existed = os.path.isdir(parent)
    try:
        with pytest.raises(CgroupError, match="cannot make the sandbox's cgroup.*enable_cgroups=False"):
            cgroup_flags(CgroupChoice(2, {"memory": mount, "pids": mount}), memory_bytes=1 << 27, max_pids=9)
    finally:
        if not existed and os.path.isdir(parent):
            os.rmdir(parent)
