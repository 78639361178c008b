"""Direct tests of the paged KV block allocator, run against both implementations.

Prefix reuse, eviction order, copy-on-write, errors (nothing half-allocated), statistics,
numpy block tables, the hash, and the import path. The stateful twin comparison lives in
test_kvpool_stateful.py.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from postrain.ext import _kvpool, _kvpool_py
from postrain.ext.kvpool import (
    CheckedKVBlockPool, InvalidArgumentError, InvalidBlockError, OutOfBlocksError, SequenceExistsError,
    UnknownSequenceError,
)

IMPLS = [_kvpool.KVBlockPool, _kvpool_py.KVBlockPool]


@pytest.fixture(params=IMPLS, ids=["compiled", "python"])
def Pool(request):
    return request.param


def prompt(n, start=0):
    return list(range(start, start + n))


def test_prefix_reuse_shares_full_blocks(Pool):
    pool = Pool(num_blocks=16, block_size_tokens=4)
    assert pool.allocate("a", prompt(10)) == 0          # cold cache
    table_a = pool.block_table("a")
    assert pool.allocate("b", prompt(10)) == 8          # two full blocks reused
    table_b = pool.block_table("b")
    assert table_b[:2] == table_a[:2] and table_b[2] != table_a[2]
    assert [pool.ref_count(b) for b in table_a] == [2, 2, 1]
    assert pool.allocate("c", prompt(6) + [99, 99]) == 4  # shares only the first block
    pool.check_invariants()
    stats = pool.stats()
    # Lookups may hit (len - 1) // 4 blocks: a misses 2, b hits 2, c hits 1 (its block 2 is full
    # but holds the last prompt token, so it is recomputed rather than looked up).
    assert stats["prefix_hit_blocks"] == 3 and stats["prefix_miss_blocks"] == 2
    assert stats["num_cached_blocks"] == 3               # a's two full blocks and c's second
    assert pool.match_prefix(prompt(10)) == 8 and pool.stats() == stats  # read-only


def test_prefix_reuse_after_free_and_salt(Pool):
    pool = Pool(num_blocks=8, block_size_tokens=4)
    pool.allocate(1, prompt(12), salt=7)
    blocks = pool.block_table(1)
    pool.free(1)
    assert pool.stats()["num_cached_free_blocks"] == 3
    assert pool.match_prefix(prompt(12), salt=0) == 0     # another adapter / policy version
    # The last prompt token is always recomputed, so a 12-token prompt reuses 2 blocks, not 3.
    assert pool.allocate(2, prompt(12), salt=7) == 8
    assert pool.block_table(2)[:2] == blocks[:2]
    assert pool.allocate(3, prompt(13), salt=7) == 12     # a longer prompt reuses all three
    pool.check_invariants()


def test_prefix_reuse_of_appended_blocks(Pool):
    pool = Pool(num_blocks=8, block_size_tokens=4)
    pool.allocate(1, prompt(3))
    pool.append(1, [3])                                   # completes block 0 by decoding
    pool.append(1, prompt(5, start=4))
    assert pool.num_tokens(1) == 9
    assert pool.allocate(2, prompt(9)) == 8
    assert pool.block_table(2)[:2] == pool.block_table(1)[:2]


def test_eviction_is_least_recently_freed_and_uncached_first(Pool):
    pool = Pool(num_blocks=6, block_size_tokens=2)
    pool.allocate("x", [1, 1, 1, 1])                      # blocks 0, 1 (both hashed)
    pool.allocate("y", [2, 2, 2, 2])                      # blocks 2, 3
    pool.free("x")
    pool.free("y")
    # Freed last block first: cached free list is x1, x0, y3, y2 (least recently freed first).
    assert pool.debug_state()["free_cached"] == [1, 0, 3, 2]
    assert pool.debug_state()["free_uncached"] == [4, 5]
    pool.allocate("z", [9, 9, 9])                         # two new blocks: uncached 4, 5 first
    assert pool.block_table("z") == [4, 5]
    assert pool.stats()["num_evicted_blocks"] == 0
    pool.allocate("w", [8, 8, 8])                         # now evicts x's tail, then x's head
    assert pool.block_table("w") == [1, 0]
    assert pool.stats()["num_evicted_blocks"] == 2
    assert pool.match_prefix([1, 1, 1, 1, 1]) == 0        # x is gone
    assert pool.match_prefix([2, 2, 2, 2, 2]) == 4        # y survives
    pool.check_invariants()


def test_prefix_hit_revives_a_cached_free_block(Pool):
    pool = Pool(num_blocks=4, block_size_tokens=2)
    pool.allocate("x", [1, 1, 2, 2, 3])
    pool.free("x")
    assert pool.num_free_blocks == 4
    assert pool.allocate("y", [1, 1, 2, 2, 5]) == 4       # revives two cached blocks
    assert pool.stats()["num_cached_free_blocks"] == 0
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_fork_and_copy_on_write_of_partial_block(Pool):
    pool = Pool(num_blocks=8, block_size_tokens=4)
    pool.allocate("p", prompt(6))                         # blocks [0, 1]; block 1 holds 2 tokens
    for child in ("c1", "c2"):
        pool.fork("p", child)
    assert pool.block_table("c1") == pool.block_table("p") == [0, 1]
    assert pool.ref_count(1) == 3
    assert pool.append("c1", [50]) == [(1, 2)]            # diverges: copy block 1 into 2
    assert pool.block_table("c1") == [0, 2] and pool.ref_count(1) == 2
    assert pool.append("c2", [60]) == [(1, 3)]
    assert pool.append("p", [70]) == []                   # sole owner now: no copy
    assert pool.block_table("p") == [0, 1] and pool.ref_count(1) == 1
    assert pool.stats()["num_cow_copies"] == 2
    pool.check_invariants()


def test_append_batch_equals_appends_in_order(Pool):
    batched, single = Pool(16, 2), Pool(16, 2)
    for pool in (batched, single):
        pool.allocate("p", prompt(3))
        pool.fork("p", "c")
        pool.allocate("q", prompt(4, start=20))
    steps = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
    for tokens in steps:
        pairs = batched.append_batch(["c", "p", "q"], tokens)
        expected = [pair for seq_id, t in zip(["c", "p", "q"], tokens) for pair in single.append(seq_id, [t])]
        assert pairs == expected
    assert batched.debug_state() == single.debug_state()
    assert batched.stats()["num_cow_copies"] == 1      # c moved off p's partial block in step 1
    batched.check_invariants()


def test_append_batch_checks_everything_first(Pool):
    pool = Pool(4, 2)
    pool.allocate("a", prompt(2))
    pool.allocate("b", prompt(2, start=10))
    before = pool.debug_state()
    with pytest.raises(InvalidArgumentError, match="a sequence id appears twice"):
        pool.append_batch(["a", "a"], [1, 2])
    with pytest.raises(InvalidArgumentError, match="2 sequences but 1 tokens"):
        pool.append_batch(["a", "b"], [1])
    with pytest.raises(UnknownSequenceError, match="append_batch: no sequence 'z'"):
        pool.append_batch(["a", "z"], [1, 2])
    pool.allocate("c", prompt(2, start=20))
    before = pool.debug_state()
    with pytest.raises(OutOfBlocksError, match="3 sequences need 3 new blocks, 1 are free"):
        pool.append_batch(["a", "b", "c"], [1, 2, 3])
    assert pool.debug_state() == before
    assert pool.append_batch([], []) == []


def test_fork_at_block_boundary_needs_no_copy(Pool):
    pool = Pool(num_blocks=8, block_size_tokens=4)
    pool.allocate("p", prompt(8))
    pool.fork("p", "c")
    assert pool.append("c", [1]) == [] and pool.append("p", [2]) == []
    assert pool.block_table("c")[:2] == pool.block_table("p")[:2]
    assert pool.block_table("c")[2] != pool.block_table("p")[2]
    for seq_id in ("p", "c"):
        pool.free(seq_id)
    assert pool.num_free_blocks == 8
    pool.check_invariants()


def test_out_of_blocks_changes_nothing(Pool):
    pool = Pool(num_blocks=4, block_size_tokens=2)
    pool.allocate("a", prompt(5))                         # 3 blocks, partial last
    pool.fork("a", "b")
    before = pool.debug_state()
    with pytest.raises(OutOfBlocksError, match=r"needs 2 new blocks, 1 are free"):
        pool.allocate("c", [7, 7, 7, 7])
    with pytest.raises(OutOfBlocksError, match=r"append: sequence 'b' needs 2 new blocks"):
        pool.append("b", [1, 2])                          # copy-on-write + one more block
    assert pool.debug_state() == before and "c" not in pool
    assert not pool.can_append("b", 2) and pool.can_append("b", 1)
    assert pool.append("b", [1]) == [(2, 3)]
    pool.check_invariants()


def test_misuse_raises_typed_errors_naming_the_value(Pool):
    pool = Pool(num_blocks=4, block_size_tokens=2)
    pool.allocate(7, [1, 2, 3])
    with pytest.raises(SequenceExistsError, match="sequence 7 already has a block table"):
        pool.allocate(7, [1])
    with pytest.raises(SequenceExistsError, match="child sequence 7"):
        pool.fork(7, 7)
    pool.free(7)
    with pytest.raises(UnknownSequenceError, match="no sequence 7 .*double free"):
        pool.free(7)
    for call in (lambda: pool.append(7, [1]), lambda: pool.block_table(7),
                 lambda: pool.fork(7, 8), lambda: pool.num_tokens(7)):
        with pytest.raises(UnknownSequenceError, match="no sequence 7"):
            call()
    with pytest.raises(InvalidBlockError, match=r"block id must be in \[0, 4\), got 4"):
        pool.ref_count(4)
    with pytest.raises(InvalidBlockError, match="got -1"):
        pool.block_hash(-1)
    with pytest.raises(InvalidArgumentError, match=r"token ids must be in \[0, 2147483647\], got -3"):
        pool.allocate(1, [1, -3])
    with pytest.raises(InvalidArgumentError, match="got 2147483648"):
        pool.allocate(1, np.array([2**31], dtype=np.int64))
    with pytest.raises(InvalidArgumentError, match="needs enable_prefix_caching=False"):
        pool.allocate(1, 5)
    with pytest.raises(InvalidArgumentError, match=r"salt must be an int in \[0, 2\*\*64\), got -1"):
        pool.allocate(1, [1], salt=-1)
    assert 1 not in pool and pool.num_free_blocks == 4
    with pytest.raises(InvalidArgumentError, match="num_blocks must be an int in"):
        Pool(0, 16)
    with pytest.raises(InvalidArgumentError, match="block_size_tokens must be an int in"):
        Pool(4, 0)


def test_token_counts_without_prefix_caching(Pool):
    pool = Pool(num_blocks=4, block_size_tokens=4, enable_prefix_caching=False)
    assert pool.allocate(1, 6) == 0 and pool.num_tokens(1) == 6
    assert pool.append(1, 3) == [] and pool.block_table(1) == [0, 1, 2]
    assert pool.allocate(2, prompt(4)) == 0               # ids are accepted, values unread
    assert pool.stats()["num_cached_blocks"] == 0
    with pytest.raises(InvalidArgumentError, match="token count must be >= 0"):
        pool.append(1, -1)


def test_stats_utilization(Pool):
    pool = Pool(num_blocks=10, block_size_tokens=4)
    pool.allocate(1, prompt(5))
    pool.allocate(2, prompt(4, start=50))
    stats = pool.stats()
    assert stats["num_used_blocks"] == 3 and stats["num_free_blocks"] == 7
    assert stats["num_tokens"] == 9 and stats["num_reserved_slots"] == 12
    assert stats["utilization"] == pytest.approx(0.75)
    assert stats["num_sequences"] == 2 and len(pool) == 2


def test_numpy_inputs_and_block_table_arrays(Pool):
    pool = Pool(num_blocks=16, block_size_tokens=2)
    ids = np.arange(7)
    for seq_id, tokens in enumerate([ids.tolist(), ids.astype(np.int32), ids.astype(np.int64),
                                     ids.astype(np.uint16), tuple(ids.tolist())]):
        assert pool.allocate(seq_id, tokens) == (0 if seq_id == 0 else 6)
    out = np.full(8, -9, dtype=np.int32)
    assert pool.fill_block_table(1, out) == 4
    assert out[:4].tolist() == pool.block_table(1) and out[4] == -9
    batch = np.zeros((3, 5), dtype=np.int32)
    pool.fill_block_tables([4, 0], batch, pad=-1)
    assert batch[0].tolist() == pool.block_table(4) + [-1]
    assert batch[1].tolist() == pool.block_table(0) + [-1]
    with pytest.raises(InvalidArgumentError, match="out has 3 columns but sequence 1 has 4 blocks"):
        pool.fill_block_tables([1], np.zeros((1, 3), dtype=np.int32))


def test_reset_prefix_cache(Pool):
    pool = Pool(num_blocks=6, block_size_tokens=2)
    pool.allocate(1, prompt(5))
    pool.allocate(2, prompt(5, start=10))
    pool.free(2)
    assert pool.reset_prefix_cache() == 4
    assert pool.match_prefix(prompt(5)) == 0 and pool.stats()["num_cached_blocks"] == 0
    pool.free(1)
    assert pool.stats()["num_cached_free_blocks"] == 0 and pool.num_free_blocks == 6
    pool.check_invariants()


def test_a_sequence_live_at_a_reset_never_indexes_the_blocks_it_fills_after(Pool):
    """Its KV came partly from before the reset (older weights): no later prompt may read it."""
    pool = Pool(num_blocks=12, block_size_tokens=2)
    pool.allocate(1, prompt(3))
    pool.fork(1, 2)
    pool.reset_prefix_cache()
    pool.append(1, [7, 8, 9])                            # fills blocks 2 and 3 of sequence 1
    pool.append(2, [7, 8, 9])                            # its fork: stale too
    pool.allocate(3, prompt(3) + [7, 8, 9])              # a new sequence: reads nothing, indexes its own
    assert pool.stats()["num_cached_blocks"] == 3
    assert pool.debug_state()["sequences"][3]["stale"] is False
    assert pool.allocate(4, prompt(3) + [7, 8, 9, 10]) == 6, "the hits are the new sequence's blocks"
    assert pool.block_table(4)[:3] == pool.block_table(3)[:3]
    pool.check_invariants()


def test_block_hash_is_identical_in_both():
    rng = np.random.default_rng(0)
    for _ in range(50):
        tokens = rng.integers(0, 2**31 - 1, size=int(rng.integers(1, 40))).tolist()
        parent, salt = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**63))
        assert _kvpool.block_hash(parent, tokens, salt) == _kvpool_py.block_hash(parent, tokens, salt)
    assert _kvpool_py.block_hash(0, [1, 2]) != _kvpool_py.block_hash(0, [2, 1])


def test_large_pool_matches_twin_on_a_long_prompt():
    pools = [Impl(num_blocks=1024, block_size_tokens=16) for Impl in IMPLS]
    tokens = np.random.default_rng(1).integers(0, 50_000, size=4096).astype(np.int32)
    for pool in pools:
        pool.allocate(0, tokens)
        assert pool.match_prefix(tokens) == 4080 and pool.match_prefix(tokens[:100]) == 96
        for block in (0, 2, 5, 254):                  # a miss at each spot of a group of four
            changed = tokens.copy()
            changed[block * 16 + 7] += 1
            assert pool.match_prefix(changed) == block * 16
        pool.free(0)
        pool.check_invariants()
    assert pools[0].debug_state() == pools[1].debug_state()


@pytest.mark.parametrize("choice,expected", [("python", "python"), ("", "compiled")])
def test_import_path_picks_implementation(choice, expected):
    env = dict(os.environ, POSTRAIN_KVPOOL=choice)
    code = "from postrain.ext import kvpool; print(kvpool.IMPLEMENTATION, kvpool.KVBlockPool.implementation)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [expected, expected]


def test_truncate_rolls_back_drafted_tokens(Pool):
    pool = Pool(8, 4)
    pool.allocate(1, prompt(6))                         # blocks 0, 1 (2 slots used)
    assert pool.append(1, prompt(7, 6)) == []           # 13 tokens: blocks 0-3, 0-2 full and hashed
    assert pool.truncate(1, prompt(9)) == []            # keep 9: block 3 released, block 2 cut
    assert pool.num_tokens(1) == 9 and pool.block_table(1) == [0, 1, 2]
    assert pool.block_hash(2) == 0 and pool.block_hash(1) != 0   # the cut block leaves the index
    assert pool.num_free_blocks == 5
    pool.append(1, [100, 101, 102])                     # the hash state is that of the kept tokens
    other = Pool(8, 4)
    other.allocate(1, prompt(9) + [100, 101, 102])
    assert pool.debug_state()["sequences"][1]["last_hash"] == \
        other.debug_state()["sequences"][1]["last_hash"]
    assert pool.truncate(1, prompt(8)) == [] and pool.block_table(1) == [0, 1]
    pool.check_invariants()


def test_truncate_copies_a_shared_cut_block_and_checks_first(Pool):
    pool = Pool(4, 4)
    pool.allocate(1, prompt(8))
    pool.fork(1, 2)                                     # both hold full blocks 0 and 1
    assert pool.truncate(2, prompt(6)) == [(1, 2)]      # 2 moves onto a copy of block 1
    assert pool.block_table(1) == [0, 1] and pool.block_table(2) == [0, 2]
    pool.fork(2, 3)
    pool.allocate(4, prompt(4, 50))                     # the last free block
    with pytest.raises(OutOfBlocksError, match="truncate: sequence 3 needs a block"):
        pool.truncate(3, prompt(5))
    assert pool.num_tokens(3) == 6                      # nothing changed
    with pytest.raises(InvalidArgumentError, match="has 6 tokens, cannot keep 7"):
        pool.truncate(3, prompt(7))
    with pytest.raises(UnknownSequenceError):
        pool.truncate(9, [])
    pool.check_invariants()


def test_checked_pool_checks_after_every_mutation(Pool):
    pool = CheckedKVBlockPool(8, 4, impl=Pool)
    pool.allocate(1, prompt(6))
    pool.fork(1, 2)
    assert pool.append(2, [9]) == [(1, 2)] and len(pool) == 2 and 2 in pool
    with pytest.raises(OutOfBlocksError):
        pool.allocate(3, prompt(40))                  # checked even when the call raises
    if Pool is _kvpool_py.KVBlockPool:                # corrupt the twin: the next call notices
        pool._pool._seqs[1].table.append(7)
        with pytest.raises(AssertionError, match=r"len\(table\) == ceil"):
            pool.free(2)
