"""`postrain bench cad`: the CAD grader's time per sample beside the sandbox's warm run time.

For each sampled variant (held-out ones, across the three families and levels) an episode's
session runs the reference script (`script_run_*`: build123d's import, the build and the export,
in the session's jail), then the grader grades it as an episode does (`grade_*`: the export's
bytes copied out of the session, measured in a fresh warm jail, judged on the host; every
reference must pass). The peer of the grading figures is the warm sandbox's run time of a
trivial snippet (`print(1)`) on the same pool: what any graded sample costs at least.

    postrain bench cad --json

`grading_figures(num_samples)` is the function behind it, for a bench that wants the figures
beside its own (the mixture bench).
"""
from __future__ import annotations

import time

import trio

from postrain.actors import LocalSandbox
from postrain.actors.tasks.cad import CadEnv, eval_tasks
from postrain.sandbox import Policy, Sandbox, Status


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _sample(num_samples: int) -> list[dict]:
    """`num_samples` held-out variants, taken in turn from each (family, level)."""
    tasks = eval_tasks()
    groups = [[t for t in tasks if (t["family"], t["level"]) == key]
              for key in dict.fromkeys((t["family"], t["level"]) for t in tasks)]
    order = [group[i] for i in range(max(map(len, groups))) for group in groups if i < len(group)]
    return order[:num_samples]


async def _episodes(sandbox: Sandbox, tasks: list[dict]) -> tuple[list[float], list[float]]:
    """(script run seconds, grading seconds) per task; AssertionError if a reference fails."""
    script_s, grade_s = [], []
    for task in tasks:
        env = CadEnv(sandbox=LocalSandbox(sandbox))
        try:
            await env.reset(task)
            t0 = time.perf_counter()
            result = await env.session.run_python(task["reference"], timeout_s=env.options.script_timeout_s)
            t1 = time.perf_counter()
            verdict = await env.grade()
            t2 = time.perf_counter()
        finally:
            await env.close()
        assert result.status is Status.OK and verdict.passed, (task["id"], result.status, verdict.reasons)
        script_s.append(t1 - t0)
        grade_s.append(t2 - t1)
    return script_s, grade_s


def grading_figures(num_samples: int = 9, num_warm_runs: int = 20) -> dict:
    """{"results": grading and script-run p50/p99 in ms, "peer": the warm run's p50/p99 under the
    grading figures' names} over `num_samples` variants, on a warm pool of one worker."""
    with Sandbox(Policy(), mode="warm", num_workers=1) as sandbox:
        warm_s = []
        for _ in range(num_warm_runs):
            t0 = time.perf_counter()
            assert sandbox.run("print(1)").status is Status.OK
            warm_s.append(time.perf_counter() - t0)
        script_s, grade_s = trio.run(_episodes, sandbox, _sample(num_samples))
    ms = {name: [1000 * v for v in values] for name, values in
          (("grade", grade_s), ("script_run", script_s), ("warm_run", warm_s))}
    results = {f"{name}_{q}_ms": round(_percentile(values, p), 1) for name in ("grade", "script_run")
               for values in [ms[name]] for q, p in (("p50", 0.5), ("p99", 0.99))}
    peer = {f"grade_{q}_ms": round(_percentile(ms["warm_run"], p), 1) for q, p in (("p50", 0.5), ("p99", 0.99))}
    return {"results": {**results, "num_samples": len(grade_s)}, "peer": peer}


def run(quick: bool) -> dict:
    num_samples = 3 if quick else 18
    figures = grading_figures(num_samples, num_warm_runs=10 if quick else 40)
    return {"config": {"num_samples": num_samples, "sandbox": "warm, 1 worker", "export": "STL"}, **figures}
