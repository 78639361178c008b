"""Placement on CPU cores, memory and GPUs: specific resources or a clear refusal."""
import pytest
from hypothesis import given, strategies as st

from postrain.core import ActorSpec, Inventory, PlacementError, Scheduler
from postrain.core.scheduler import GpuInfo


def spec(name, **kw):
    return ActorSpec(name=name, cls="x.y:Z", **kw)


def four_cores(gpus=()):
    return Scheduler(Inventory(cpu_ids=(0, 1, 2, 3), memory_mb=8000, gpus=gpus))


def test_whole_core_requests_get_their_own_cores_and_thread_counts():
    sched = four_cores()
    learner = sched.place(spec("learner", cpus=2, memory_mb=4000))
    gen = sched.place(spec("gen", cpus=1, memory_mb=1000))
    assert learner.cpu_ids == (0, 1) and learner.num_threads == 2
    assert gen.cpu_ids == (2,) and set(gen.cpu_ids).isdisjoint(learner.cpu_ids)
    sched.check()


def test_fractional_requests_share_a_core_up_to_its_capacity():
    sched = four_cores()
    placed = [sched.place(spec(f"env{i}", cpus=0.25, memory_mb=0)) for i in range(4)]
    assert {p.cpu_ids for p in placed} == {(3,)}, "fractions pack onto one core, leaving others idle"
    assert sched.place(spec("whole", cpus=3)).cpu_ids == (0, 1, 2)
    sched.check()


def test_a_request_that_cannot_be_met_names_what_was_asked_and_what_is_free():
    sched = four_cores()
    sched.place(spec("a", cpus=3, memory_mb=0))
    with pytest.raises(PlacementError, match=r"actor 'b' asks for 2 cores.*free: 1.00 of 4 cores"):
        sched.place(spec("b", cpus=2, memory_mb=0))
    with pytest.raises(PlacementError, match=r"asks for .* 9000 MiB"):
        sched.place(spec("c", cpus=0.5, memory_mb=9000))
    with pytest.raises(PlacementError, match="GPUs free: none"):
        sched.place(spec("d", cpus=0.5, gpus=1, memory_mb=0))
    assert set(sched.placements) == {"a"}, "a refused placement reserves nothing"


def test_gpus_are_handed_out_by_id_and_released():
    sched = four_cores(gpus=(GpuInfo(0, "H100", 80000), GpuInfo(1, "H100", 80000)))
    assert sched.place(spec("learner", cpus=1, gpus=2, memory_mb=0)).gpu_ids == (0, 1)
    with pytest.raises(PlacementError):
        sched.place(spec("gen", cpus=1, gpus=1, memory_mb=0))
    sched.release("learner")
    assert sched.place(spec("gen", cpus=1, gpus=1, memory_mb=0)).gpu_ids == (0,)


def test_plan_is_a_dry_run_that_leaves_the_scheduler_untouched():
    sched = four_cores()
    plan = sched.plan([spec("a", cpus=2), spec("b", cpus=1.5)])
    assert [p.name for p in plan] == ["a", "b"] and sched.placements == {}


@given(st.lists(st.tuples(st.sampled_from([0.25, 0.5, 1.0, 2.0]), st.integers(0, 3000)), max_size=12),
       st.lists(st.integers(0, 11), max_size=6))
def test_placement_never_oversubscribes_cores_or_memory(requests, releases):
    sched = four_cores()
    for i, (cpus, memory_mb) in enumerate(requests):
        try:
            sched.place(spec(f"a{i}", cpus=cpus, memory_mb=memory_mb))
        except PlacementError:
            pass
        sched.check()
    for i in releases:
        sched.release(f"a{i}")
        sched.check()
