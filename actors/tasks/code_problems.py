"""The built-in code problems: small classic functions, written for postrain.

Each problem: a signature, a description (the spec), a reference solution (used by the
demonstrations and by the test that checks every problem in the sandbox), visible tests (shown
to the model, which may run its code against them) and hidden tests (the reward). A test is a
Python comparison `call == expected`; `code.build_test_file` turns a list of them into a test file.

The problems are data: `data/code_problems.json` beside this module (a list of objects with the
fields above), read once at import. `PROBLEMS` holds them in file order as dicts with those
fields and the function's `name` (taken from the signature).
"""
from __future__ import annotations

import json
from pathlib import Path

DATA_PATH = Path(__file__).parent / "data" / "code_problems.json"
FIELDS = ("signature", "description", "reference", "visible_tests", "hidden_tests")


def _problem(fields: dict) -> dict:
    """A problem as `PROBLEMS` holds it: its fields, its function's name, the reference ending in
    one newline."""
    missing = [name for name in FIELDS if name not in fields]
    if missing or len(fields) != len(FIELDS):
        raise ValueError(f"{DATA_PATH}: a problem must have exactly the fields {FIELDS}, "
                         f"got {sorted(fields)}")
    signature = fields["signature"]
    name = signature.split("(")[0].removeprefix("def ").strip()
    return {"name": name, "signature": signature, "description": fields["description"],
            "reference": fields["reference"].strip("\n") + "\n",
            "visible_tests": list(fields["visible_tests"]), "hidden_tests": list(fields["hidden_tests"])}


PROBLEMS = [_problem(fields) for fields in json.loads(DATA_PATH.read_text(encoding="utf-8"))]
