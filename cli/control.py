"""`postrain status RUN_DIR` and `postrain down RUN_DIR`: talk to a running head.

The head writes its control address to RUN_DIR/head.json; both commands ask
it over ZeroMQ. `status` prints every actor (state, pid, restarts, placement,
heartbeat age, load) and the free pools; for a run on a cluster, also every node (alive or
lost, its free room) and the node of each actor. `down` asks the head to stop the run
cleanly (the driver finishes its step and checkpoints, then every actor stops).

A run folder without a running head (no head.json) is described from its files: a finished
run shows its summary.json, a stopped one the `postrain up --resume` that continues it; both
commands then exit 0. A folder that holds no run is an error.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import anyio

from postrain.core.control import SHUTDOWN, STATUS
from postrain.core.errors import ActorError
from postrain.core.messages import MessageKind, ReplyT
from postrain.core.node import Node
from postrain.core.transport import CurveKeys

from .live import load_text

HELP = "show a running head's actors and pools (`postrain status RUN_DIR`)"


def add_arguments(parser) -> None:
    parser.add_argument("run_folder", help="the run folder (run_dir/name) of a running `postrain up`")
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")


def head_address(run_folder: str) -> str:
    """The address of the running head of the run in `run_folder`; SystemExit (one line) where
    there is none: not_running() says why."""
    path = Path(run_folder) / "head.json"
    try:
        return json.loads(path.read_text())["address"]
    except (OSError, ValueError, KeyError):
        raise SystemExit(f"postrain: no running head in {run_folder}: {path} is missing or unreadable "
                         "(is `postrain up` running with this run folder?)") from None


def control_client_keys(keys: CurveKeys | None) -> dict | None:
    """What head.json carries for `status` and `down` to reach a head on tcp (Curve even on
    loopback): the client's half and the server's public key, never a server secret or the
    bulk key. The run folder is the run user's only (0700)."""
    if keys is None:
        return None
    return {name: getattr(keys, name).decode() for name in ("server_public", "client_public", "client_secret")}


def _client_keys(run_folder: str) -> CurveKeys | None:
    found = json.loads((Path(run_folder) / "head.json").read_text()).get("client_keys")
    if not found:
        return None
    return CurveKeys(found["server_public"].encode(), b"", found["client_public"].encode(),
                     found["client_secret"].encode())


def not_running(run_folder: str, command: str = "status") -> dict | None:
    """None while a head serves the run in `run_folder` (its head.json); else what the folder says:
    {"state": "finished", "summary": {...}} (its summary.json) or {"state": "stopped", ...}.
    SystemExit (one line) for a folder that holds no run."""
    folder = Path(run_folder)
    if (folder / "head.json").exists():
        return None
    if (folder / "summary.json").exists():
        try:
            return {"state": "finished", "run_folder": str(folder),
                    "summary": json.loads((folder / "summary.json").read_text())}
        except (OSError, ValueError) as exc:
            raise SystemExit(f"postrain {command}: the run in {folder} finished but its summary.json is "
                             f"unreadable ({exc})") from None
    if (folder / "config.toml").exists():
        return {"state": "stopped", "run_folder": str(folder),
                "resume": f"postrain up --resume {folder}"}
    raise SystemExit(f"postrain {command}: {folder} holds no run (no head.json, summary.json or "
                     "config.toml); pass the run folder (run_dir/name) that `postrain up` wrote")


def print_not_running(state: dict, as_json: bool, verb: str = "") -> None:
    """A run without a head, in words or as one JSON object."""
    if as_json:
        print(json.dumps(state, indent=2))
    elif state["state"] == "finished":
        print(f"the run in {state['run_folder']} has finished{verb}; its summary:")
        print(json.dumps(state["summary"], indent=2))
    else:
        print(f"the run in {state['run_folder']} is not running (stopped before it finished){verb}; "
              f"`{state['resume']}` continues it")


async def ask_head(run_folder: str, kind: MessageKind[None, ReplyT]) -> ReplyT:
    """Ask the head of the run in `run_folder` one request (STATUS, SHUTDOWN). Cancelled: the head
    may still act on it (a `shutdown` once received runs to the end); nothing is left on this side."""
    address = head_address(run_folder)
    async with Node("cli", _client_keys(run_folder)) as node:
        try:
            return await node.ref(address, "head").call(kind, timeout_s=5)
        except ActorError as exc:
            raise SystemExit(f"postrain: the head at {address} (from {run_folder}/head.json) did not answer: "
                             f"{exc}; if its process is gone, `postrain up --resume {run_folder}` continues "
                             "the run") from None
    # Node.__aexit__ swallows an exception only when its own cancel scope was cancelled: nothing does
    # that during the call, so the block above returns or raises
    raise AssertionError("unreachable: the node ended without the head's reply")


def main(args) -> int:
    state = not_running(args.run_folder)
    if state is not None:
        print_not_running(state, args.json)
        return 0
    status = anyio.run(ask_head, args.run_folder, STATUS, backend="trio")
    if args.json:   # every field, None included (the wire form leaves None out)
        print(json.dumps(dataclasses.asdict(status), indent=2))
        return 0
    print(f"head pid {status.head.pid} at {status.head.address}; free: {status.pools.get('free', '-')}")
    for node in status.nodes or []:   # a run on a cluster
        if node.state == "lost":
            print(f"node {node.name} ({node.address}): lost ({node.reason})")
        else:
            print(f"node {node.name} ({node.address}): alive, {len(node.actors)} actors; free: {node.free or '-'}")
    for actor in status.actors:
        age = actor.heartbeat_age_s
        where = f"  node {actor.node}" if actor.node is not None else ""
        load = actor.load.to_wire() if actor.load is not None else None
        print(f"  {actor.name:<14} {actor.state:<10} pid {actor.pid!s:<7} restarts {actor.restarts}"
              f"  heartbeat {age if age is not None else '-'} s{where}  {actor.placement}  "
              f"load {load_text(load)}")
    return 0


def down_main(args) -> int:
    state = not_running(args.run_folder, "down")
    if state is not None:
        print_not_running(state, False, "; nothing to stop")
        return 0
    anyio.run(ask_head, args.run_folder, SHUTDOWN, backend="trio")
    print("shutting down")
    return 0

