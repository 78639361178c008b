"""Which actors a run drops when a lost node's actor fits on no node left (`go_without`), and
when it must stop instead: pure, no processes (the full run: tests/cluster/test_node_loss.py)."""
from __future__ import annotations

import pytest

from postrain.cli.node_watch import IndispensableError, go_without
from postrain.core.config import ActorSpec


def specs_of(**options) -> dict[str, ActorSpec]:
    return {name: ActorSpec(name=name, cls="postrain.core.testing:EchoActor", options=opts)
            for name, opts in options.items()}


SPECS = specs_of(**{"generator-0": {"model": "tiny"}, "generator-1": {"model": "tiny"},
                    "env-0": {"generator": "generator-0"}, "env-1": {"generator": "generator-1"},
                    "learner": {}, "orchestrator": {"generators": ["generator-0", "generator-1"],
                                                    "envs": ["env-0", "env-1"], "learner": "learner"}})
GROUPS = {"generator-0": "generator", "generator-1": "generator", "env-0": "env", "env-1": "env"}


def test_a_replica_goes_with_the_replicas_that_cannot_work_without_it():
    assert go_without("generator-1", SPECS, GROUPS, "orchestrator", set()) == {"generator-1": "",
                                                                                "env-1": "generator-1"}
    assert go_without("env-0", SPECS, GROUPS, "orchestrator", set()) == {"env-0": ""}


def test_the_last_replica_of_an_entry_is_indispensable():
    with pytest.raises(IndispensableError, match="'generator-0' \\(the last replica of 'generator' left\\)"):
        go_without("generator-0", SPECS, GROUPS, "orchestrator", {"generator-1", "env-1"})
    with pytest.raises(IndispensableError, match="'env-0' \\(the last replica of 'env' left\\)"):
        go_without("env-0", SPECS, GROUPS, "orchestrator", {"env-1"})


def test_an_actor_without_replicas_and_the_driver_are_indispensable():
    with pytest.raises(IndispensableError, match="'learner' \\(it has no replicas\\)"):
        go_without("learner", SPECS, GROUPS, "orchestrator", set())
    # the orchestrator names the learner as a single option: it would be dropped with it
    specs = {**SPECS, "learner": SPECS["learner"]}
    groups = {**GROUPS, "learner": "learner-group", "learner-b": "learner-group"}
    with pytest.raises(IndispensableError, match="'orchestrator' \\(the run's driver\\)"):
        go_without("learner", specs, groups, "orchestrator", set())
