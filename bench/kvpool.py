"""`postrain bench kvpool`: the compiled KV block allocator against its pure-Python twin.

Both run the same operation mix in the same process (block size 16):
- alloc_free_ops_per_s: allocate a prompt of 1-16 blocks (random token ids, prefix caching on,
  a fresh salt per repeat so every allocate misses, hashes and registers its full blocks;
  evictions start once the pool has filled), then free it. One op = allocate + free.
- alloc_free_nocache_ops_per_s: the same with prefix caching off and token counts: pure
  block bookkeeping.
- fork_free_ops_per_s: fork a 512-token (32-block) parent, then free the child (n samples per
  prompt).
- append_ops_per_s: decoding: one token appended to each of 64 live sequences per step
  (a new block every 16 steps; prefix caching on, so full blocks are hashed).
- append_batch_ops_per_s: the same step as one append_batch call (tokens per second).
- prefix_lookup_4096_us / prefix_lookup_4096_list_us: match_prefix of a fully cached
  4,096-token prompt given as a numpy int32 array / a Python list (255 blocks are hashed and
  probed: the last prompt token is always recomputed). Lower is better.
Figures are medians over repeats. Run: `postrain bench kvpool --json`.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from postrain.ext.kvpool import CompiledKVBlockPool, PythonKVBlockPool

BLOCK_SIZE = 16
NUM_BLOCKS = 8192


class _Runner:
    """One implementation's pools and inputs; each method runs one repeat of one figure.
    scale: the twin gets fewer ops per repeat (rates and per-call times still compare)."""

    def __init__(self, Pool, scale: float):
        rng = np.random.default_rng(1)
        self.Pool = Pool
        self.num_ops = max(50, int(20_000 * scale))
        self.prompts = [rng.integers(0, 50_000, size=int(k)).tolist()
                        for k in rng.integers(1, BLOCK_SIZE * 16 + 1, size=self.num_ops)]
        self.counts = [len(p) for p in self.prompts]
        self.cache_pool = Pool(NUM_BLOCKS, BLOCK_SIZE)
        self.nocache_pool = Pool(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
        self.fork_pool = Pool(NUM_BLOCKS, BLOCK_SIZE)
        self.fork_pool.allocate("parent", list(range(512)))
        self.num_steps = max(16, int(256 * scale))
        self.step_tokens = rng.integers(0, 50_000, size=(self.num_steps, 64)).tolist()
        self.lookup_pool = Pool(NUM_BLOCKS, BLOCK_SIZE)
        self.prompt_4096 = rng.integers(0, 50_000, size=4096).astype(np.int32)
        self.lookup_pool.allocate("p", self.prompt_4096)
        assert self.lookup_pool.match_prefix(self.prompt_4096) == 4080
        self.num_lookups = max(5, int(1000 * scale))

    def alloc_free_ops_per_s(self, repeat: int) -> float:
        return self._alloc_free(self.cache_pool, self.prompts, repeat + 1)

    def alloc_free_nocache_ops_per_s(self, repeat: int) -> float:
        return self._alloc_free(self.nocache_pool, self.counts, 0)

    @staticmethod
    def _alloc_free(pool, args, salt: int) -> float:
        allocate, free = pool.allocate, pool.free
        t0 = time.perf_counter()
        for i, tokens in enumerate(args):
            allocate(i, tokens, salt)
            free(i)
        return len(args) / (time.perf_counter() - t0)

    def fork_free_ops_per_s(self, repeat: int) -> float:
        fork, free = self.fork_pool.fork, self.fork_pool.free
        t0 = time.perf_counter()
        for i in range(self.num_ops):
            fork("parent", i)
            free(i)
        return self.num_ops / (time.perf_counter() - t0)

    def _decode_pool(self):
        pool = self.Pool(NUM_BLOCKS, BLOCK_SIZE)
        for s in range(64):
            pool.allocate(s, self.step_tokens[0][:1] * 100 + [s])
        return pool

    def append_batch_ops_per_s(self, repeat: int) -> float:
        append_batch, seq_ids = self._decode_pool().append_batch, list(range(64))
        t0 = time.perf_counter()
        for step in self.step_tokens:
            append_batch(seq_ids, step)
        return self.num_steps * 64 / (time.perf_counter() - t0)

    def append_ops_per_s(self, repeat: int) -> float:
        append = self._decode_pool().append
        t0 = time.perf_counter()
        for step in self.step_tokens:
            for s in range(64):
                append(s, [step[s]])
        return self.num_steps * 64 / (time.perf_counter() - t0)

    def prefix_lookup_4096_us(self, repeat: int) -> float:
        return self._lookup(self.prompt_4096)

    def prefix_lookup_4096_list_us(self, repeat: int) -> float:
        return self._lookup(self.prompt_4096.tolist())

    def _lookup(self, query) -> float:
        match = self.lookup_pool.match_prefix
        t0 = time.perf_counter()
        for _ in range(self.num_lookups):
            match(query)
        return (time.perf_counter() - t0) / self.num_lookups * 1e6


FIGURES = ["alloc_free_ops_per_s", "alloc_free_nocache_ops_per_s", "fork_free_ops_per_s",
           "append_ops_per_s", "append_batch_ops_per_s", "prefix_lookup_4096_us", "prefix_lookup_4096_list_us"]


def run(quick: bool) -> dict:
    if CompiledKVBlockPool is None:
        raise RuntimeError("the compiled allocator is not built; run `pip install -e .` first")
    scale = 0.2 if quick else 1.0
    ours, peer = _Runner(CompiledKVBlockPool, scale), _Runner(PythonKVBlockPool, scale * 0.1)
    repeats = 3 if quick else 15
    samples: dict[int, dict[str, list[float]]] = {id(r): {f: [] for f in FIGURES} for r in (ours, peer)}
    # Ours and the peer alternate within each repeat, so load from other processes hits both.
    for repeat in range(repeats):
        for figure in FIGURES:
            for runner in (ours, peer):
                samples[id(runner)][figure].append(getattr(runner, figure)(repeat))

    def medians(runner):
        return {f: round(statistics.median(v), 2 if f.endswith("_us") else None)
                for f, v in samples[id(runner)].items()}

    return {
        "config": {"block_size_tokens": BLOCK_SIZE, "num_blocks": NUM_BLOCKS,
                   "alloc_blocks_per_call": "1-16", "decode_batch": 64, "repeats": repeats,
                   "quick": quick, "block_meta_bytes": 16,
                   "peer": "pure-Python twin (postrain.ext._kvpool_py), 1/10 of the ops per repeat"},
        "results": medians(ours),
        "peer": medians(peer),
    }
