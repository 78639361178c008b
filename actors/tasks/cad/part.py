"""A CAD variant as the grader knows it: the spec in words, the reference script, the expectations.

A family module (plate.py, bracket.py, box.py) draws a variant's dimensions from a seeded rng
and builds a `Part`: the description the prompt shows, the reference build123d script, and what
the grader checks, computed from the dimensions in closed form (never by running the script):
`volume_mm3`, the bounding box, `through_holes` (the genus of the solid) and `probes`, points
with the answer "inside the material" or "not", each labelled with the feature it tests. A
test runs every reference script through the grader, which holds the formulas and the scripts to
each other.

Probes around a feature sit `PROBE_OFFSET_MM` off its intended surface on either side, so the
feature's surface must lie within that distance of where the spec puts it: a hole's wall within
0.25 mm of its radius (8 directions), a fillet's arc within 0.25 mm along its bisector.
Generation keeps every feature `MARGIN_MM` clear of the others and of the outline, so every
probe's answer is the spec's, not an accident of a neighbour.
"""
from __future__ import annotations

import dataclasses
import math

PROBE_OFFSET_MM = 0.25
MARGIN_MM = 2.0
EXPORT_PATH = "/work/part.stl"
CORNER_LOSS = 1.0 - math.pi / 4.0     # area a fillet of radius 1 takes off a right-angled corner
AXES = {"x": (1, 0, 0), "y": (0, 1, 0), "z": (0, 0, 1)}
ROTATIONS = {"x": "Rot(0, 90, 0) * ", "y": "Rot(90, 0, 0) * ", "z": ""}   # a Cylinder's Z onto the axis


@dataclasses.dataclass(frozen=True)
class Probe:
    """A point and whether the finished part's material holds it; `feature` names what it tests."""

    point: tuple[float, float, float]
    inside: bool
    feature: str

    def to_dict(self) -> dict:
        return {"point": [round(c, 6) for c in self.point], "inside": self.inside, "feature": self.feature}


@dataclasses.dataclass(frozen=True)
class Hole:
    """A through-hole: its axis ("x", "y" or "z"), a point on that axis at the middle of the
    material it goes through, its diameter and the length of material it cuts (mm)."""

    axis: str
    center: tuple[float, float, float]
    diameter: float
    length: float

    @property
    def radius(self) -> float:
        return self.diameter / 2

    @property
    def volume_mm3(self) -> float:
        return math.pi * self.radius ** 2 * self.length

    def cutter(self) -> str:
        """The build123d expression of the cylinder that cuts it (1 mm longer on each side)."""
        x, y, z = (num(c) for c in self.center)
        return f"Pos({x}, {y}, {z}) * {ROTATIONS[self.axis]}Cylinder({num(self.radius)}, {num(self.length + 2)})"

    def probes(self, feature: str = "holes") -> list[Probe]:
        """The axis point (empty), 8 points just inside the wall (empty), 8 just beyond it (material)."""
        u, v = [axis for name, axis in AXES.items() if name != self.axis]
        x, y, z = self.center
        out = [Probe(self.center, False, feature)]
        for k in range(8):
            angle = 2 * math.pi * k / 8 + math.pi / 8
            for radius, inside in ((self.radius - PROBE_OFFSET_MM, False), (self.radius + PROBE_OFFSET_MM, True)):
                du, dv = radius * math.cos(angle), radius * math.sin(angle)
                point = (x + du * u[0] + dv * v[0], y + du * u[1] + dv * v[1], z + du * u[2] + dv * v[2])
                out.append(Probe(point, inside, feature))
        return out


@dataclasses.dataclass(frozen=True)
class Part:
    """One variant: the spec in words, the reference script, and the grader's expectations."""

    family: str
    level: int
    description: str
    script: str
    volume_mm3: float
    bbox_min: tuple[float, float, float]
    bbox_max: tuple[float, float, float]
    through_holes: int
    probes: tuple[Probe, ...]

    def task(self, task_id: str) -> dict:
        """The task dict (plain data: it travels over the wire). The expectations stay on the
        host: the environment keeps the task, the policy sees the prompt."""
        return {"id": task_id, "family": self.family, "level": self.level, "description": self.description,
                "export_path": EXPORT_PATH, "reference": self.script,
                "expected": {"volume_mm3": round(self.volume_mm3, 6), "bbox_min": list(self.bbox_min),
                             "bbox_max": list(self.bbox_max), "through_holes": self.through_holes},
                "probes": [p.to_dict() for p in self.probes]}


def num(value: float) -> str:
    """A dimension as the spec and the script write it: 12, 12.5, -3.25."""
    value = round(float(value), 3)
    return str(int(value)) if value == int(value) else f"{value:g}"


def mm(value: float) -> str:
    return f"{num(value)} mm"


def fits_rounded_rect(x: float, y: float, clearance: float, half_x: float, half_y: float, radius: float) -> bool:
    """A disc of radius `clearance` at (x, y) lies inside the rectangle |x| <= half_x, |y| <= half_y
    whose corners are rounded with `radius` (0: sharp)."""
    x, y = abs(x), abs(y)
    if x > half_x - clearance or y > half_y - clearance:
        return False
    cx, cy = half_x - radius, half_y - radius
    if clearance >= radius or x <= cx or y <= cy:
        return True
    return math.hypot(x - cx, y - cy) <= radius - clearance


def apart(holes: list[Hole], margin: float = MARGIN_MM) -> bool:
    """No two holes of the same axis come closer than `margin` (wall to wall)."""
    for i, a in enumerate(holes):
        for b in holes[i + 1:]:
            if a.axis == b.axis and math.dist(_across(a), _across(b)) < a.radius + b.radius + margin:
                return False
    return True


def _across(hole: Hole) -> tuple[float, ...]:
    keep = [i for i, name in enumerate(AXES) if name != hole.axis]
    return tuple(hole.center[i] for i in keep)


def corner_probes(corner: tuple[float, float], inward: tuple[float, float], radius: float, z: float,
                  feature: str = "fillets") -> list[Probe]:
    """A convex vertical corner (in XY, at height `z`) rounded with `radius`: the corner's tip is
    empty, the arc's surface lies where the spec puts it (probes across it on the bisector).
    `inward` is the unit step from the corner into the material along X and Y (e.g. (-1, -1))."""
    diagonal = (inward[0] / math.sqrt(2), inward[1] / math.sqrt(2))
    center = (corner[0] + inward[0] * radius, corner[1] + inward[1] * radius)
    surface = (center[0] - diagonal[0] * radius, center[1] - diagonal[1] * radius)
    tip = (corner[0] + inward[0] * 0.1 * radius, corner[1] + inward[1] * 0.1 * radius)
    points = [(tip, False), ((surface[0] - diagonal[0] * PROBE_OFFSET_MM, surface[1] - diagonal[1] * PROBE_OFFSET_MM), False),
              ((surface[0] + diagonal[0] * PROBE_OFFSET_MM, surface[1] + diagonal[1] * PROBE_OFFSET_MM), True)]
    return [Probe((p[0], p[1], z), inside, feature) for p, inside in points]


def concave_probes(corner: tuple[float, float], outward: tuple[float, float], radius: float, y: float,
                   feature: str = "inner_fillet") -> list[Probe]:
    """An inside (concave) corner in the XZ plane filled with a fillet of `radius`: the corner's
    nook is material, the arc's surface lies where the spec puts it. `outward` is the unit step
    from the corner into the empty side along X and Z."""
    diagonal = (outward[0] / math.sqrt(2), outward[1] / math.sqrt(2))
    center = (corner[0] + outward[0] * radius, corner[1] + outward[1] * radius)
    surface = (center[0] - diagonal[0] * radius, center[1] - diagonal[1] * radius)
    nook = (corner[0] + outward[0] * 0.1 * radius, corner[1] + outward[1] * 0.1 * radius)
    points = [(nook, True), ((surface[0] - diagonal[0] * PROBE_OFFSET_MM, surface[1] - diagonal[1] * PROBE_OFFSET_MM), True),
              ((surface[0] + diagonal[0] * PROBE_OFFSET_MM, surface[1] + diagonal[1] * PROBE_OFFSET_MM), False)]
    return [Probe((p[0], y, p[1]), inside, feature) for p, inside in points]


def holes_text(holes: list[Hole], where: str) -> str:
    """One sentence per diameter of holes along one axis: 'Drill 2 through-holes of diameter 5 mm
    along Z through the plate, centred at (x, y) = (10, 5), (-10, 5).'"""
    assert len({h.axis for h in holes}) == 1, "holes_text takes the holes of one axis"
    out = []
    for diameter in sorted({h.diameter for h in holes}):
        group = [h for h in holes if h.diameter == diameter]
        axis = group[0].axis
        names = [n for n in "xyz" if n != axis]
        index = ["xyz".index(n) for n in names]
        at = ", ".join(f"({num(h.center[index[0]])}, {num(h.center[index[1]])})" for h in group)
        count = "a through-hole" if len(group) == 1 else f"{len(group)} through-holes"
        out.append(f"Drill {count} of diameter {mm(diameter)} along {axis.upper()} {where}, centred at "
                   f"({names[0]}, {names[1]}) = {at}.")
    return " ".join(out)


def cut_lines(holes: list[Hole]) -> list[str]:
    """The script's lines that cut `holes`."""
    return [f"part -= {h.cutter()}" for h in holes]
