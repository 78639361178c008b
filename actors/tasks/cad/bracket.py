"""The `bracket` family: an L-shaped bracket with holes in its base and its upright.

The base lies on Z = 0 from X = 0 to X = L, centred on Y = 0; the upright stands on Z = 0 from
X = 0 to X = T (the bracket's back face on X = 0). Levels:

1. 1-2 holes along Z through the base;
2. holes through the base and 1-2 along X through the upright;
3. as 2, with the inside edge (along Y at X = T, Z = T) filleted and the base's two free vertical
   edges (at X = L) rounded.

Expectations in closed form: volume = L W T + T W (H - T) + Rf^2 (1 - pi/4) W
- 2 Rc^2 (1 - pi/4) T - sum(pi r^2 T); genus = holes.
"""
from __future__ import annotations

import random

from .part import (CORNER_LOSS, MARGIN_MM, PROBE_OFFSET_MM, Hole, Part, Probe, apart, concave_probes, corner_probes,
                   cut_lines, fits_rounded_rect, holes_text, mm)

DIAMETERS = (3, 4, 5, 6, 8)


def make(rng: random.Random, level: int) -> Part:
    """A bracket of `level` (1-3) drawn from `rng`: dimensions redrawn until every hole fits."""
    for _ in range(1000):
        part = _draw(rng, level)
        if part is not None:
            return part
    raise AssertionError(f"no bracket of level {level} fits after 1000 draws")


def _draw(rng: random.Random, level: int) -> Part | None:
    length, width = rng.randrange(40, 105, 5), rng.randrange(20, 65, 5)
    thickness, height = rng.choice((3, 4, 5, 6, 8)), rng.randrange(30, 85, 5)
    inner = rng.randint(2, 6) if level == 3 else 0
    end = rng.randint(3, max(3, width // 4)) if level == 3 else 0
    base_x0 = thickness + inner                      # holes in the base keep clear of the upright
    base = [_hole(rng, "z", (rng.randint(base_x0, length), rng.randint(-width // 2, width // 2)), thickness)
            for _ in range(rng.randint(1, 2))]
    upright = [] if level == 1 else [
        _hole(rng, "x", (rng.randint(-width // 2, width // 2), rng.randint(thickness + inner, height)), thickness)
        for _ in range(rng.randint(1, 2))]
    base_fits = all(fits_rounded_rect(h.center[0] - (base_x0 + length) / 2, h.center[1], h.radius + MARGIN_MM,
                                      (length - base_x0) / 2, width / 2, end) for h in base)
    upright_fits = all(fits_rounded_rect(h.center[1], h.center[2] - (base_x0 + height) / 2, h.radius + MARGIN_MM,
                                         width / 2, (height - base_x0) / 2, 0) for h in upright)
    if not (base_fits and upright_fits and apart(base) and apart(upright)) or length - base_x0 < 20 \
            or end > (length - base_x0) / 2 - 2:
        return None
    text = (f"An L-shaped bracket. Its base is a plate {mm(length)} along X, {mm(width)} along Y and "
            f"{mm(thickness)} thick, lying on Z = 0 from X = 0 to X = {length}, centred on Y = 0. Its upright is a "
            f"plate {mm(thickness)} thick along X, {mm(width)} along Y and {mm(height)} tall along Z, standing on "
            f"Z = 0 from X = 0 to X = {thickness}, centred on Y = 0.")
    lines = ["from build123d import *", "",
             f"part = Box({length}, {width}, {thickness}, align=(Align.MIN, Align.CENTER, Align.MIN))",
             f"part += Box({thickness}, {width}, {height}, align=(Align.MIN, Align.CENTER, Align.MIN))"]
    if level == 3:
        text += (f" Fillet the inside edge where the base meets the upright (along Y, at X = {thickness}, "
                 f"Z = {thickness}) with radius {mm(inner)}. Round the base's two vertical edges at X = {length} "
                 f"with fillets of radius {mm(end)}.")
        lines += [f"bend = part.edges().filter_by(Axis.Y).filter_by_position(Axis.X, {thickness}, {thickness})",
                  f"part = fillet(bend.filter_by_position(Axis.Z, {thickness}, {thickness}), radius={inner})",
                  f"part = fillet(part.edges().filter_by(Axis.Z).filter_by_position(Axis.X, {length}, {length}), "
                  f"radius={end})"]
    text += " " + holes_text(base, "through the base")
    if upright:
        text += " " + holes_text(upright, "through the upright")
    lines += cut_lines(base + upright)
    lines.append('export_stl(part, "/work/part.stl")')
    holes = base + upright
    middle_x, middle_z, edge_y = (base_x0 + length) / 2, (base_x0 + height) / 2, width / 2 - 0.5
    probes = [p for h in holes for p in h.probes()]
    probes += [Probe((length - 0.5, 0.0, thickness / 2), True, "body"),
               Probe((thickness / 2, 0.0, height - 0.5), True, "body"),
               Probe((middle_x, 0.0, middle_z), False, "body"),
               Probe((middle_x, edge_y, thickness - PROBE_OFFSET_MM), True, "thickness"),
               Probe((middle_x, edge_y, thickness + PROBE_OFFSET_MM), False, "thickness"),
               Probe((thickness - PROBE_OFFSET_MM, edge_y, middle_z), True, "thickness"),
               Probe((thickness + PROBE_OFFSET_MM, edge_y, middle_z), False, "thickness")]
    if level == 3:
        probes += concave_probes((thickness, thickness), (1, 1), inner, 0.0)
        probes += [p for sy in (-1, 1) for p in corner_probes((length, sy * width / 2), (-1, -sy), end, thickness / 2)]
    volume = (length * width * thickness + thickness * width * (height - thickness) + inner ** 2 * CORNER_LOSS * width
              - 2 * end ** 2 * CORNER_LOSS * thickness - sum(h.volume_mm3 for h in holes))
    return Part("bracket", level, text, "\n".join(lines) + "\n", volume, (0.0, -width / 2, 0.0),
                (float(length), width / 2, float(height)), len(holes), tuple(probes))


def _hole(rng: random.Random, axis: str, at: tuple[int, int], thickness: int) -> Hole:
    """A hole through the base (axis z, `at` = (x, y)) or the upright (axis x, `at` = (y, z))."""
    center = (at[0], at[1], thickness / 2) if axis == "z" else (thickness / 2, at[0], at[1])
    return Hole(axis, center, rng.choice(DIAMETERS), thickness)
