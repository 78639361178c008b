"""Policy validation and the nsjail command line it becomes."""
from __future__ import annotations

import os
import re

import pytest

from postrain.sandbox import Policy, PolicyError, nsjail_binary
from postrain.sandbox.policy import HOST_ROOT_UID, STAGE_DIR, kafel_policy, nsjail_argv


def test_defaults_carry_units_and_are_valid():
    policy = Policy()
    assert policy.wall_time_s == 10.0 and policy.memory_mb == 512 and not policy.enable_network
    assert dict(policy.env)["HOME"] == "/work"
    assert os.path.realpath(policy.python) == policy.python


@pytest.mark.parametrize("field,value,match", [
    ("wall_time_s", 0, "wall_time_s must be a finite number > 0, got 0"),
    ("wall_time_s", float("inf"), "wall_time_s must be a finite number > 0"),
    ("memory_mb", -5, "memory_mb must be a finite number > 0, got -5"),
    ("memory_mb", 8, "memory_mb must be >= 32"),
    ("cpu_time_s", 1.5, "cpu_time_s must be a whole number of seconds, got 1.5; fix: round it up, e.g. 2"),
    ("max_output_bytes", True, "max_output_bytes must be a finite number > 0"),
    ("max_open_files", 3, "max_open_files must be >= 8"),
    ("readonly_mounts", ("usr",), "readonly_mounts entries must be absolute paths"),
])
def test_bad_fields_name_the_rule_the_value_and_the_fix(field, value, match):
    with pytest.raises(PolicyError, match=match):
        Policy(**{field: value})


def test_replace_validates_again():
    with pytest.raises(PolicyError, match="wall_time_s"):
        Policy().replace(wall_time_s=-1)
    assert Policy().replace(memory_mb=64).memory_mb == 64


def test_binary_is_the_packaged_one_not_the_launcher():
    path = nsjail_binary()
    assert path.endswith("nsjail/bin/nsjail") and os.access(path, os.X_OK)


def test_cold_argv_isolates_by_default():
    argv = nsjail_argv(Policy(memory_mb=100, max_processes=7), cold=True, task_dir="/tmp/t")
    joined = " ".join(argv)
    assert argv[-1] == "--"
    assert "--iface_no_lo" in argv and "--disable_clone_newnet" not in argv
    assert "--disable_proc" in argv and "--keep_env" not in argv and "--keep_caps" not in argv
    assert "--rlimit_as 100" in joined and "--rlimit_nproc 7" in joined
    assert "--bindmount_ro /tmp/t:/task" in joined
    assert "--bindmount" not in argv  # nothing of the host is writable
    assert "ptrace" in kafel_policy(cold=True) and "mount" in kafel_policy(cold=True)
    assert "mount" not in kafel_policy(cold=False)  # the warm zygote mounts; its child may not


def test_warm_and_session_jails_reach_their_mounts_through_a_stage_without_host_root():
    argv = nsjail_argv(Policy(), cold=False, extra=("--bindmount_ro", "/tmp/t:/task"))
    staged = argv[argv.index("--", argv.index("/tmp/t")) + 1:]     # nsjail's own flags, past the stage's
    assert re.search(rf"--bindmount_ro {STAGE_DIR}/\d+:/task", " ".join(staged))
    assert f"--user 0:{HOST_ROOT_UID}:1" in " ".join(staged) and "0:0:1" not in staged
    assert "--keep_caps" in staged


def test_network_is_opt_in():
    assert "--disable_clone_newnet" in nsjail_argv(Policy(enable_network=True), cold=True)


def test_to_dict_is_plain_data():
    data = Policy().to_dict()
    assert data["env"]["PATH"] and isinstance(data["readonly_mounts"], list)
