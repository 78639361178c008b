"""`postrain sandbox exec` end to end, through the real CLI entry point."""
from __future__ import annotations

import json
import subprocess
import sys

from postrain.cli import main as cli_main


def test_exec_file_prints_output_and_status(tmp_path, capfd):
    program = tmp_path / "p.py"
    program.write_text("import sys\nprint('hi', sys.argv[1:], input())\n")
    stdin = tmp_path / "in.txt"
    stdin.write_text("there\n")
    assert cli_main(["sandbox", "exec", "--stdin-file", str(stdin), str(program), "--", "x"]) == 0
    out, err = capfd.readouterr()
    assert out == "hi ['x'] there\n" and "status=ok" in err


def test_exec_stdin_json_warm():
    proc = subprocess.run([sys.executable, "-m", "postrain.cli", "sandbox", "exec", "--json",
                           "--warm", "--wall-time-s", "2", "-"], input=b"raise SystemExit(4)\n",
                          capture_output=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    assert report["status"] == "nonzero_exit" and report["exit_code"] == 4 and report["mode"] == "warm"


def test_exec_usage_errors(tmp_path, capfd):
    assert cli_main(["sandbox", "exec", str(tmp_path / "missing.py")]) == 2
    program = tmp_path / "p.py"
    program.write_text("pass\n")
    assert cli_main(["sandbox", "exec", "--memory-mb", "1", str(program)]) == 2
    assert "memory_mb must be >= 32" in capfd.readouterr().err
