"""Stateful property test: the compiled KV block allocator against its pure-Python twin.

Hypothesis drives random operation sequences (allocate with shared prefixes and salts,
append, fork, free, truncate, speculative steps that append drafted tokens and roll back a
random number of them, lookups, cache resets, misuse) against both pools side by side. Every
step must return the same value or raise the same error type in both, and after every
step both pools' full states must be equal and pass check_invariants(): every block is
free or referenced, never both; each ref count equals the number of tables holding the
block; the prefix index maps exactly the hashed blocks; no block leaks once every
sequence is freed (the teardown frees everything and checks the free lists are full).
"""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from postrain.ext._kvpool import KVBlockPool as CompiledKVBlockPool
from postrain.ext._kvpool_py import HASH_OFFSET, KVPoolError, OutOfBlocksError, _step, block_hash
from postrain.ext._kvpool_py import KVBlockPool as PythonKVBlockPool

# Prompts from a tiny vocabulary over a few shared stems, so prefix hits are common.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]
token_lists = st.builds(lambda stem, cut, tail: stem[:cut] + tail,
                        st.sampled_from(STEMS), st.sampled_from([9, 12, 8, 6, 4, 3, 0]),
                        st.lists(st.integers(0, 9), max_size=4))
SEQ_IDS = st.integers(0, 4)  # few ids, so forks and frees meet live sequences


def _both(pools, method, *args):
    """Call method on every pool; require equal results or equal error types."""
    outcomes = []
    for pool in pools:
        try:
            outcomes.append(("ok", getattr(pool, method)(*args)))
        except KVPoolError as exc:
            outcomes.append(("error", type(exc)))
    assert outcomes[0] == outcomes[1], (method, args, outcomes)
    return outcomes[0]


class TwinMachine(RuleBasedStateMachine):
    """`live` mirrors the pools' sequence ids, so most steps act on live sequences."""

    @initialize(num_blocks=st.integers(2, 24), block_size_tokens=st.integers(1, 4),
                enable_prefix_caching=st.sampled_from([True, True, False]))
    def make_pools(self, num_blocks, block_size_tokens, enable_prefix_caching):
        self.pools = [CompiledKVBlockPool(num_blocks, block_size_tokens, enable_prefix_caching),
                      PythonKVBlockPool(num_blocks, block_size_tokens, enable_prefix_caching)]
        self.caching = enable_prefix_caching
        self.live: list[int] = []
        self.tokens: dict[int, list[int]] = {}    # each live sequence's token ids, as the pools hold them
        self.next_id = 100

    def _tokens(self, tokens, as_array):
        if not self.caching and as_array:
            return len(tokens)  # a bare token count: valid only with caching off
        return np.array(tokens, dtype=np.int32) if as_array else tokens

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _track(self, outcome, added=None, removed=None):
        if outcome[0] == "ok":
            if added is not None:
                self.live.append(added)
            if removed is not None:
                self.live.remove(removed)

    @rule(tokens=token_lists, salt=st.sampled_from([0, 0, 1, 2**64 - 1]), as_array=st.booleans())
    def allocate(self, tokens, salt, as_array):
        seq_id = self._new_id()
        outcome = _both(self.pools, "allocate", seq_id, self._tokens(tokens, as_array), salt)
        self._track(outcome, added=seq_id)
        if outcome[0] == "ok":
            self.tokens[seq_id] = list(tokens)
        if outcome == ("error", OutOfBlocksError) and self.live:
            self.tokens.pop(self.live[0])
            self._track(_both(self.pools, "free", self.live[0]), removed=self.live[0])  # preempt

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 9), max_size=6), as_array=st.booleans())
    def append(self, data, tokens, as_array):
        seq_id = data.draw(st.sampled_from(self.live))
        if _both(self.pools, "append", seq_id, self._tokens(tokens, as_array))[0] == "ok":
            self.tokens[seq_id] += tokens

    @precondition(lambda self: self.live)
    @rule(data=st.data(), duplicate=st.booleans(), as_array=st.booleans())
    def append_batch(self, data, duplicate, as_array):
        seq_ids = data.draw(st.lists(st.sampled_from(self.live), unique=True, min_size=1))
        if duplicate:
            seq_ids.append(seq_ids[0])
        tokens = data.draw(st.lists(st.integers(0, 9), min_size=len(seq_ids), max_size=len(seq_ids)))
        outcome = _both(self.pools, "append_batch", seq_ids, np.array(tokens, np.int32) if as_array else tokens)
        if outcome[0] == "ok":
            for seq_id, token in zip(seq_ids, tokens):
                self.tokens[seq_id].append(token)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent, child = data.draw(st.sampled_from(self.live)), self._new_id()
        outcome = _both(self.pools, "fork", parent, child)
        self._track(outcome, added=child)
        if outcome[0] == "ok":
            self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(self.live))
        self._track(_both(self.pools, "free", seq_id), removed=seq_id)
        self.tokens.pop(seq_id, None)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), as_array=st.booleans())
    def truncate(self, data, as_array):
        seq_id = data.draw(st.sampled_from(self.live))
        kept = self.tokens[seq_id][:data.draw(st.integers(0, len(self.tokens[seq_id]) + 1))]
        if _both(self.pools, "truncate", seq_id, self._tokens(kept, as_array))[0] == "ok":
            self.tokens[seq_id] = kept

    @precondition(lambda self: self.live)
    @rule(data=st.data(), drafts=st.lists(st.integers(0, 9), max_size=6))
    def speculative_step(self, data, drafts):
        """A verify step: reserve the last token plus the drafts, then keep the accepted ones."""
        seq_id = data.draw(st.sampled_from(self.live))
        step = [data.draw(st.integers(0, 9))] + drafts
        if _both(self.pools, "append", seq_id, self._tokens(step, False))[0] != "ok":
            return
        self.tokens[seq_id] += step
        num_accepted = data.draw(st.integers(0, len(drafts)))
        kept = self.tokens[seq_id][:len(self.tokens[seq_id]) - len(drafts) + num_accepted]
        assert _both(self.pools, "truncate", seq_id, self._tokens(kept, False))[0] == "ok"
        self.tokens[seq_id] = kept

    @rule(data=st.data(), n=st.integers(0, 20))
    def queries(self, data, n):
        seq_id = data.draw(st.sampled_from(self.live + [0]))  # ids start at 101: 0 is unknown
        for method, args in [("block_table", (seq_id,)), ("num_tokens", (seq_id,)),
                             ("can_append", (seq_id, n)), ("can_allocate", (n,)),
                             ("__contains__", (seq_id,)), ("__len__", ()),
                             ("ref_count", (n - 1,)), ("block_hash", (n - 1,))]:
            _both(self.pools, method, *args)

    @precondition(lambda self: self.live)
    @rule(pad=st.sampled_from([0, -1]))
    def fill_block_tables(self, pad):
        outs = [np.full((len(self.live) + 1, 25), 77, dtype=np.int32) for _ in self.pools]
        for pool, out in zip(self.pools, outs):
            pool.fill_block_tables(self.live, out, pad=pad)
            assert out[0, :pool.fill_block_table(self.live[0], out[-1])].tolist() \
                == pool.block_table(self.live[0])
        assert np.array_equal(outs[0], outs[1])

    @rule(tokens=token_lists, salt=st.sampled_from([0, 1]))
    def match_prefix(self, tokens, salt):
        _both(self.pools, "match_prefix", tokens, salt)

    @rule(data=st.data(), bad=st.sampled_from([[-1], [2**31], [0, 1, 2**40]]), kind=st.integers(0, 5))
    def misuse(self, data, bad, kind):
        seq_id = data.draw(st.sampled_from(self.live + [0]))
        if kind == 0 and self.live:
            _both(self.pools, "allocate", self.live[-1], [1, 2])  # exists
        elif kind == 1 and self.caching:
            _both(self.pools, "allocate", self._new_id(), bad)
            _both(self.pools, "append", seq_id, bad)
        elif kind == 2:
            _both(self.pools, "free", -5)                      # double free / unknown
            _both(self.pools, "fork", -5, self._new_id())
        elif kind == 3 and self.live:
            _both(self.pools, "fork", seq_id, self.live[0])   # child exists
        elif kind == 4:
            _both(self.pools, "reset_prefix_cache")

    @invariant()
    def same_state_and_invariants(self):
        if not hasattr(self, "pools"):
            return
        for pool in self.pools:
            pool.check_invariants()
        assert self.pools[0].debug_state() == self.pools[1].debug_state()

    @invariant()
    def hash_state_matches_the_tokens(self):
        """Every sequence's hash state is what its tokens give, however it got them (a
        truncate re-derives it)."""
        if not getattr(self, "caching", False):
            return
        B = self.pools[0].block_size_tokens
        for seq_id, seq in self.pools[1].debug_state()["sequences"].items():
            tokens, num_full = self.tokens[seq_id], len(self.tokens[seq_id]) // B
            last_hash = 0
            for i in range(num_full):
                last_hash = block_hash(last_hash, tokens[i * B:(i + 1) * B], seq["salt"])
            partial = 0
            if len(tokens) % B:
                partial = HASH_OFFSET
                for t in tokens[num_full * B:]:
                    partial = _step(partial, t)
            assert (seq["last_hash"], seq["partial_state"]) == (last_hash, partial), seq_id

    def teardown(self):
        if not hasattr(self, "pools"):
            return
        for pool in self.pools:
            for seq_id in list(pool.debug_state()["sequences"]):
                pool.free(seq_id)
            pool.check_invariants()
            stats = pool.stats()
            assert stats["num_free_blocks"] == pool.num_blocks, "a block leaked"
            assert stats["num_tokens"] == stats["num_reserved_slots"] == 0
        assert self.pools[0].debug_state() == self.pools[1].debug_state()


TwinMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
test_compiled_matches_twin = TwinMachine.TestCase
