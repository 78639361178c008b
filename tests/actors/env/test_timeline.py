"""What a trace shows of a sandbox call (actors/env/timeline.py)."""
from postrain.actors.records import ExecReply, RunTestsReply
from postrain.actors.env.timeline import tool_status


def test_a_run_tests_hop_counts_the_tests_that_passed_not_the_tests_run():
    reply = RunTestsReply(passed={"test_a": True, "test_b": False, "test_c": True}, errors={"test_b": "assert"},
                          result=ExecReply(status="nonzero_exit", exit_code=1))
    assert tool_status(reply) == {"status": "nonzero_exit", "tests_passed": 2, "num_tests": 3}


def test_an_exec_hop_shows_its_status():
    assert tool_status(ExecReply(status="timeout")) == {"status": "timeout"}
