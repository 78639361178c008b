"""Measure an STL file's triangle mesh: validity, topology, volume, bounds and point membership.

This module runs inside the CAD grader's jail (`grader.measure_request` ships its source there,
with the export's bytes and the probe points), so it imports only numpy and the standard library,
nothing of postrain; tests import it on the host. `measure(data, points)` returns plain figures,
never a verdict: the host compares them with the part's expectations, which never enter the jail.

How each figure is made (the method the docs describe):

- parsing: a binary STL is recognised by its exact length (84 + 50 x the triangle count in its
  header); anything else must be an ASCII STL (`solid ... facet ... vertex x y z ... endsolid`).
  At most `MAX_TRIANGLES`; a non-finite coordinate, a vertex count that is not a multiple of 3 or
  no triangle at all is a `MeshError`.
- welding: corners with the same coordinates (to 1e-6 mm) are one vertex; triangles whose corners
  weld together (zero area by construction) are dropped.
- `watertight`: every undirected edge is shared by exactly two triangles. `oriented`: every
  directed edge occurs once (so its twin runs the other way: normals agree). `vertex_manifold`:
  the triangles around each vertex form one fan (the corner permutation has exactly one cycle per
  vertex: no two cones pinched at a point, which would add to the Euler count without a hole).
- `euler` = V - E + F of the welded mesh; `num_bodies`: connected pieces (union-find over edges).
  For one closed orientable body the genus, the number of through-holes, is (2 - euler) / 2.
- `volume_mm3`: the divergence theorem, sum of det(v0, v1, v2) / 6 over triangles (about the
  bounding box's centre, for precision); positive when normals point out.
- `winding`: per probe point, the generalized winding number (sum of the triangles' solid angles
  over 4 pi, Van Oosterom and Strackee's formula): about 1 inside a closed outward mesh, 0 outside,
  robust to a point near an edge where a ray parity test is not.
"""
from __future__ import annotations

import json
import math
import re
import struct

import numpy as np

MAX_TRIANGLES = 400_000
MAX_POINTS = 512
WELD_DECIMALS = 6          # corners equal to 1e-6 mm are one vertex
EXPORT_FILE = "part.stl"   # the names in the grader's jail (ours; the policy names nothing there)
POINTS_FILE = "points.json"
_VERTEX = re.compile(rb"vertex\s+(\S+)\s+(\S+)\s+(\S+)")


class MeshError(ValueError):
    """The bytes are not an STL mesh the grader can measure; the message says why."""


def parse_stl(data: bytes) -> np.ndarray:
    """The triangles of a binary or ASCII STL, shape (num_triangles, 3, 3), float64 mm."""
    if len(data) >= 84:
        (count,) = struct.unpack_from("<I", data, 80)
        if len(data) == 84 + 50 * count:
            if count > MAX_TRIANGLES:
                raise MeshError(f"{count} triangles, more than MAX_TRIANGLES={MAX_TRIANGLES}")
            records = np.frombuffer(data, dtype=np.dtype([("normal", "<f4", 3), ("corners", "<f4", (3, 3)),
                                                          ("attribute", "<u2")]), count=count, offset=84)
            return _checked(records["corners"].astype(np.float64))
    if not data.lstrip()[:5].lower() == b"solid":
        raise MeshError(f"not an STL file: {len(data)} bytes, neither a binary STL (84 + 50 x its "
                        f"triangle count) nor ASCII starting with 'solid'")
    return _checked(_ascii_corners(data))


def _ascii_corners(data: bytes) -> np.ndarray:
    text = data.lower()
    count = text.count(b"vertex")
    if count > 3 * MAX_TRIANGLES:
        raise MeshError(f"ASCII STL of {count} vertices, more than MAX_TRIANGLES={MAX_TRIANGLES} facets hold")
    corners = []
    for match in _VERTEX.finditer(text):
        try:
            corners.append([float(w) for w in match.groups()])
        except ValueError:
            raise MeshError(f"ASCII STL: 'vertex' at byte {match.start()} is not followed by three numbers") from None
    if len(corners) != count:
        raise MeshError(f"ASCII STL: {count - len(corners)} 'vertex' not followed by three numbers")
    if len(corners) % 3:
        raise MeshError(f"ASCII STL: {len(corners)} vertices, not a multiple of 3")
    return np.asarray(corners, dtype=np.float64).reshape(-1, 3, 3)


def _checked(triangles: np.ndarray) -> np.ndarray:
    if len(triangles) == 0:
        raise MeshError("the STL holds no triangle")
    if len(triangles) > MAX_TRIANGLES:
        raise MeshError(f"{len(triangles)} triangles, more than MAX_TRIANGLES={MAX_TRIANGLES}")
    if not np.isfinite(triangles).all():
        raise MeshError("the STL has a coordinate that is not a finite number")
    return triangles


def weld(triangles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(vertices (V, 3), faces (F, 3) int64): equal corners made one vertex, degenerate faces dropped."""
    keys = np.round(triangles.reshape(-1, 3), WELD_DECIMALS)
    vertices, index = np.unique(keys, axis=0, return_inverse=True)
    faces = index.reshape(-1, 3).astype(np.int64)
    keep = (faces[:, 0] != faces[:, 1]) & (faces[:, 1] != faces[:, 2]) & (faces[:, 0] != faces[:, 2])
    return vertices, faces[keep]


def _num_bodies(used: np.ndarray, num_vertices: int, edges: np.ndarray) -> int:
    """Connected pieces among the `used` vertices (union-find over the edges)."""
    parent = list(range(num_vertices))

    def root(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    for a, b in edges.tolist():
        ra, rb = root(a), root(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    return sum(1 for v in used.tolist() if parent[v] == v)


def _num_vertex_fans(faces: np.ndarray, num_vertices: int) -> int:
    """The cycles of the corner permutation (for a watertight, oriented mesh): at vertex v of a
    face (v, a, b), the next corner is v's corner in the face across the edge b-v (whose directed
    edge is v -> b). One cycle per vertex iff every vertex is a single fan."""
    corner_v = faces.reshape(-1)
    corner_out = np.roll(faces, -1, axis=1).reshape(-1)     # v -> out is this face's edge
    corner_in = np.roll(faces, 1, axis=1).reshape(-1)       # in -> v
    out_key = corner_v * num_vertices + corner_out
    order = np.argsort(out_key)
    want = corner_v * num_vertices + corner_in
    at = np.searchsorted(out_key[order], want)
    successor = order[np.clip(at, 0, len(order) - 1)]
    label, jump = np.arange(len(successor)), successor
    for _ in range(64):                                      # doubling: cycles up to 2**64 corners
        new = np.minimum(label, label[jump])
        if np.array_equal(new, label):
            break
        label, jump = new, jump[jump]
    return len(np.unique(label))


def winding_numbers(triangles: np.ndarray, points: np.ndarray) -> np.ndarray:
    """The generalized winding number of each point (P,) w.r.t. the triangles (F, 3, 3)."""
    out = np.empty(len(points))
    for i, p in enumerate(points):
        a, b, c = (triangles[:, k, :] - p for k in range(3))          # (F, 3) each
        la, lb, lc = (np.linalg.norm(v, axis=1) for v in (a, b, c))
        det = np.einsum("ij,ij->i", a, np.cross(b, c))
        den = (la * lb * lc + np.einsum("ij,ij->i", a, b) * lc + np.einsum("ij,ij->i", a, c) * lb
               + np.einsum("ij,ij->i", b, c) * la)
        out[i] = 2.0 * np.arctan2(det, den).sum() / (4.0 * math.pi)
    return out


def measure(data: bytes, points: list) -> dict:
    """The figures of an STL's mesh and the winding number at each point; {"error": why} for bytes
    that are no measurable STL. Plain JSON data, no verdict."""
    try:
        triangles = parse_stl(data)
    except MeshError as exc:
        return {"error": str(exc)}
    probe = np.asarray(points, dtype=np.float64).reshape(-1, 3)[:MAX_POINTS]
    vertices, faces = weld(triangles)
    if len(faces) == 0:
        return {"error": "every triangle of the STL is degenerate"}
    directed = np.concatenate([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]])
    undirected, counts = np.unique(np.sort(directed, axis=1), axis=0, return_counts=True)
    watertight = bool((counts == 2).all())
    oriented = watertight and len(np.unique(directed, axis=0)) == len(directed)
    used = np.unique(faces)
    num_vertices = len(used)
    fans = _num_vertex_fans(faces, len(vertices)) if oriented else None
    lo, hi = triangles.reshape(-1, 3).min(axis=0), triangles.reshape(-1, 3).max(axis=0)
    centred = triangles - (lo + hi) / 2
    volume = float(np.einsum("ij,ij->i", centred[:, 0], np.cross(centred[:, 1], centred[:, 2])).sum() / 6.0)
    return {"num_triangles": int(len(triangles)), "num_faces": int(len(faces)), "num_vertices": num_vertices,
            "num_edges": int(len(undirected)), "euler": int(num_vertices - len(undirected) + len(faces)),
            "num_bodies": _num_bodies(used, len(vertices), undirected), "watertight": watertight,
            "oriented": bool(oriented), "vertex_manifold": fans == num_vertices,
            "volume_mm3": volume, "bbox_min": lo.tolist(), "bbox_max": hi.tolist(),
            "winding": winding_numbers(triangles, probe).tolist()}


def main() -> None:
    """In the grader's jail: measure /work/part.stl at /work/points.json's points, print one JSON line."""
    with open(POINTS_FILE) as f:
        points = json.load(f)
    with open(EXPORT_FILE, "rb") as f:
        data = f.read()
    print(json.dumps(measure(data, points)))


if __name__ == "__main__":
    main()
