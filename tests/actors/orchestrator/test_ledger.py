"""The sample ledger: forward-only lifecycles, balanced counts, persistence."""
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from postrain.actors.orchestrator.ledger import LedgerError, SampleLedger, read_events


def test_a_sample_moves_forward_and_the_ledger_balances(tmp_path):
    ledger = SampleLedger(tmp_path / "events.jsonl")
    for sid in ("a", "b", "c"):
        ledger.create(sid, prompt_id=0)
    ledger.advance("a", "generated", actor="gen")
    ledger.note("a", "tool_call", status="ok")
    ledger.advance("a", "rewarded", reward=1.0)
    ledger.advance("a", "trained", step=3)
    ledger.drop("b", "environment raised ValueError")
    assert ledger.counts() == {"created": 3, "in_flight": 1, "trained": 1, "dropped": 1,
                               "drop_reasons": {"environment raised ValueError": 1}}
    ledger.check()
    ledger.close()
    events = read_events(tmp_path / "events.jsonl", "a")
    assert [e["event"] for e in events] == ["created", "generated", "tool_call", "rewarded", "trained"]
    assert events[-1]["step"] == 3


def test_illegal_transitions_name_the_sample_and_the_rule():
    ledger = SampleLedger()
    ledger.create("a")
    with pytest.raises(LedgerError, match="already exists"):
        ledger.create("a")
    ledger.advance("a", "rewarded")
    with pytest.raises(LedgerError, match="cannot go from rewarded to generated"):
        ledger.advance("a", "generated")
    with pytest.raises(LedgerError, match="unknown sample 'zz'"):
        ledger.drop("zz", "x")
    ledger.advance("a", "trained")
    with pytest.raises(LedgerError, match="already trained"):
        ledger.drop("a", "late")


def test_state_dict_round_trip_keeps_every_count():
    ledger = SampleLedger()
    for i in range(5):
        ledger.create(str(i))
    ledger.advance("0", "trained")
    ledger.drop("1", "stale")
    restored = SampleLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.counts() == ledger.counts()
    assert sorted(restored.in_flight()) == ["2", "3", "4"]


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.ledger = SampleLedger()
        self.next_id = 0

    @rule()
    def create(self):
        self.ledger.create(str(self.next_id))
        self.next_id += 1

    @rule(index=st.integers(0, 50), state=st.sampled_from(["generated", "rewarded", "trained"]))
    def advance(self, index, state):
        try:
            self.ledger.advance(str(index), state)
        except LedgerError:
            pass

    @rule(index=st.integers(0, 50))
    def drop(self, index):
        try:
            self.ledger.drop(str(index), "reason")
        except LedgerError:
            pass

    @invariant()
    def balances(self):
        self.ledger.check()


TestLedgerStateful = LedgerMachine.TestCase


def test_a_full_disk_refuses_a_transition_whole_and_the_ledger_stays_as_it_was(small_disk):
    from postrain.core.errors import DiskFullError

    folder = small_disk(16)
    ledger = SampleLedger(folder / "ledger.jsonl")
    with pytest.raises(DiskFullError, match="ledger.jsonl"):
        for i in range(100_000):
            ledger.create(f"s{i}", prompt="p" * 100)
            ledger.advance(f"s{i}", "generated", tokens=12)
    ledger.check()
    last_event = {e["sample_id"]: e["event"] for e in read_events(folder / "ledger.jsonl")}
    assert last_event == ledger.state_dict()["state"], "the file and the ledger agree on every sample"
    assert (folder / "ledger.jsonl").read_bytes().endswith(b"\n")
