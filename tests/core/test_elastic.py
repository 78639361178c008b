"""Elastic cores' rule (core/elastic.py): who holds which cores, and the order of every change."""
import pytest
from hypothesis import given, settings, strategies as st

from postrain.core.elastic import Home, assign, check_holdings, check_homes, plan

LEARNER_GENERATOR = {"learner": Home(frozenset({0}), 1), "generator": Home(frozenset({1}), 1)}


def settle(homes, held, busy):
    """Enact plan(homes, held, busy) step by step, asserting after every re-pin that no core is
    in two actors' compute sets; returns the holding after it."""
    step = plan(homes, held, busy)
    pinned = dict(held)
    for holding in step.revokes:
        assert holding.cpu_ids <= pinned[holding.actor], "a revoke only takes cores away"
        pinned[holding.actor] = holding.cpu_ids
        assert_disjoint(pinned)
    for holding in step.grants:
        assert holding.cpu_ids >= pinned[holding.actor], "a grant only adds cores"
        pinned[holding.actor] = holding.cpu_ids
        assert_disjoint(pinned)
    assert pinned == step.held
    return step


def assert_disjoint(pinned):
    cores = [core for held in pinned.values() for core in held]
    assert len(cores) == len(set(cores)), f"a core pinned to two actors: {pinned}"


def test_the_learner_borrows_the_generators_core_while_it_trains_and_returns_it_when_the_generator_samples():
    held = assign(LEARNER_GENERATOR, frozenset())
    step = settle(LEARNER_GENERATOR, held, frozenset({"learner"}))
    assert step.held == {"learner": {0, 1}, "generator": frozenset()}
    assert [t.to_row() for t in step.transfers] == [
        {"action": "lend", "cpu_ids": [1], "giver": "generator", "taker": "learner"}]
    learner = step.grants[0]
    assert learner.num_threads == 2 and learner.affinity == (0, 1)
    parked = step.revokes[0]
    assert parked.parked and parked.num_threads == 1 and parked.affinity == (1,)

    step = settle(LEARNER_GENERATOR, step.held, frozenset({"generator"}))
    assert step.held == {"learner": frozenset(), "generator": {0, 1}}
    assert [(t.action, t.giver, t.taker, t.cpu_ids) for t in step.transfers] == [
        ("lend", "learner", "generator", (0,)), ("return", "learner", "generator", (1,))]
    assert [h.actor for h in step.revokes] == ["learner"], "the borrower gives back before the owner works"


def test_an_actor_that_only_lends_keeps_its_own_cores_while_busy_and_lends_them_while_idle():
    homes = {"learner": Home(frozenset({0}), 1), "generator": Home(frozenset({1}), 1, borrows=False)}
    assert assign(homes, frozenset({"generator"})) == {"learner": {0}, "generator": {1}}
    step = settle(homes, assign(homes, frozenset()), frozenset({"learner"}))
    assert step.held == {"learner": {0, 1}, "generator": frozenset()}
    step = settle(homes, step.held, frozenset({"generator"}))
    assert step.held == {"learner": {0}, "generator": {1}}
    assert [(t.action, t.giver, t.taker) for t in step.transfers] == [("return", "learner", "generator")]


def test_both_busy_each_holds_its_own_and_nobody_busy_is_home():
    both = assign(LEARNER_GENERATOR, frozenset({"learner", "generator"}))
    assert both == {"learner": {0}, "generator": {1}}
    assert assign(LEARNER_GENERATOR, frozenset()) == both
    assert plan(LEARNER_GENERATOR, both, frozenset({"learner", "generator"})).transfers == ()


def test_the_spare_cores_go_to_the_busy_actor_holding_fewest():
    homes = {"a": Home(frozenset({0, 1}), 2), "b": Home(frozenset({2}), 1), "c": Home(frozenset({3, 4}), 2)}
    held = assign(homes, frozenset({"a", "b"}))
    assert held == {"a": {0, 1, 4}, "b": {2, 3}, "c": frozenset()}


def test_homes_that_share_a_core_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="'a' and 'b' share core 0; elastic actors need cores of their own"):
        check_homes({"a": Home(frozenset({0}), 1), "b": Home(frozenset({0, 1}), 1)})


@st.composite
def homes_and_busy_sequences(draw):
    num_actors = draw(st.integers(1, 4))
    cores = draw(st.permutations(range(8)))
    cuts = sorted(draw(st.lists(st.integers(1, 7), min_size=num_actors - 1, max_size=num_actors - 1,
                                unique=True)))
    bounds = [0, *cuts, 8]
    homes = {f"actor{i}": Home(frozenset(cores[bounds[i]:bounds[i + 1]]), draw(st.integers(1, 3)),
                               borrows=draw(st.booleans()))
             for i in range(num_actors)}
    busy_sets = draw(st.lists(st.frozensets(st.sampled_from(sorted(homes))), min_size=1, max_size=12))
    return homes, busy_sets


@settings(max_examples=150, deadline=None)
@given(homes_and_busy_sequences())
def test_no_core_is_ever_pinned_to_two_actors_and_owners_hold_their_cores_when_busy(case):
    homes, busy_sets = case
    check_homes(homes)
    held = assign(homes, frozenset())
    for busy in busy_sets:
        step = settle(homes, held, busy)
        check_holdings(homes, step.held, busy)
        for transfer in step.transfers:
            assert transfer.giver not in busy or transfer.action != "lend", "a busy owner never lends"
        for holding in (*step.revokes, *step.grants):
            assert holding.num_threads >= 1
            assert holding.parked or holding.num_threads == homes[holding.actor].num_threads + len(
                holding.cpu_ids - homes[holding.actor].cpu_ids)
        held = step.held
