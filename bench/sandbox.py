"""`postrain bench sandbox`: sandboxed Python snippets, warm and cold, against bare `python -c`;
sessions against bare bash and cold jails.

Peer: `subprocess.run([python, "-c", snippet])` with no isolation, same snippet, same run. For
concurrency 1 and 2 we report executions per second and p50/p99 latency of the warm mode (a pool
of two jailed zygotes) and the cold mode (a fresh nsjail per run). Every figure's peer is the bare
subprocess at the same concurrency. Targets: warm p50 <= 0.5x and throughput >= 2x the peer's;
cold p50 <= 2x. Throughput is the median over rounds; latencies are over all runs of all rounds.

Session rows (a session is one jail per episode, see `postrain.sandbox.session`):
- session_open_p50_ms / _p99_ms: opening a session with a spare jail ready (the warm pool is
  given time to refill between opens); peer: starting a cold session jail (no spare). Target
  p50 <= 20 ms.
- session_cmd_p50_ms: a short shell command in an open session, calls 20 ms apart (the agent's
  turn between two commands); peer: the same command run bare on the host (`bash -c`, no
  isolation), paced alike. Target ratio <= 1.5.
- sessions_c1/c2_per_s: whole episodes (open, one command, close) per second at concurrency 1 and
  2, spares refilling in the background as they would in a run; peer: the same command in a cold
  nsjail per episode.
- episode_10_cmds_ms: one session running 10 commands (open and close included); peer: the 10
  commands in 10 cold jails, one each.

    postrain bench sandbox --json
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time

from postrain.sandbox import Policy, Sandbox, SessionLimits, Status
from postrain.sandbox.policy import nsjail_argv

SNIPPET = "import json\nprint(json.dumps({'total': sum(range(1000))}))\n"
EXPECTED = b'{"total": 499500}\n'


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _measure(call, concurrency: int, runs_per_round: int, rounds: int) -> dict:
    """Run `call` runs_per_round times per round with `concurrency` threads; latency in ms."""
    latencies: list[float] = []
    throughputs: list[float] = []
    for _ in range(rounds):
        lock = threading.Lock()
        todo = [runs_per_round]

        def worker():
            while True:
                with lock:
                    if todo[0] == 0:
                        return
                    todo[0] -= 1
                t0 = time.perf_counter()
                call()
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt * 1000)

        threads = [threading.Thread(target=worker) for _ in range(concurrency)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        throughputs.append(runs_per_round / (time.perf_counter() - t0))
    return {"p50_ms": round(_percentile(latencies, 0.5), 3), "p99_ms": round(_percentile(latencies, 0.99), 3),
            "execs_per_s": round(statistics.median(throughputs), 2)}


def _bare() -> None:
    out = subprocess.run([sys.executable, "-c", SNIPPET], stdout=subprocess.PIPE, check=True).stdout
    assert out == EXPECTED, out


def _sandboxed(sandbox: Sandbox):
    def call() -> None:
        result = sandbox.run(SNIPPET)
        assert result.status is Status.OK and result.stdout == EXPECTED, result.summary()
    return call


def run(quick: bool) -> dict:
    runs, rounds = (12, 2) if quick else (40, 3)
    policy = Policy(wall_time_s=10, memory_mb=512)
    results: dict[str, float] = {}
    peer: dict[str, float] = {}
    with Sandbox(policy, mode="warm", num_workers=2) as warm, Sandbox(policy, mode="cold",
                                                                       num_workers=2) as cold:
        for call in (_bare, _sandboxed(warm), _sandboxed(cold)):
            call()  # warm-up: page cache, first fork
        for concurrency in (1, 2):
            bare = _measure(_bare, concurrency, runs, rounds)
            for mode, sandbox in (("warm", warm), ("cold", cold)):
                ours = _measure(_sandboxed(sandbox), concurrency, runs, rounds)
                for figure, value in ours.items():
                    key = f"{mode}_c{concurrency}_{figure}"
                    results[key] = value
                    peer[key] = bare[figure]
    session_results, session_peer = _sessions(policy, quick)
    results.update(session_results)
    peer.update(session_peer)
    return {"config": {"snippet": SNIPPET.strip(), "runs_per_round": runs, "rounds": rounds,
                       "warm_workers": 2, "python": sys.executable,
                       "peer": "subprocess.run([python, '-c', snippet]), no isolation",
                       "session_command": COMMAND, "session_peers": "open: a cold session jail; "
                       "cmd: bare bash -c on the host; per_s and episode: cold nsjail + bash per command"},
            "results": results, "peer": peer}


COMMAND = "echo step >> log.txt && wc -l < log.txt"
NUM_SPARE = 2
LIMITS = SessionLimits()


def _bare_bash() -> None:
    subprocess.run(["bash", "--noprofile", "--norc", "-c", "echo step && echo 1"], stdout=subprocess.PIPE,
                   check=True)


def _cold_jail(policy: Policy):
    argv = nsjail_argv(policy, cold=True) + ["/bin/bash", "--noprofile", "--norc", "-c", COMMAND]

    def call() -> None:
        subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, check=True)
    return call


def _paced(call, runs: int, gap_s: float = 0.02) -> float:
    """p50 latency in ms of `call`, runs `gap_s` apart (an agent's turn lies between two commands;
    a session forks the next call's processes in that time)."""
    latencies = []
    for _ in range(runs):
        time.sleep(gap_s)
        t0 = time.perf_counter()
        call()
        latencies.append((time.perf_counter() - t0) * 1000)
    return round(_percentile(latencies, 0.5), 3)


def _wait_for_spare(sandbox: Sandbox, num_spare: int = 1) -> None:
    deadline = time.monotonic() + 30
    while sandbox.num_spare_sessions(LIMITS) < num_spare and time.monotonic() < deadline:
        time.sleep(0.005)


def _sessions(policy: Policy, quick: bool) -> tuple[dict, dict]:
    opens, cmds, episodes = (20, 40, 12) if quick else (60, 120, 40)
    results: dict[str, float] = {}
    peer: dict[str, float] = {}
    with Sandbox(policy, mode="cold", num_spare_sessions=NUM_SPARE) as sandbox:
        sandbox.prewarm_sessions(LIMITS)
        open_ms, cold_open_ms = [], []
        for _ in range(opens):
            _wait_for_spare(sandbox)
            t0 = time.perf_counter()
            session = sandbox.session(limits=LIMITS)
            open_ms.append((time.perf_counter() - t0) * 1000)
            session.close()
        with Sandbox(policy, mode="cold", num_spare_sessions=0) as cold:
            for _ in range(max(opens // 2, 5)):
                t0 = time.perf_counter()
                cold.session(limits=LIMITS).close()
                cold_open_ms.append((time.perf_counter() - t0) * 1000)
        results["session_open_p50_ms"] = round(_percentile(open_ms, 0.5), 3)
        results["session_open_p99_ms"] = round(_percentile(open_ms, 0.99), 3)
        peer["session_open_p50_ms"] = round(_percentile(cold_open_ms, 0.5), 3)
        peer["session_open_p99_ms"] = round(_percentile(cold_open_ms, 0.99), 3)

        _wait_for_spare(sandbox)
        with sandbox.session(limits=LIMITS) as session:
            _wait_for_spare(sandbox, NUM_SPARE)  # measure the commands, not the pool refilling
            def in_session() -> None:
                result = session.run("echo step && echo 1")
                assert result.status is Status.OK, result.summary()
            in_session()
            _bare_bash()
            ours, bare = _paced(in_session, cmds), _paced(_bare_bash, cmds)
        results["session_cmd_p50_ms"], peer["session_cmd_p50_ms"] = ours, bare

        def episode() -> None:
            with sandbox.session(limits=LIMITS) as s:
                assert s.run(COMMAND).stdout == b"1\n"
        cold_jail = _cold_jail(policy)
        for concurrency in (1, 2):
            _wait_for_spare(sandbox)
            key = f"sessions_c{concurrency}_per_s"
            results[key] = _measure(episode, concurrency, episodes, 1)["execs_per_s"]
            peer[key] = _measure(cold_jail, concurrency, episodes, 1)["execs_per_s"]

        def ten_commands() -> None:
            with sandbox.session(limits=LIMITS) as s:
                for _ in range(10):
                    assert s.run(COMMAND).ok
        episode_ms, cold_ms = [], []
        for _ in range(3 if quick else 7):
            _wait_for_spare(sandbox)
            t0 = time.perf_counter()
            ten_commands()
            episode_ms.append((time.perf_counter() - t0) * 1000)
            t0 = time.perf_counter()
            for _ in range(10):
                cold_jail()
            cold_ms.append((time.perf_counter() - t0) * 1000)
        results["episode_10_cmds_ms"] = round(statistics.median(episode_ms), 3)
        peer["episode_10_cmds_ms"] = round(statistics.median(cold_ms), 3)
    return results, peer
