"""Where an actor process computes: its CPU cores and its compute threads.

The scheduler's placement (core/scheduler.py) becomes an actor process's cores and thread count
as the process starts (`pin_cpus`, core/runtime.py); the head may move a running actor to other
cores (elastic cores, core/elastic.py: the kernel message `_cores`), which `pin_threads` applies
to every thread of the process.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Collection

log = logging.getLogger("postrain.core")


def pin_threads(cpu_ids: Collection[int]) -> None:
    """Pin every thread of this process to `cpu_ids` (sched_setaffinity(0) pins only the
    calling thread). A thread started meanwhile inherits its creator's cores, so the pass is
    repeated until no new thread appears."""
    done: set[int] = set()
    while True:
        tids = {int(tid) for tid in os.listdir("/proc/self/task")} - done
        if not tids:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpu_ids)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        done |= tids


def pin_cpus(cpu_ids: Collection[int] | None, num_threads: int | None) -> None:
    """Pin this process (its calling thread, before it starts any other) to `cpu_ids` and set
    the thread counts of the compute libraries to `num_threads` (each None: left alone)."""
    if cpu_ids:
        try:
            os.sched_setaffinity(0, cpu_ids)
        except (AttributeError, OSError) as exc:
            log.warning("could not pin to cores %s: %s", cpu_ids, exc)
    if num_threads:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
            os.environ[var] = str(num_threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(num_threads)
