"""`postrain sandbox exec`: run a file (or stdin) in an nsjail sandbox by hand.

    postrain sandbox exec solution.py                 # status line on stderr, output as is
    echo 'print(2 + 2)' | postrain sandbox exec -     # the code from stdin
    postrain sandbox exec --json --warm --wall-time-s 2 --memory-mb 256 solution.py
    postrain sandbox exec --stdin-file input.txt solution.py

The exit status is 0 when the code ran and exited 0 (status ok), 1 for any other status of the
code, 2 for usage errors and 3 for sandbox_error. `--json` prints one object with the status, exit
code or signal, wall and CPU time and the (capped) output.

(sandbox is a leaf library, so core may import it; actors/ and bench/ it may not.)
"""
from __future__ import annotations

import argparse
import json
import sys

HELP = "run code in an nsjail sandbox by hand (postrain sandbox exec FILE|-)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sandbox_command", metavar="ACTION")
    sub.required = True
    ex = sub.add_parser("exec", help="run FILE (or - for stdin) and print the status and output",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ex.add_argument("file", metavar="FILE|-", help="the program; - reads it from stdin")
    ex.add_argument("args", nargs="*", help="arguments for the program (after --)")
    ex.add_argument("--lang", default="python", choices=["python"], help="language (default python)")
    ex.add_argument("--json", action="store_true", help="print one JSON object instead of raw output")
    ex.add_argument("--warm", action="store_true", help="run in a warm worker (same result, faster "
                    "for repeated runs; pays one worker start here)")
    ex.add_argument("--stdin-file", help="file fed to the program's stdin (default: empty)")
    ex.add_argument("--wall-time-s", type=float, help="wall-clock limit in seconds (default 10)")
    ex.add_argument("--cpu-time-s", type=int, help="CPU limit in seconds (default 10)")
    ex.add_argument("--memory-mb", type=int, help="memory limit in MB (default 512)")
    ex.add_argument("--max-output-bytes", type=int, help="bytes kept of stdout and of stderr")
    ex.add_argument("--audit-log", help="append a JSONL audit record to this file")


def main(args: argparse.Namespace) -> int:
    from postrain.sandbox import Policy, PolicyError, Sandbox, SandboxError, Status

    try:
        code = sys.stdin.read() if args.file == "-" else open(args.file, encoding="utf-8").read()
        stdin = open(args.stdin_file, "rb").read() if args.stdin_file else b""
    except OSError as exc:
        print(f"postrain sandbox exec: cannot read {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    overrides = {name: getattr(args, name) for name in
                 ("wall_time_s", "cpu_time_s", "memory_mb", "max_output_bytes")
                 if getattr(args, name) is not None}
    try:
        policy = Policy(**overrides)
        with Sandbox(policy, mode="warm" if args.warm else "cold", audit_log=args.audit_log) as sandbox:
            result = sandbox.run(code, lang=args.lang, stdin=stdin, argv=args.args, requester="cli")
    except PolicyError as exc:
        print(f"postrain sandbox exec: {exc}", file=sys.stderr)
        return 2
    except SandboxError as exc:
        print(f"postrain sandbox exec: sandbox_error: {exc}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(result.to_dict(), sort_keys=True))
    else:
        sys.stdout.buffer.write(result.stdout)
        sys.stdout.flush()
        sys.stderr.buffer.write(result.stderr)
        print(f"[sandbox] {result.summary()}", file=sys.stderr)
    if result.status is Status.SANDBOX_ERROR:
        return 3
    return 0 if result.status is Status.OK else 1
