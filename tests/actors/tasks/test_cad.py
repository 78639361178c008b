"""The CAD task: the variants and their split, the mesh measurement, and the grader in real jails.

Reference scripts pass through the real environment (a session running build123d, the export
measured in a jail of its own); wrong parts, broken meshes, missing exports, self-reported
results, fake exports and the terminal suite's reward hacks all score 0. The sweep of every
variant's reference is `pytest -m variants`.
"""
from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest
import trio

from postrain.actors import LocalSandbox, TaskOptionsError, get_task, run_episode
from postrain.actors.env.actor import RemoteSandbox
from postrain.actors.env.api import EnvironmentFailure
from postrain.actors.env.tools import parse_action
from postrain.actors.tasks.cad import CadEnv, all_variants, eval_tasks, judge, measure_request, read_measurement
from postrain.actors.tasks.cad import mesh, suite
from postrain.core import ActorSpec, Supervisor
from postrain.core.testing import async_test
from postrain.sandbox import Policy, Sandbox

CC = shutil.which("cc") or shutil.which("gcc")
EXIT_0_SO = "#include <stdlib.h>\n__attribute__((constructor)) static void hook(void) { exit(0); }\n"


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(Policy(), mode="warm", num_workers=1) as sb:
        yield sb


def variant(task_id: str) -> dict:
    return next(t for t in all_variants() if t["id"] == task_id)


# A plate with four holes and filleted corners: the part the failure cases get wrong.
PLATE = "cad-plate-2-1"
# Another part: its reference is "an export of another part".
BRACKET = "cad-bracket-2-0"


# ------------------------------------------------------------------ hand-written meshes
def cuboid(lo, hi) -> np.ndarray:
    """The 12 outward triangles of an axis-aligned box, (12, 3, 3)."""
    lo, hi = np.asarray(lo, float), np.asarray(hi, float)
    corner = [np.array([(hi if i >> k & 1 else lo)[k] for k in range(3)]) for i in range(8)]
    quads = [(0, 2, 3, 1), (4, 5, 7, 6), (0, 1, 5, 4), (2, 6, 7, 3), (0, 4, 6, 2), (1, 3, 7, 5)]
    triangles = []
    centre = (lo + hi) / 2
    for a, b, c, d in quads:
        for tri in ((a, b, c), (a, c, d)):
            points = [corner[i] for i in tri]
            normal = np.cross(points[1] - points[0], points[2] - points[0])
            if np.dot(normal, points[0] - centre) < 0:
                points = points[::-1]
            triangles.append(points)
    return np.asarray(triangles)


def binary_stl(triangles: np.ndarray) -> bytes:
    body = b"".join(struct.pack("<12fH", 0, 0, 0, *t.reshape(-1), 0) for t in triangles)
    return b"\0" * 80 + struct.pack("<I", len(triangles)) + body


def ascii_stl(triangles: np.ndarray) -> bytes:
    facets = "".join("facet normal 0 0 0\n outer loop\n" + "".join(f"  vertex {x} {y} {z}\n" for x, y, z in t)
                     + " endloop\nendfacet\n" for t in triangles)
    return f"solid fake\n{facets}endsolid fake\n".encode()


def test_a_closed_box_measures_as_one_solid_of_genus_0_in_either_stl_form():
    box = cuboid((0, 0, 0), (4, 3, 2))
    points = [[1, 1, 1], [5, 1, 1], [2, 1.5, 1.999]]
    for data in (binary_stl(box), ascii_stl(box)):
        figures = mesh.measure(data, points)
        assert figures["watertight"] and figures["oriented"] and figures["vertex_manifold"]
        assert figures["num_bodies"] == 1 and figures["euler"] == 2 and figures["volume_mm3"] == pytest.approx(24)
        assert figures["bbox_min"] == [0, 0, 0] and figures["bbox_max"] == [4, 3, 2]
        assert [round(w, 6) for w in figures["winding"]] == [1, 0, 1]


def test_broken_meshes_are_measured_as_such():
    box = cuboid((0, 0, 0), (1, 1, 1))
    assert not mesh.measure(binary_stl(box[:-2]), [])["watertight"], "a missing face"
    assert mesh.measure(binary_stl(box[:, ::-1]), [])["volume_mm3"] < 0, "inside out"
    two = np.concatenate([box, cuboid((3, 0, 0), (4, 1, 1))])
    assert mesh.measure(binary_stl(two), [])["num_bodies"] == 2
    pinched = mesh.measure(binary_stl(np.concatenate([box, cuboid((1, 1, 1), (2, 2, 2))])), [])
    assert pinched["oriented"] and pinched["num_bodies"] == 1 and not pinched["vertex_manifold"], \
        "two cubes sharing a corner: Euler counts a 'hole' that is a pinch"
    assert "error" in mesh.measure(b"\x00" * 10, [])
    assert "not an STL file" in mesh.measure(binary_stl(box)[:-7], [])["error"]
    assert "not followed by three numbers" in mesh.measure(b"solid x\nvertex 1 2 nope\n", [])["error"]
    assert "not followed by three numbers" in mesh.measure(b"solid x\nvertex 1 2\n", [])["error"]
    assert "no triangle" in mesh.measure(b"solid x\nendsolid x\n", [])["error"]


def test_the_judge_names_each_failed_check():
    task = variant(PLATE)
    figures = mesh.measure(binary_stl(cuboid(task["expected"]["bbox_min"], task["expected"]["bbox_max"])),
                           [p["point"] for p in task["probes"]])
    verdict = judge(task, figures)
    assert verdict.checks["solid"] and verdict.checks["bbox"] and not verdict.passed
    assert not verdict.checks["through_holes"] and not verdict.checks["feature:holes"]
    assert verdict.reasons["through_holes"] == "0 through-holes (Euler characteristic 2), expected 4"
    assert verdict.cause == "wrong_shape" and verdict.score() == 0.0
    assert 0 < verdict.score(partial_credit=True) < 1
    broken = judge(task, read_measurement({"status": "timeout", "stdout": b"", "stderr": b""}))
    assert broken.cause == "invalid_export" and broken.score(partial_credit=True) == 0.0


# ------------------------------------------------------------------ the suite
def test_variants_are_seeded_split_and_cover_three_levels_per_family():
    tasks = all_variants()
    assert len({t["id"] for t in tasks}) == len(tasks) == 180
    assert suite.make_variant("box", 3, 7) == variant("cad-box-3-7"), "deterministic"
    for family in ("plate", "bracket", "box"):
        assert sum(t["family"] == family for t in tasks) >= 50
        for level in (1, 2, 3):
            assert sum((t["family"], t["level"]) == (family, level) for t in tasks) == 20
    held_out = eval_tasks()
    assert len(held_out) == 27 and {(t["family"], t["level"]) for t in held_out} == {
        (f, level) for f in ("plate", "bracket", "box") for level in (1, 2, 3)}
    spec = get_task("cad")
    stream = [t["id"].rsplit("-", 2)[0] for _, t in zip(range(200), spec.train_tasks(seed=2))]
    assert not set(stream) & {t["id"] for t in held_out}
    assert [t["id"] for t in spec.eval_tasks({"families": ["box"], "levels": [1]})] == [
        t["id"] for t in held_out if t["family"] == "box" and t["level"] == 1]
    with pytest.raises(TaskOptionsError, match=r"families must name some of \['plate', 'bracket', 'box'\], "
                                               r"got \['gear'\]; fix: drop \['gear'\]"):
        spec.eval_tasks({"families": ["gear"]})
    with pytest.raises(TaskOptionsError, match=r"memory_mb"):
        spec.make_env(options={"memory_mb": 512})


def test_demonstrations_are_the_reference_script_in_one_python_turn():
    spec = get_task("cad")
    demos = spec.demonstrations(12, seed=1)
    assert demos == spec.demonstrations(12, seed=1)
    held_out = {t["description"] for t in eval_tasks()}
    references = {t["reference"] for t in all_variants()}
    for demo in demos:
        system, user, assistant = demo["messages"]
        assert system["role"] == "system" and user["content"].split("\n")[0] not in held_out
        action = parse_action(assistant["content"])
        assert action.well_formed and action.kind == "tool_call"
        assert action.content.strip() + "\n" in references


# ------------------------------------------------------------------ in real jails
def replay(script: str):
    async def policy(messages):
        return f"<python>\n{script}</python>"
    return policy


@async_test
async def test_reference_scripts_pass_through_the_real_sandbox(sandbox):
    """A sample of the families and levels (a box: the sandbox actor's test below); `pytest -m variants`
    sweeps all of them."""
    for task_id in ("cad-plate-3-2", "cad-bracket-1-4"):
        task = variant(task_id)
        env = CadEnv(sandbox=LocalSandbox(sandbox))
        try:
            episode = await run_episode(env, task, replay(task["reference"]), step_timeout_s=300)
        finally:
            await env.close()
        assert episode.reward.components["correct"] == 1.0, (task_id, episode.messages[-1])
        assert episode.num_turns == 1


@async_test
async def test_an_episode_through_the_sandbox_actor_grades_the_reference_and_a_missing_export():
    """Over the wire: the session's limits (2 GiB for OpenCascade) reach the actor, the export is
    read through it, and a missing file comes back as a failed read, scored `no_export`; a session
    that the sandbox ended under the episode fails it (the infrastructure's failure), unscored."""
    task = variant("cad-box-2-3")
    async with Supervisor.open(heartbeat_interval_s=0.5) as sup:
        ref = await sup.start(ActorSpec(name="sandbox", cls="postrain.actors.sandbox:SandboxActor",
                                        cpus=0.2, memory_mb=0, options={"num_workers": 1}))
        envs = [get_task("cad").make_env(sandbox=RemoteSandbox(ref), options=options)
                for options in ({}, {"max_attempts": 1}, {})]

        async def session_ends_then_answer(messages):
            await ref.ask("session_close", {"session_id": envs[2].session.session_id})
            return "<answer>done</answer>"
        try:
            right = await run_episode(envs[0], task, replay(task["reference"]), step_timeout_s=300)
            idle = await run_episode(envs[1], task, replay("print('thinking')\n"))
            with pytest.raises(EnvironmentFailure, match="UnknownSession"):
                await run_episode(envs[2], task, session_ends_then_answer)
        finally:
            for env in envs:
                await env.close()
    assert right.reward.components["correct"] == 1.0, right.messages[-1]
    assert idle.reward.components["correct"] == 0.0 and idle.infos[-1]["cause"] == "no_export"


def _cases_script(plate: dict, other: dict) -> str:
    """One jail run that builds the wrong parts (build123d imports once): each case exports to
    /work/cases/NAME.stl."""
    reference = plate["reference"]
    cut = next(line for line in reference.splitlines() if line.startswith("part -= "))
    cases = {"reference": reference,
             "wrong_size": reference.replace("Box(", "Box(4 + ", 1),
             "missing_hole": reference.replace(cut + "\n", "", 1),
             "other_part": other["reference"]}
    parts = ["import os, struct", "os.makedirs('/work/cases', exist_ok=True)"]
    for name, script in cases.items():
        parts.append(f"exec({script.replace('/work/part.stl', f'/work/cases/{name}.stl')!r}, {{}})")
    parts.append("data = open('/work/cases/reference.stl', 'rb').read()\n"
                 "count = struct.unpack_from('<I', data, 80)[0] - 2\n"
                 "open('/work/cases/open.stl', 'wb').write(data[:80] + struct.pack('<I', count) + data[84:84 + 50 * count])")
    return "\n".join(parts) + "\n"


@pytest.fixture(scope="module")
def wrong_exports(sandbox) -> dict[str, bytes]:
    """The plate's reference export and four wrong ones, built by build123d in a jail."""
    async def build() -> dict[str, bytes]:
        async with LocalSandbox(sandbox).session(limits={"memory_mb": 2048, "call_wall_time_s": 300,
                                                         "call_cpu_time_s": 300}) as session:
            result = await session.run_python(_cases_script(variant(PLATE), variant(BRACKET)))
            assert result.status.value == "ok", result.stderr[-2000:]
            return {name: await session.read_file(f"cases/{name}.stl")
                    for name in ("reference", "wrong_size", "missing_hole", "other_part", "open")}
    return trio.run(build)


async def graded(sandbox, export: bytes | None, *, options: dict | None = None, commands=(), scripts=(),
                 task_id: str = PLATE):
    """A plate episode: `commands` (bash, as a policy with a shell would) and `scripts` (python
    turns) run in its session, then `export` is laid at /work/part.stl (None: left as the
    scripts left it) and the model answers; the final step's (correct, info)."""
    env = CadEnv(sandbox=LocalSandbox(sandbox), options={"max_attempts": 5, **(options or {})})
    try:
        await env.reset(variant(task_id))
        for command in commands:
            assert (await env.session.run(command)).status.value == "ok", command
        for script in scripts:
            result = await env.step(f"<python>\n{script}\n</python>")
            if result.done:   # it exported: graded at once
                return result.reward.components["correct"], result.info
        if export is not None:
            await env.session.write_file("part.stl", export)
        final = await env.step("<answer>done</answer>")
    finally:
        await env.close()
    return final.reward.components["correct"], final.info


@async_test
async def test_wrong_parts_fail_and_name_what_is_wrong(sandbox, wrong_exports):
    assert (await graded(sandbox, wrong_exports["reference"]))[0] == 1.0
    score, info = await graded(sandbox, wrong_exports["wrong_size"])
    assert score == 0.0 and info["cause"] == "wrong_shape" and not info["checks"]["bbox"]
    score, info = await graded(sandbox, wrong_exports["missing_hole"])
    assert score == 0.0 and not info["checks"]["through_holes"] and not info["checks"]["feature:holes"]
    assert info["reasons"]["through_holes"].startswith("3 through-holes")
    score, info = await graded(sandbox, wrong_exports["other_part"])
    assert score == 0.0 and not info["checks"]["volume"] and not info["checks"]["bbox"]
    score, info = await graded(sandbox, wrong_exports["open"])
    assert score == 0.0 and info["cause"] == "invalid_export" and "not watertight" in info["reasons"]["solid"]
    partial, info = await graded(sandbox, wrong_exports["missing_hole"], options={"partial_credit": True})
    assert 0.5 < partial < 1.0 and info["checks"]["solid"]
    broken, _ = await graded(sandbox, wrong_exports["open"], options={"partial_credit": True})
    assert broken == 0.0, "no part marks for a mesh that is not a solid"


def _fake_box_script(task: dict) -> str:
    """A script that writes, by hand, an STL box with the part's bounding box and no holes, prints
    the expected figures and writes a results file claiming a pass."""
    box = cuboid(task["expected"]["bbox_min"], task["expected"]["bbox_max"])
    return (f"open('/work/part.stl', 'wb').write({ascii_stl(box)!r})\n"
            f"print('volume {task['expected']['volume_mm3']} mm3, through-holes {task['expected']['through_holes']}, PASS')\n"
            f"open('/work/results.json', 'w').write({json.dumps({**task['expected'], 'passed': True})!r})\n")


@async_test
async def test_fake_exports_self_reported_results_and_missing_exports_fail(sandbox):
    task = variant(PLATE)
    score, info = await graded(sandbox, None, scripts=[_fake_box_script(task)])
    assert score == 0.0 and info["checks"]["bbox"] and not info["checks"]["through_holes"]
    score, info = await graded(sandbox, b"solid part\nfacet normal 0 0 1\nvertex 1 2\nendsolid\n")
    assert score == 0.0 and info["cause"] == "invalid_export"
    score, info = await graded(sandbox, None, scripts=["print('the part is built')"])
    assert score == 0.0 and info["cause"] == "no_export"
    env = CadEnv(sandbox=LocalSandbox(sandbox), options={"max_attempts": 1})
    try:
        await env.reset(task)
        final = await env.step("<python>\nraise RuntimeError('no kernel today')\n</python>")
    finally:
        await env.close()
    assert final.done and final.reward.components["correct"] == 0.0 and final.info["cause"] == "script_error"


def _write(path: str, text: str) -> str:
    return f"mkdir -p \"$(dirname {path})\" && cat > {path} <<'POSTRAIN_EOF'\n{text}\nPOSTRAIN_EOF"


@async_test
async def test_the_terminal_suites_reward_hacks_do_not_move_the_grader(sandbox, wrong_exports):
    """As a policy with a shell: modules that the grader would import shadowed in /work (numpy
    with comparisons that always agree, json, the mesh module, sitecustomize), the loader's and
    Python's variables exported, LD_PRELOAD of a library that exits 0. The fake box still fails,
    and the right part still passes: the grader reads the export's bytes, nothing else."""
    always = ("import builtins\nclass Yes(float):\n    def __eq__(self, other): return True\n"
              "    __le__ = __ge__ = __lt__ = __gt__ = __eq__\n"
              "def isclose(*a, **k): return True\nallclose = array_equal = isclose\n")
    hook = "import os; os._exit(0)"
    commands = [_write("/work/numpy/__init__.py", always), _write("/work/json.py", hook),
                _write("/work/mesh.py", hook), _write("/work/sitecustomize.py", hook),
                _write("/work/usercustomize.py", hook), _write("/work/x.pth", hook),
                "export PYTHONPATH=/work PYTHONSTARTUP=/work/sitecustomize.py PYTHONUSERBASE=/work"]
    if CC is not None:
        commands += [_write("/work/h.c", EXIT_0_SO) + f" && {CC} -shared -fPIC -o /work/h.so /work/h.c",
                     "export LD_PRELOAD=/work/h.so"]
    fake = cuboid(variant(PLATE)["expected"]["bbox_min"], variant(PLATE)["expected"]["bbox_max"])
    score, info = await graded(sandbox, ascii_stl(fake), commands=commands)
    assert score == 0.0 and not info["checks"]["through_holes"], info
    score, info = await graded(sandbox, wrong_exports["reference"], commands=commands)
    assert score == 1.0, info


@async_test
async def test_the_grader_parses_in_its_own_jail_and_reports_figures_not_a_verdict(sandbox):
    """A file built to exhaust the parser fails in the jail (no figures), and what comes back
    holds no verdict: the expectations never entered the jail."""
    code, files = measure_request(b"solid x\n" + b"vertex 1 2 3\n" * 3 * (mesh.MAX_TRIANGLES + 1), [[0, 0, 0]])
    assert set(files) == {"part.stl", "points.json"} and json.loads(files["points.json"]) == [[0, 0, 0]]
    result = await LocalSandbox(sandbox).exec(code, files=files, timeout_s=30)
    assert "more than MAX_TRIANGLES" in read_measurement(result)["error"]
    code, files = measure_request(binary_stl(cuboid((0, 0, 0), (1, 1, 1))), [[0.5, 0.5, 0.5]])
    figures = read_measurement(await LocalSandbox(sandbox).exec(code, files=files, timeout_s=30))
    assert figures["euler"] == 2 and figures["winding"][0] == pytest.approx(1.0)
    assert "passed" not in figures and "expected" not in json.dumps(figures)


@pytest.mark.variants
def test_every_variants_reference_passes_the_grader(sandbox):
    """All 180 references, built family by family in one jail run each (build123d imports once),
    each export measured in a jail of its own and judged."""
    failures = []

    async def sweep() -> None:
        for family in suite.FAMILIES:
            tasks = [t for t in all_variants() if t["family"] == family]
            script = "\n".join("exec({!r}, {{}})".format(t["reference"].replace("/work/part.stl", f"/work/{t['id']}.stl"))
                               for t in tasks)
            limits = {"memory_mb": 2048, "call_wall_time_s": 600, "call_cpu_time_s": 600, "work_dir_size_mb": 256}
            async with LocalSandbox(sandbox).session(limits=limits) as session:
                result = await session.run_python(script)
                assert result.status.value == "ok", result.stderr[-2000:]
                for task in tasks:
                    code, files = measure_request(await session.read_file(f"{task['id']}.stl"),
                                                  [p["point"] for p in task["probes"]])
                    verdict = judge(task, read_measurement(await LocalSandbox(sandbox).exec(code, files=files,
                                                                                            timeout_s=60)))
                    if not verdict.passed:
                        failures.append((task["id"], verdict.reasons))

    trio.run(sweep)
    assert not failures, failures
