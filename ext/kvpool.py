"""The paged KV-cache block allocator: one import path for both implementations.

    from postrain.ext import KVBlockPool
    pool = KVBlockPool(num_blocks=4096, block_size_tokens=16)
    num_cached = pool.allocate(seq_id, prompt_ids)     # skip prefill of the first num_cached tokens
    copies = pool.append(seq_id, [next_token])         # do these (src, dst) block copies first
    pool.fill_block_tables(batch_ids, out)             # int32 (batch, max_blocks) for the kernel
    pool.truncate(seq_id, kept_ids)                   # roll back rejected drafted tokens
    pool.free(seq_id)

`KVBlockPool` is the compiled extension (`_kvpool.pyx`) when it is built, else
the pure-Python twin (`_kvpool_py.py`); `POSTRAIN_KVPOOL=python` forces the
twin and `POSTRAIN_KVPOOL=compiled` makes a missing extension an ImportError.
`IMPLEMENTATION` says which one was picked. Both behave identically; see the
twin's module docstring for the design.
"""
from __future__ import annotations

import os

from postrain.ext._kvpool_common import (
    InvalidArgumentError, InvalidBlockError, KVPoolError, OutOfBlocksError,
    SequenceExistsError, UnknownSequenceError, block_hash,
)
from postrain.ext._kvpool_py import KVBlockPool as PythonKVBlockPool

try:
    from postrain.ext._kvpool import KVBlockPool as CompiledKVBlockPool
except ImportError as exc:  # not built: a source checkout without `pip install -e .`
    CompiledKVBlockPool = None
    _import_error: ImportError | None = exc
else:
    _import_error = None

_choice = os.environ.get("POSTRAIN_KVPOOL", "").strip().lower()
if _choice not in ("", "compiled", "python"):
    raise ImportError(f"POSTRAIN_KVPOOL must be 'compiled' or 'python', got {_choice!r}")
if _choice == "compiled" and CompiledKVBlockPool is None:
    raise ImportError(f"POSTRAIN_KVPOOL=compiled but the extension is not built ({_import_error}); "
                      f"run `pip install -e .` in the repository")

KVBlockPool: type[PythonKVBlockPool]  # the compiled class has the twin's API
if _choice == "python" or CompiledKVBlockPool is None:
    KVBlockPool = PythonKVBlockPool
    IMPLEMENTATION = "python"
else:
    KVBlockPool = CompiledKVBlockPool
    IMPLEMENTATION = "compiled"



class CheckedKVBlockPool:
    """A pool that runs check_invariants() after every mutation: for an engine's tests.

    Wraps KVBlockPool (or `impl`); every attribute is the pool's, and allocate, append, fork,
    free, truncate and reset_prefix_cache raise AssertionError as soon as an invariant breaks.
    """

    _MUTATIONS = frozenset({"allocate", "append", "fork", "free", "truncate", "reset_prefix_cache"})

    def __init__(self, *args, impl=None, **kwargs):
        self._pool = (impl or KVBlockPool)(*args, **kwargs)

    def __getattr__(self, name):
        attr = getattr(self._pool, name)
        if name not in self._MUTATIONS:
            return attr

        def checked(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            finally:
                self._pool.check_invariants()
        return checked

    def __len__(self):
        return len(self._pool)

    def __contains__(self, seq_id):
        return seq_id in self._pool


__all__ = [
    "KVBlockPool", "PythonKVBlockPool", "CheckedKVBlockPool", "CompiledKVBlockPool", "IMPLEMENTATION", "block_hash",
    "KVPoolError", "OutOfBlocksError", "UnknownSequenceError", "SequenceExistsError",
    "InvalidBlockError", "InvalidArgumentError",
]
