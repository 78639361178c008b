"""Benchmark `rl_ops`: chunked token logprobs against the naive full-logits path, on the CPU.

    postrain bench rl_ops --json

One LM-head step (logits = hidden @ weight^T, log-softmax, gather, backward into hidden and
weight) on a 32k vocabulary. Ours: `token_logprobs_from_hidden` (chunked forward and
backward); peer: `naive_token_logprobs` on full fp32 logits. Figures: time per forward +
backward (median over repeats, this process, one torch thread) and peak extra resident memory
(one fresh subprocess per path, glibc told to unmap every block >= 1 MiB on free; after a
small warm-up step the kernel's peak-RSS mark is reset, so the figure is the step's own
high-water mark above what was resident before it).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import torch

from postrain.ext.logprobs import auto_chunk_size_tokens, naive_token_logprobs, token_logprobs_from_hidden

PATHS = ("chunked", "naive")

# Runs in a fresh interpreter: python -c CHILD PATH N V H CHUNK -> prints {"peak_mb": ...}.
CHILD = r"""
import json, re, resource, sys
import torch
from postrain.ext.logprobs import naive_token_logprobs, token_logprobs_from_hidden

def rss_mark_kb(key):
    return int(re.search(key + r":\s+(\d+)", open("/proc/self/status").read()).group(1))

path, n, v, h, chunk = sys.argv[1], *map(int, sys.argv[2:])
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
hidden = torch.randn(n, h, generator=g).requires_grad_(True)
weight = (torch.randn(v, h, generator=g) * 0.05).requires_grad_(True)
targets = torch.randint(v, (n,), generator=g)

def step(hidden, weight, targets):
    if path == "naive":
        logp = naive_token_logprobs(hidden @ weight.t(), targets)
    else:
        logp = token_logprobs_from_hidden(hidden, weight, targets, chunk_size_tokens=chunk)
    logp.sum().backward()
    hidden.grad = weight.grad = None

step(hidden[:8], weight[:64].detach().requires_grad_(True), targets[:8] % 64)  # warm-up: lazy library init

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (peak RSS) to the current RSS
    before_kb, key = rss_mark_kb("VmRSS"), "VmHWM"
except OSError:  # no clear_refs: fall back on the process-lifetime peak
    before_kb, key = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, None
step(hidden, weight, targets)
after_kb = rss_mark_kb(key) if key else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_mb": (after_kb - before_kb) / 1024}))
"""


def measure_peak_mb(path: str, num_tokens: int, vocab: int, hidden: int, chunk_size_tokens: int) -> float:
    """Peak extra RSS (MiB) of one forward + backward of `path` ("chunked" or "naive")."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    # A fixed mmap threshold makes glibc return every large block on free, so RSS follows
    # the live tensors (the dynamic threshold would keep freed blocks in the heap).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(num_tokens), str(vocab), str(hidden),
                          str(chunk_size_tokens)], capture_output=True, text=True, timeout=300, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"peak-memory child for {path!r} failed: {out.stderr[-2000:]}")
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"])


def _time_ms(path: str, num_tokens: int, vocab: int, hidden: int, chunk: int, repeats: int) -> float:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(num_tokens, hidden, generator=g).requires_grad_(True)
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).requires_grad_(True)
    targets = torch.randint(vocab, (num_tokens,), generator=g)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        if path == "naive":
            logp = naive_token_logprobs(h @ w.t(), targets)
        else:
            logp = token_logprobs_from_hidden(h, w, targets, chunk_size_tokens=chunk)
        logp.sum().backward()
        times.append((time.perf_counter() - start) * 1e3)
        h.grad = w.grad = None
    return statistics.median(times[1:])


def run(quick: bool) -> dict:
    num_tokens, vocab, hidden = (512, 32768, 64) if quick else (2048, 32768, 128)
    chunk, repeats = auto_chunk_size_tokens(vocab), (2 if quick else 5)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        figures = {}
        for path in PATHS:
            figures[path] = {
                "fwd_bwd_ms": _time_ms(path, num_tokens, vocab, hidden, chunk, repeats),
                "tokens_per_s": 0.0,
                "peak_mem_mb": measure_peak_mb(path, num_tokens, vocab, hidden, chunk),
            }
            figures[path]["tokens_per_s"] = num_tokens / (figures[path]["fwd_bwd_ms"] / 1e3)
    finally:
        torch.set_num_threads(threads)
    return {
        "config": {"num_tokens": num_tokens, "vocab": vocab, "hidden": hidden, "chunk_size_tokens": chunk,
                   "repeats": repeats, "torch_threads": 1, "dtype": "float32",
                   "full_logits_mb": num_tokens * vocab * 4 / 2**20},
        "results": figures["chunked"],
        "peer": figures["naive"],
    }
