"""The balancer's rules (a pure function of figures) and its loop against a real pool actor (the sandbox)."""
import anyio
import pytest

from postrain.core import ActorSpec, Inventory, PlacementError, Scheduler, Supervisor
from postrain.cli.balancer import BackpressureFigures, Balancer, Figures, Memory, PoolFigures, decide
from postrain.cli.config import BalancerSection, parse_up_config
from postrain.core import ConfigError
from postrain.core.testing import async_test

CONFIG = BalancerSection(grow_when_queued=2, grow_after_ticks=2, shrink_after_idle_s=10.0,
                         min_workers=1, max_workers=3, worker_cpus=0.1)


def pool(queued=0, running=0, workers=1, reserved=0.2, incarnation=1):
    return PoolFigures("pool", incarnation, queued, running, workers, reserved, spec_cpus=0.2)


def run_ticks(snapshots, memory=None, config=CONFIG):
    """decide() over (time_s, free_cpus, pool figures) snapshots; all decisions in order."""
    memory = memory or Memory()
    decisions = []
    for time_s, free_cpus, sb in snapshots:
        made, memory = decide(Figures(time_s, free_cpus, (sb,)), memory, config)
        decisions += made
    return decisions, memory


def test_a_lasting_backlog_adds_one_worker_and_its_cores():
    one, _ = run_ticks([(0, 1.0, pool(queued=5, running=1))])
    assert one == [], "one tick of backlog is not yet a trend"
    decisions, _ = run_ticks([(0, 1.0, pool(queued=5, running=1)), (1, 1.0, pool(queued=5, running=1))])
    [grow] = decisions
    assert (grow.action, grow.num_workers, grow.cpus) == ("grow", 2, pytest.approx(0.3))
    assert grow.figures["queued"] == 5 and "5 queued for 2 ticks" in grow.reason


def test_a_short_queue_below_the_threshold_changes_nothing():
    decisions, _ = run_ticks([(t, 1.0, pool(queued=1, running=1)) for t in range(10)])
    assert decisions == []


def test_growth_stops_at_max_workers():
    decisions, _ = run_ticks([(t, 1.0, pool(queued=9, running=3, workers=3, reserved=0.4))
                              for t in range(6)])
    assert decisions == []


def test_no_free_cores_refuses_once_per_backlog_and_reserves_nothing():
    busy = [(t, 0.05, pool(queued=4, running=1)) for t in range(6)]
    decisions, memory = run_ticks(busy)
    assert [d.action for d in decisions] == ["refuse_grow"]
    assert "0.10 more cores needed, 0.05 free" in decisions[0].reason
    decisions, memory = run_ticks([(6, 0.05, pool(queued=0))] + busy, memory)
    assert [d.action for d in decisions] == ["refuse_grow"], "a new backlog is refused (and logged) again"


def test_an_idle_pool_shrinks_after_the_idle_time_but_never_below_the_minimum():
    idle = [(t, 1.0, pool(workers=2, reserved=0.3)) for t in (0, 5, 10)]
    decisions, memory = run_ticks(idle)
    [shrink] = decisions
    assert (shrink.action, shrink.num_workers, shrink.cpus) == ("shrink", 1, pytest.approx(0.2))
    decisions, _ = run_ticks([(t, 1.0, pool(workers=1)) for t in range(11, 40, 5)], memory)
    assert decisions == [], "min_workers = 1"


def test_a_busy_worker_keeps_the_pool_from_shrinking():
    decisions, _ = run_ticks([(t, 1.0, pool(running=2, workers=2, reserved=0.3)) for t in range(0, 60, 5)])
    assert decisions == []


def test_the_cores_of_a_worker_are_counted_from_the_workers_it_started_with():
    # first seen with 2 workers (its spec's cpus cover those): a third costs one worker's cores
    decisions, _ = run_ticks([(t, 1.0, pool(queued=3, running=2, workers=2)) for t in range(2)])
    assert decisions[0].cpus == pytest.approx(0.3)


def test_a_restarted_pool_is_counted_afresh():
    grown, memory = run_ticks([(t, 1.0, pool(queued=3, running=1)) for t in range(2)])
    assert grown[0].num_workers == 2
    decisions, _ = run_ticks([(t, 1.0, pool(queued=3, running=1, incarnation=2)) for t in (2, 3)], memory)
    assert decisions[0].cpus == pytest.approx(0.3), "the new incarnation started with 1 worker again"


def test_each_change_of_backpressure_is_one_decision_with_its_figures():
    memory = Memory()
    states = ["", "staleness", "staleness", "buffer_full", ""]
    actions = []
    for t, state in enumerate(states):
        actor = BackpressureFigures("driver", state, {"buffer_batches": t, "learner_idle_s": 1.5})
        made, memory = decide(Figures(t, 1.0, (), (actor,)), memory, CONFIG)
        actions += [(d.action, d.figures["state"], d.figures["buffer_batches"], d.reason) for d in made]
    assert actions == [("backpressure", "staleness", 1, "holds back new work: staleness"),
                       ("backpressure", "buffer_full", 3, "holds back new work: buffer_full"),
                       ("backpressure", "", 4, "takes new work again (held back by buffer_full)")]


def test_balancer_config_is_validated():
    assert parse_up_config({"balancer": {"max_workers": 4}}).balancer.max_workers == 4
    with pytest.raises(ConfigError, match=r"min_workers \(3\) must be <= max_workers \(2\)"):
        parse_up_config({"balancer": {"min_workers": 3, "max_workers": 2}})
    with pytest.raises(ConfigError, match=r"balancer.interval_s = 0"):
        parse_up_config({"balancer": {"interval_s": 0}})
    with pytest.raises(ConfigError, match=r"balancer.grow_when_qeued = 1: unknown field"):
        parse_up_config({"balancer": {"grow_when_qeued": 1}})


def test_scheduler_resize_grows_across_cores_refuses_atomically_and_shrinks_back():
    sched = Scheduler(Inventory(cpu_ids=(0, 1), memory_mb=1000))
    sched.place(ActorSpec(name="learner", cls="x.y:Z", cpus=0.75, memory_mb=0))
    home = sched.place(ActorSpec(name="sandbox", cls="x.y:Z", cpus=0.2, memory_mb=0)).cpu_ids
    assert sched.resize("sandbox", 0.5).cpu_ids == (0, 1), "its own core fills up first, then another"
    assert sched.reserved_cpus("sandbox") == pytest.approx(0.5)
    with pytest.raises(PlacementError, match="asks to grow to 1.5 cores; free: 0.75 of 2 cores"):
        sched.resize("sandbox", 1.5)
    assert sched.reserved_cpus("sandbox") == pytest.approx(0.5) and sched.free_cpus() == pytest.approx(0.75)
    assert sched.resize("sandbox", 0.2).cpu_ids == home, "shrinking gives back the core it took last"
    assert sched.free_cpus() == pytest.approx(1.05)
    sched.check()


SLOW_CALL = "import time; time.sleep(1.5); print('done')"


@pytest.mark.slow
@async_test
async def test_a_sandbox_under_a_queue_of_slow_tool_calls_gets_more_workers_then_gives_them_back():
    config = BalancerSection(interval_s=0.2, grow_when_queued=2, grow_after_ticks=1, shrink_after_idle_s=0.5,
                             min_workers=1, max_workers=3, worker_cpus=0.1)
    scheduler = Scheduler(Inventory(cpu_ids=(0, 1), memory_mb=4096))
    async with Supervisor.open(scheduler=scheduler, heartbeat_interval_s=0.2) as sup:
        ref = await sup.start(ActorSpec(name="sandbox", cls="postrain.actors.sandbox:SandboxActor",
                                        cpus=0.2, memory_mb=512, options={"mode": "warm", "num_workers": 1}))
        balancer = Balancer(sup, config)
        results = []

        async def call():
            results.append(await ref.ask("exec", {"code": SLOW_CALL}, timeout_s=60))

        async with anyio.create_task_group() as tg:
            tg.start_soon(balancer.run)
            async with anyio.create_task_group() as calls:
                for _ in range(6):
                    calls.start_soon(call)
            with anyio.fail_after(30):
                while not any(d.action == "shrink" for d in balancer.decisions) \
                        or (await ref.ask("stats", timeout_s=10))["workers"] != 1:
                    await anyio.sleep(0.2)
            tg.cancel_scope.cancel()
        grows = [d for d in balancer.decisions if d.action == "grow"]
        assert grows and grows[0].figures["queued"] >= 2, balancer.decisions
        assert max(d.num_workers for d in grows) >= 2
        assert [r["status"] for r in results] == ["ok"] * 6
        assert all(r["stdout"] == b"done\n" for r in results)
        assert scheduler.reserved_cpus("sandbox") == pytest.approx(0.2), "the extra cores went back"
        assert not [d for d in balancer.decisions if d.action.endswith("_failed")], balancer.decisions
