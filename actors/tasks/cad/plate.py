"""The `plate` family: a rectangular plate with through-holes, rounded corners and hole patterns.

The plate lies centred on the origin in X and Y with its bottom face on Z = 0. Levels:

1. holes of one diameter at listed positions;
2. its four vertical edges filleted, and 2 or 4 holes placed symmetrically;
3. filleted, with a hole pattern: a grid (nx x ny at a pitch) or a bolt circle (n holes equally
   spaced on a circle, the first on +X), a bolt circle sometimes around a larger centre hole.

Expectations in closed form: volume = L W T - 4 R^2 (1 - pi/4) T - sum(pi r^2 T); genus = holes.
"""
from __future__ import annotations

import math
import random

from .part import (CORNER_LOSS, MARGIN_MM, Hole, Part, Probe, apart, corner_probes, cut_lines, fits_rounded_rect,
                   holes_text, mm, num)

DIAMETERS = (3, 4, 5, 6, 8, 10)


def make(rng: random.Random, level: int) -> Part:
    """A plate of `level` (1-3) drawn from `rng`: dimensions redrawn until every hole fits."""
    for _ in range(1000):
        part = _draw(rng, level)
        if part is not None:
            return part
    raise AssertionError(f"no plate of level {level} fits after 1000 draws")


def _draw(rng: random.Random, level: int) -> Part | None:
    length = rng.randrange(50, 125, 5)
    width = rng.randrange(30, min(length, 90) + 1, 5)
    thickness = rng.choice((3, 4, 5, 6, 8, 10))
    radius = 0 if level == 1 else rng.randint(3, max(3, min(length, width) // 6))
    z = thickness / 2
    text = (f"A rectangular plate {mm(length)} along X, {mm(width)} along Y and {mm(thickness)} thick along Z, "
            f"centred on the origin in X and Y, its bottom face on Z = 0.")
    lines = ["from build123d import *", "",
             f"part = Box({length}, {width}, {thickness}, align=(Align.CENTER, Align.CENTER, Align.MIN))"]
    if radius:
        text += f" Round its four vertical edges with fillets of radius {mm(radius)}."
        lines.append(f"part = fillet(part.edges().filter_by(Axis.Z), radius={radius})")
    if level == 1:
        holes = _scattered(rng, length, width, thickness)
        text += " " + holes_text(holes, "through the plate")
        lines += cut_lines(holes)
    elif level == 2:
        holes = _symmetric(rng, length, width, thickness)
        text += " " + holes_text(holes, "through the plate")
        lines += cut_lines(holes)
    else:
        holes, pattern_text, pattern_lines = _pattern(rng, thickness)
        text += " " + pattern_text
        lines += pattern_lines
    if not holes or not apart(holes) or not all(
            fits_rounded_rect(h.center[0], h.center[1], h.radius + MARGIN_MM, length / 2, width / 2, radius)
            for h in holes):
        return None
    if any("math." in line for line in lines):
        lines.insert(1, "import math")
    lines.append('export_stl(part, "/work/part.stl")')
    probes = [p for h in holes for p in h.probes()]
    probes += [Probe((sx * (length / 2 - 0.5), 0.0, z), True, "body") for sx in (-1, 1)]
    probes += [Probe((0.0, sy * (width / 2 - 0.5), z), True, "body") for sy in (-1, 1)]
    if radius:
        probes += [p for sx in (-1, 1) for sy in (-1, 1)
                   for p in corner_probes((sx * length / 2, sy * width / 2), (-sx, -sy), radius, z)]
    volume = (length * width - 4 * radius ** 2 * CORNER_LOSS) * thickness - sum(h.volume_mm3 for h in holes)
    return Part("plate", level, text, "\n".join(lines) + "\n", volume, (-length / 2, -width / 2, 0.0),
                (length / 2, width / 2, float(thickness)), len(holes), tuple(probes))


def _scattered(rng: random.Random, length: int, width: int, thickness: int) -> list[Hole]:
    diameter = rng.choice(DIAMETERS[:5])
    return [Hole("z", (rng.randint(-length // 2 + 4, length // 2 - 4), rng.randint(-width // 2 + 4, width // 2 - 4),
                       thickness / 2), diameter, thickness) for _ in range(rng.randint(1, 3))]


def _symmetric(rng: random.Random, length: int, width: int, thickness: int) -> list[Hole]:
    diameter = rng.choice(DIAMETERS)
    a = rng.randint(length // 6, length // 2 - 4)
    if rng.random() < 0.4:
        return [Hole("z", (sx * a, 0, thickness / 2), diameter, thickness) for sx in (-1, 1)]
    b = rng.randint(width // 6, width // 2 - 4)
    return [Hole("z", (sx * a, sy * b, thickness / 2), diameter, thickness) for sy in (-1, 1) for sx in (-1, 1)]


def _pattern(rng: random.Random, thickness: int) -> tuple[list[Hole], str, list[str]]:
    """A grid or a bolt circle: its holes, its sentence, the script's loop."""
    z, cut = thickness / 2, thickness + 2
    diameter = rng.choice(DIAMETERS[:4])
    r = diameter / 2
    if rng.random() < 0.5:
        nx, ny = rng.randint(2, 4), rng.randint(2, 3)
        px, py = rng.randint(diameter + 4, 25), rng.randint(diameter + 4, 20)
        holes = [Hole("z", ((i - (nx - 1) / 2) * px, (j - (ny - 1) / 2) * py, z), diameter, thickness)
                 for j in range(ny) for i in range(nx)]
        text = (f"Drill a grid of {nx} x {ny} through-holes of diameter {mm(diameter)} along Z, {nx} along X at a "
                f"pitch of {mm(px)} and {ny} along Y at a pitch of {mm(py)}, the grid centred on the origin.")
        lines = [f"for i in range({nx}):", f"    for j in range({ny}):",
                 f"        x, y = (i - {num((nx - 1) / 2)}) * {px}, (j - {num((ny - 1) / 2)}) * {py}",
                 f"        part -= Pos(x, y, {num(z)}) * Cylinder({num(r)}, {cut})"]
        return holes, text, lines
    count, circle = rng.randint(3, 8), rng.randint(8, 30)
    holes = [Hole("z", (circle * math.cos(2 * math.pi * k / count), circle * math.sin(2 * math.pi * k / count), z),
                  diameter, thickness) for k in range(count)]
    text = (f"Drill {count} through-holes of diameter {mm(diameter)} along Z, equally spaced on a circle of radius "
            f"{mm(circle)} centred on the origin, the first at +X (angle 0), the rest counter-clockwise.")
    lines = [f"for k in range({count}):", f"    a = 2 * math.pi * k / {count}",
             f"    part -= Pos({circle} * math.cos(a), {circle} * math.sin(a), {num(z)}) * Cylinder({num(r)}, {cut})"]
    largest = int(2 * (circle - r - MARGIN_MM))
    if rng.random() < 0.5 and largest >= 6:
        centre = rng.randrange(6, largest + 1, 2)
        holes.append(Hole("z", (0, 0, z), centre, thickness))
        text += f" Drill a centre through-hole of diameter {mm(centre)} along Z at the origin."
        lines.append(f"part -= Pos(0, 0, {num(z)}) * Cylinder({num(centre / 2)}, {cut})")
    return holes, text, lines
