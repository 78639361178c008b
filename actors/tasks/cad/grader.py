"""The CAD grader: measure the export in a jail of its own, judge the figures on the host.

Where it runs and what it trusts (docs/environments.md, "CAD"): the policy's script ran in the
episode's session, where it could write any file, print anything, shadow modules, patch
comparisons and set LD_PRELOAD. None of that reaches the grader:

1. The export's bytes are copied out of the session by its agent (`read_file`, while no call
   runs, so no process of the policy is alive); nothing else of the session is read: no file the
   script wrote about its results, none of its output.
2. The bytes are parsed in a fresh jail (`measure_request`: a `Sandbox.run` / handle `exec`, new
   namespaces, its own /work, the sandbox's memory, time and output limits, an environment the
   sandbox builds) by `mesh.py`, whose source travels with the request: it imports only numpy and
   the standard library, from the read-only host mounts, and the jail's /work holds only the
   files named here (the policy names none). An STL that crashes or exhausts the parser fails
   there, not on the host.
3. The jail reports figures, never a verdict: volume, bounds, Euler characteristic, bodies,
   edge checks and the winding number at each probe point. The expectations (volume, bounds,
   hole count, which probe is material) never enter the jail; `judge` compares here, on the host.

Checks (`judge`): `solid` (a valid closed solid: watertight, consistently oriented, every
vertex one fan, one body, positive volume), `volume` (within `volume_rel_tol`), `bbox` (each
bound within `bbox_tol_mm`), `through_holes` (genus (2 - euler) / 2 equals the spec's count) and
one `feature:NAME` per probed feature (every probe of it on the right side). A part passes when
all pass; partial credit, where asked for, is the share passed, and 0 unless `solid` passed.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from . import mesh

_FIGURES = {"watertight", "oriented", "vertex_manifold", "num_bodies", "euler", "volume_mm3", "bbox_min",
            "bbox_max", "winding"}
CAUSES = ("ok", "script_error", "no_export", "invalid_export", "wrong_shape")
_MESH_SOURCE = Path(mesh.__file__).read_text(encoding="utf-8")


@dataclasses.dataclass(frozen=True)
class CadVerdict:
    """What the grader found: `checks` {name: passed} in order, `reasons` {name: why it failed},
    `cause` (one of CAUSES), `measured` (the jail's figures, or {"error": ...})."""

    checks: dict[str, bool]
    reasons: dict[str, str]
    cause: str
    measured: dict

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(self.checks.values())

    def score(self, partial_credit: bool = False) -> float:
        """1.0 iff every check passed; with `partial_credit`, the share passed (0 unless `solid`)."""
        if self.passed:
            return 1.0
        if not partial_credit or not self.checks.get("solid"):
            return 0.0
        return sum(self.checks.values()) / len(self.checks)


def probe_points(task: dict) -> list[list[float]]:
    """The probe points alone (what enters the jail; which are material stays here)."""
    return [list(p["point"]) for p in task["probes"]]


def measure_request(export: bytes, points: list[list[float]]) -> tuple[str, dict[str, bytes]]:
    """(code, files) for a sandbox run that measures `export` (an STL's bytes) at `points`."""
    return _MESH_SOURCE, {mesh.EXPORT_FILE: bytes(export), mesh.POINTS_FILE: json.dumps(points).encode()}


def read_measurement(result) -> dict:
    """The figures of a `measure_request` run (an ExecResult, a reply record or its dict): the last
    stdout line's JSON object; {"error": ...} where the run gave none (the parser crashed, ran out
    of memory or time)."""
    stdout = _text(_field(result, "stdout"))
    try:
        report = json.loads(stdout.rstrip("\n").rsplit("\n", 1)[-1])
    except ValueError:
        report = None
    if not isinstance(report, dict) or not ("error" in report or _FIGURES <= set(report)):
        status = _field(result, "status")
        detail = _field(result, "error") or _text(_field(result, "stderr"))[-300:]
        return {"error": f"the measurement gave no figures (status {getattr(status, 'value', status)}): {detail}"}
    return report


def judge(task: dict, measured: dict, *, volume_rel_tol: float = 0.01, bbox_tol_mm: float = 0.1) -> CadVerdict:
    """The verdict on `measured` (from `read_measurement`) against the task's expectations."""
    expected = task["expected"]
    features = list(dict.fromkeys(p["feature"] for p in task["probes"]))
    names = ["solid", "volume", "bbox", "through_holes"] + [f"feature:{f}" for f in features]
    if "error" in measured:
        reason = str(measured["error"])[:300]
        return CadVerdict({n: False for n in names}, {n: reason for n in names}, "invalid_export", measured)
    checks, reasons = {}, {}

    def check(name: str, ok: bool, why: str) -> None:
        checks[name] = bool(ok)
        if not ok:
            reasons[name] = why

    problems = [what for what, bad in (
        ("not watertight (an edge is not shared by exactly two triangles)", not measured["watertight"]),
        ("inconsistently oriented (normals disagree across an edge)", measured["watertight"] and not measured["oriented"]),
        ("a vertex joins separate fans (pinched)", measured["oriented"] and not measured["vertex_manifold"]),
        (f"{measured['num_bodies']} separate bodies, not 1", measured["num_bodies"] != 1),
        (f"volume {measured['volume_mm3']:.1f} mm3 is not positive (inside out)", measured["volume_mm3"] <= 0))
        if bad]
    check("solid", not problems, "; ".join(problems))
    volume, want = measured["volume_mm3"], expected["volume_mm3"]
    check("volume", abs(volume - want) <= volume_rel_tol * want,
          f"volume {volume:.1f} mm3, expected {want:.1f} within {volume_rel_tol:.0%}")
    error = max(abs(a - b) for bound in ("bbox_min", "bbox_max") for a, b in zip(measured[bound], expected[bound]))
    check("bbox", error <= bbox_tol_mm, f"bounding box {_box(measured)} is off by {error:.2f} mm from "
          f"{_box(expected)} (tolerance {bbox_tol_mm} mm)")
    euler = measured["euler"]
    holes = (2 - euler) / 2
    check("through_holes", measured["num_bodies"] == 1 and holes == expected["through_holes"],
          f"{holes:g} through-holes (Euler characteristic {euler}), expected {expected['through_holes']}")
    winding = list(measured.get("winding", []))
    for feature in features:
        wrong = [p for i, p in enumerate(task["probes"]) if p["feature"] == feature
                 and (i >= len(winding) or (winding[i] > 0.5) != p["inside"])]
        total = sum(p["feature"] == feature for p in task["probes"])
        check(f"feature:{feature}", not wrong, f"{len(wrong)} of {total} probes of {feature} on the wrong side, "
              f"e.g. {wrong[0]['point'] if wrong else ''} should be {'material' if wrong and wrong[0]['inside'] else 'empty'}")
    cause = "ok" if all(checks.values()) else "invalid_export" if not checks["solid"] else "wrong_shape"
    return CadVerdict(checks, reasons, cause, measured)


def missing_export(task: dict, cause: str, why: str) -> CadVerdict:
    """The verdict when there is nothing to measure (`cause` "no_export" or "script_error")."""
    features = list(dict.fromkeys(p["feature"] for p in task["probes"]))
    names = ["solid", "volume", "bbox", "through_holes"] + [f"feature:{f}" for f in features]
    return CadVerdict({n: False for n in names}, {n: why for n in names}, cause, {"error": why})


def _box(figures: dict) -> str:
    lo, hi = figures["bbox_min"], figures["bbox_max"]
    return "[" + ", ".join(f"{a:g}..{b:g}" for a, b in zip(lo, hi)) + "]"


def _field(result, name: str):
    return result.get(name) if isinstance(result, dict) else getattr(result, name, None)


def _text(data) -> str:
    data = data or b""
    return data.decode("utf-8", "replace") if isinstance(data, (bytes, bytearray)) else str(data)
