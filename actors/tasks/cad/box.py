"""The `box` family: a shelled, open-top box, with holes through its floor and a wall.

Outer size L x W x H, centred on the origin in X and Y, bottom on Z = 0; walls and floor t thick;
the top face removed (build123d's `offset` with the top as its opening). Levels:

1. the plain shelled box;
2. with 1-4 holes along Z through the floor;
3. with its four vertical outer edges rounded (radius R > t: the hollow's inside corners have
   radius R - t), 0-2 floor holes and 1-2 holes through one wall.

Expectations in closed form: volume = (L W - 4 R^2 (1 - pi/4)) H
- ((L - 2t)(W - 2t) - 4 (R - t)^2 (1 - pi/4)) (H - t) - sum(pi r^2 t); genus = holes (the open
top makes the hollow part of the outside, so each hole goes through).
"""
from __future__ import annotations

import math
import random

from .part import (CORNER_LOSS, MARGIN_MM, PROBE_OFFSET_MM, Hole, Part, Probe, apart, corner_probes, cut_lines,
                   fits_rounded_rect, holes_text, mm, num)

DIAMETERS = (3, 4, 5, 6, 8)
WALLS = {"+X": ("x", 1), "-X": ("x", -1), "+Y": ("y", 1), "-Y": ("y", -1)}


def make(rng: random.Random, level: int) -> Part:
    """A box of `level` (1-3) drawn from `rng`: dimensions redrawn until every hole fits."""
    for _ in range(1000):
        part = _draw(rng, level)
        if part is not None:
            return part
    raise AssertionError(f"no box of level {level} fits after 1000 draws")


def _draw(rng: random.Random, level: int) -> Part | None:
    length = rng.randrange(40, 125, 5)
    width = rng.randrange(30, min(length, 90) + 1, 5)
    height, wall = rng.randrange(20, 65, 5), rng.choice((2, 2.5, 3, 4))
    radius = rng.randint(math.ceil(wall) + 2, max(math.ceil(wall) + 2, min(length, width) // 5)) if level == 3 else 0
    inner_radius = max(radius - wall, 0)
    num_floor = {1: 0, 2: rng.randint(1, 4), 3: rng.randint(0, 2)}[level]
    diameter = rng.choice(DIAMETERS)
    floor = [Hole("z", (rng.randint(-length // 2, length // 2), rng.randint(-width // 2, width // 2), wall / 2),
                  diameter, wall) for _ in range(num_floor)]
    side = rng.choice(list(WALLS))
    walls = [] if level < 3 else [_wall_hole(rng, side, length, width, height, wall) for _ in range(rng.randint(1, 2))]
    along = {"x": width, "y": length}[WALLS[side][0]] / 2 - max(radius, wall)
    floor_fits = all(fits_rounded_rect(h.center[0], h.center[1], h.radius + MARGIN_MM, length / 2 - wall,
                                       width / 2 - wall, inner_radius) for h in floor)
    wall_fits = all(fits_rounded_rect(_across_wall(h), h.center[2] - (wall + height) / 2, h.radius + MARGIN_MM,
                                      along, (height - wall) / 2, 0) for h in walls)
    clear = _clear_floor_point(floor, length, width)
    if not (floor_fits and wall_fits and apart(floor) and apart(walls)) or clear is None:
        return None
    text = (f"An open-top box: outer size {mm(length)} along X, {mm(width)} along Y and {mm(height)} tall along Z, "
            f"centred on the origin in X and Y, its bottom on Z = 0. Its walls and floor are {mm(wall)} thick and "
            f"its top is open (hollow it out through the top face).")
    lines = ["from build123d import *", "",
             f"part = Box({length}, {width}, {height}, align=(Align.CENTER, Align.CENTER, Align.MIN))"]
    if radius:
        text += (f" Before hollowing, round its four vertical outer edges with fillets of radius {mm(radius)} "
                 f"(so the inside corners have radius {mm(inner_radius)}).")
        lines.append(f"part = fillet(part.edges().filter_by(Axis.Z), radius={radius})")
    lines.append(f"part = offset(part, amount=-{num(wall)}, openings=part.faces().sort_by(Axis.Z)[-1])")
    if floor:
        text += " " + holes_text(floor, "through the floor")
    if walls:
        text += " " + holes_text(walls, f"through the {side} wall")
    lines += cut_lines(floor + walls)
    lines.append('export_stl(part, "/work/part.stl")')
    holes = floor + walls
    rim = height - 0.5
    probes = [p for h in holes for p in h.probes()]
    probes.append(Probe((0.0, 0.0, (wall + height) / 2), False, "hollow"))
    for name, (axis, sign) in WALLS.items():
        for offset, inside in ((PROBE_OFFSET_MM, True), (-PROBE_OFFSET_MM, False)):
            at = sign * ({"x": length, "y": width}[axis] / 2 - wall + offset)
            probes.append(Probe((at, 0.0, rim) if axis == "x" else (0.0, at, rim), inside, "walls"))
    probes += [Probe((clear[0], clear[1], wall - PROBE_OFFSET_MM), True, "floor"),
               Probe((clear[0], clear[1], wall + PROBE_OFFSET_MM), False, "floor")]
    if radius:
        for sx in (-1, 1):
            for sy in (-1, 1):
                probes += corner_probes((sx * length / 2, sy * width / 2), (-sx, -sy), radius, rim)
                probes += _inside_corner_probes(sx, sy, length, width, radius, inner_radius, rim)
    outer = length * width - 4 * radius ** 2 * CORNER_LOSS
    inner = (length - 2 * wall) * (width - 2 * wall) - 4 * inner_radius ** 2 * CORNER_LOSS
    volume = outer * height - inner * (height - wall) - sum(h.volume_mm3 for h in holes)
    return Part("box", level, text, "\n".join(lines) + "\n", volume, (-length / 2, -width / 2, 0.0),
                (length / 2, width / 2, float(height)), len(holes), tuple(probes))


def _wall_hole(rng: random.Random, side: str, length: int, width: int, height: int, wall: float) -> Hole:
    axis, sign = WALLS[side]
    z = rng.randint(math.ceil(wall), height)
    if axis == "x":
        return Hole("x", (sign * (length / 2 - wall / 2), rng.randint(-width // 2, width // 2), z),
                    rng.choice(DIAMETERS), wall)
    return Hole("y", (rng.randint(-length // 2, length // 2), sign * (width / 2 - wall / 2), z),
                rng.choice(DIAMETERS), wall)


def _across_wall(hole: Hole) -> float:
    """A wall hole's position along its wall (y for a hole along X, x for one along Y)."""
    return hole.center[1] if hole.axis == "x" else hole.center[0]


def _clear_floor_point(floor: list[Hole], length: int, width: int) -> tuple[float, float] | None:
    """A floor point 1 mm clear of every floor hole, for the floor's thickness probes."""
    for point in ((0.0, 0.0), (length / 4, 0.0), (-length / 4, 0.0), (0.0, width / 4), (0.0, -width / 4)):
        if all(math.dist(point, h.center[:2]) >= h.radius + 1.0 for h in floor):
            return point
    return None


def _inside_corner_probes(sx: int, sy: int, length: int, width: int, radius: int, inner_radius: float,
                          z: float) -> list[Probe]:
    """The hollow's rounded inside corner: its arc (radius R - t, about the outer arc's centre)
    lies where the spec puts it; a sharp inside corner leaves the outer probe empty."""
    center = (sx * (length / 2 - radius), sy * (width / 2 - radius))
    diagonal = (sx / math.sqrt(2), sy / math.sqrt(2))
    return [Probe((center[0] + diagonal[0] * d, center[1] + diagonal[1] * d, z), inside, "fillets")
            for d, inside in ((inner_radius - PROBE_OFFSET_MM, False), (inner_radius + PROBE_OFFSET_MM, True))]
