"""Elastic cores with real processes: the head re-pins every thread of the actors that lend and borrow."""
import os

import pytest

from postrain.core import ActorSpec, Inventory, RemoteError, Scheduler, Supervisor
from postrain.core.lending import CoreHolding, CoreTransfer
from postrain.core.testing import async_test

ECHO = "postrain.core.testing:EchoActor"
CORES = sorted(os.sched_getaffinity(0))


def elastic(name, **kw):
    return ActorSpec(name=name, cls=ECHO, cpus=0.75, memory_mb=0, elastic=True, restart_backoff_s=0.05, **kw)


@pytest.mark.skipif(len(CORES) < 2, reason="lending needs two cores")
@async_test
async def test_an_idle_actors_core_goes_to_the_busy_one_and_comes_back_before_the_owner_works():
    inventory = Inventory(cpu_ids=CORES[:2], memory_mb=4096)
    async with Supervisor.open(scheduler=Scheduler(inventory)) as sup:
        learner, generator = await sup.start(elastic("learner")), await sup.start(elastic("generator"))
        home = {name: list(sup.records[name].placement.cpu_ids) for name in ("learner", "generator")}
        assert set(home["learner"]).isdisjoint(home["generator"]), "elastic actors are placed apart"
        await learner.ask("pinned"), await generator.ask("pinned")  # each starts an extra thread

        reply = await sup.lender.set_busy("learner", True)
        assert reply.transfers == [CoreTransfer("lend", list(home["generator"]), "generator", "learner")]
        assert reply.holdings["learner"] == CoreHolding(list(CORES[:2]), 2, False)
        assert await learner.ask("pinned") == {"cores": [CORES[:2]], "num_threads": 2}
        assert await learner.ask("compute_threads", timeout_s=60) == 2, "its compute runs 2 torch threads"
        assert await generator.ask("pinned") == {"cores": [home["generator"]], "num_threads": 1}, \
            "parked: its event loop stays home with one thread"

        reply = await sup.lender.set_busy("generator", True)  # both work: each holds its own
        assert [t.action for t in reply.transfers] == ["return"]
        assert await learner.ask("pinned") == {"cores": [home["learner"]], "num_threads": 1}
        assert await learner.ask("compute_threads", timeout_s=60) == 1, "its next compute is back to 1"
        assert await generator.ask("pinned") == {"cores": [home["generator"]], "num_threads": 1}

        await sup.lender.set_busy("learner", False)
        assert await generator.ask("pinned") == {"cores": [CORES[:2]], "num_threads": 2}

        sup.kill("generator")  # a restarted borrower starts with what it holds
        await sup.wait_running("generator", min_restarts=1)
        assert (await generator.ask("pinned"))["cores"] == [CORES[:2]]

        head = sup.node.ref(sup.address, "head")  # the message a driver sends
        assert (await head.ask("work", {"actor": "generator", "busy": False}))["transfers"] == [
            {"action": "return", "cpu_ids": home["learner"], "giver": "generator", "taker": "learner"}]
        assert (await head.ask("work", {"actor": "nobody", "busy": True}))["elastic"] is False
        with pytest.raises(RemoteError, match=r"WorkRequest needs field\(s\) \['busy'\]"):
            await head.ask("work", {"actor": "learner"})
