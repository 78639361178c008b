"""`postrain status RUN_DIR` and `postrain down RUN_DIR`: talk to a running head.

The head writes its control address to RUN_DIR/head.json; both commands ask
it over ZeroMQ. `status` prints every actor (state, pid, restarts, placement,
heartbeat age, load) and the free pools; for a run on a cluster, also every node (alive or
lost, its free room) and the node of each actor. `down` asks the head to stop the run
cleanly (the driver finishes its step and checkpoints, then every actor stops).
"""
from __future__ import annotations

import json
from pathlib import Path

import anyio

from postrain.core.errors import ActorError
from postrain.core.node import Node

from .live import load_text

HELP = "show a running head's actors and pools (`postrain status RUN_DIR`)"


def add_arguments(parser) -> None:
    parser.add_argument("run_folder", help="the run folder (run_dir/name) of a running `postrain up`")
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")


def head_address(run_folder: str) -> str:
    path = Path(run_folder) / "head.json"
    try:
        return json.loads(path.read_text())["address"]
    except FileNotFoundError:
        raise SystemExit(f"no running head in {run_folder}: {path} is missing "
                         "(is `postrain up` running with this run folder?)") from None


async def ask_head(run_folder: str, kind: str) -> object:
    """Ask the head of the run in `run_folder` one request. Cancelled: the head may still act on
    it (a `shutdown` once received runs to the end); nothing is left on this side."""
    address = head_address(run_folder)
    async with Node("cli") as node:
        try:
            return await node.ref(address, "head").ask(kind, timeout_s=5)
        except ActorError as exc:
            raise SystemExit(f"the head at {address} did not answer: {exc}") from None


def main(args) -> int:
    status = anyio.run(ask_head, args.run_folder, "status", backend="trio")
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"head pid {status['head']['pid']} at {status['head']['address']}; free: {status['pools']['free']}")
    for node in status.get("nodes", []):   # a run on a cluster
        if node["state"] == "lost":
            print(f"node {node['name']} ({node['address']}): lost ({node['reason']})")
        else:
            print(f"node {node['name']} ({node['address']}): alive, {len(node['actors'])} actors; "
                  f"free: {node['free'] or '-'}")
    for actor in status["actors"]:
        age = actor["heartbeat_age_s"]
        where = f"  node {actor['node']}" if "node" in actor else ""
        print(f"  {actor['name']:<14} {actor['state']:<10} pid {actor['pid']!s:<7} restarts {actor['restarts']}"
              f"  heartbeat {age if age is not None else '-'} s{where}  {actor['placement']}  "
              f"load {load_text(actor['load'])}")
    return 0


def down_main(args) -> int:
    print(anyio.run(ask_head, args.run_folder, "shutdown", backend="trio"))
    return 0

