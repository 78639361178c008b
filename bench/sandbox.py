"""`postrain bench sandbox`: sandboxed Python snippets, warm and cold, against bare `python -c`.

Peer: `subprocess.run([python, "-c", snippet])` with no isolation, same snippet, same run. For
concurrency 1 and 2 we report executions per second and p50/p99 latency of the warm mode (a pool
of two jailed zygotes) and the cold mode (a fresh nsjail per run). Every figure's peer is the bare
subprocess at the same concurrency. Targets: warm p50 <= 0.5x and throughput >= 2x the peer's;
cold p50 <= 2x. Throughput is the median over rounds; latencies are over all runs of all rounds.

    postrain bench sandbox --json
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time

from postrain.sandbox import Policy, Sandbox, Status

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
    return {"config": {"snippet": SNIPPET.strip(), "runs_per_round": runs, "rounds": rounds,
                       "warm_workers": 2, "python": sys.executable,
                       "peer": "subprocess.run([python, '-c', snippet]), no isolation"},
            "results": results, "peer": peer}
