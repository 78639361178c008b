"""SeqOrder (postrain.actors.tinker.ordering): seq_id order, deduplication, gaps."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from postrain.actors.tinker.errors import TinkerAPIError
from postrain.actors.tinker.ordering import Op, SeqOrder


def op(name: str) -> Op:
    return Op(name, lambda: None)


@given(st.permutations(list(range(1, 9))))
def test_ops_leave_in_seq_id_order_whatever_order_they_arrive_in(arrival):
    order, ran = SeqOrder("m"), []
    for seq_id in arrival:
        order.add(seq_id, op(f"r{seq_id}"))
        while (ready := order.pop_ready()) is not None:
            ran.append(ready.request_id)
    assert ran == [f"r{i}" for i in range(1, 9)]
    assert order.waiting == {} and order.next_seq_id == 9


def test_a_resent_seq_id_gets_its_first_request_id_and_is_not_queued_again():
    order = SeqOrder("m")
    assert order.add(1, op("first")) == ("first", True)
    assert order.add(1, op("retry")) == ("first", False)
    assert order.pop_ready().request_id == "first" and order.pop_ready() is None
    assert order.add(1, op("late retry")) == ("first", False)
    with pytest.raises(TinkerAPIError, match="seq_id 0 of model 'm' is behind the next one"):
        order.add(0, op("never sent"))


def test_a_gap_drops_the_waiting_ops_and_moves_past_them():
    order = SeqOrder("m")
    order.add(3, op("r3"))
    order.add(4, op("r4"))
    assert order.gap_before(4) and order.pop_ready() is None
    ops, missing = order.skip_gap()
    assert [o.request_id for o in ops] == ["r3", "r4"] and missing == 1 and order.next_seq_id == 5
    order.add(5, op("r5"))
    assert order.pop_ready().request_id == "r5"
