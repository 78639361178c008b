"""The `cad` task: build a part from its spec with a real CAD kernel (build123d on OpenCascade).

The policy writes a build123d script in a sandbox session; the script exports the part as an STL
file; the grader, out of the policy's reach, measures the export in a jail of its own and judges
the figures on the host: a valid closed solid, its volume, its bounding box, its number of
through-holes (the genus) and the spec's features (probe points on either side of each hole wall
and fillet). docs/environments.md ("CAD") has the spec, the contract and the grader's method.

Modules: `part.py` (a variant's record and the geometry helpers), `plate.py`, `bracket.py`,
`box.py` (the families), `suite.py` (the variants and the held-out split), `mesh.py` (the
measurement, run in the grader's jail), `grader.py` (the request, the judge), `env.py` (the
environment and its options). Here: the task's streams and demonstrations.

    spec = postrain.actors.tasks.get_task("cad")
    task = spec.eval_tasks({"families": ["plate"], "levels": [1]})[0]
"""
from __future__ import annotations

import itertools
from typing import Iterator

from ...env.tools import format_tool_call
from . import suite
from .env import CAD_INSTRUCTIONS, CadEnv, CadOptions, cad_options, prompt_messages
from .grader import CadVerdict, judge, measure_request, read_measurement
from .suite import FAMILIES, LEVELS, all_variants


def train_tasks(seed: int = 0, options: dict | CadOptions | None = None) -> Iterator[dict]:
    """Endless: the training variants of the chosen families and levels, reshuffled (seeded) each
    pass. Bad options raise here, not at the first task."""
    options = cad_options(options)
    return suite.cycle(suite.train_split(options.families, options.levels), seed)


def eval_tasks(options: dict | CadOptions | None = None) -> list[dict]:
    """The held-out variants of the chosen families and levels (27 of all)."""
    options = cad_options(options)
    return suite.eval_split(options.families, options.levels)


def demonstration(task: dict, options: dict | CadOptions | None = None) -> dict:
    """The reference script as the episode's one turn: a script that exports the part ends the
    episode, so the prompt and one `<python>` block are the whole conversation."""
    options = cad_options(options)
    messages = prompt_messages(task, use_system_prompt=options.use_system_prompt)
    return {"messages": messages + [{"role": "assistant", "content": format_tool_call(task["reference"])}]}


def demonstrations(num: int, seed: int = 0, options: dict | CadOptions | None = None) -> list[dict]:
    """`num` demonstrations of training variants (never the held-out split), in a seeded order."""
    options = cad_options(options)
    return [demonstration(t, options) for t in itertools.islice(train_tasks(seed, options), num)]


__all__ = ["CAD_INSTRUCTIONS", "CadEnv", "CadOptions", "CadVerdict", "FAMILIES", "LEVELS", "all_variants",
           "cad_options", "demonstration", "demonstrations", "eval_tasks", "judge", "measure_request",
           "read_measurement", "train_tasks"]
