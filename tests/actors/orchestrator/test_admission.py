"""The admission rule: batch b starts once batch b - 1 - max_staleness is trained, the buffer holds at
most max_buffered_batches, backpressure says why admission waits, and stop wakes every waiter."""
import anyio
import pytest

from postrain.actors.orchestrator.admission import Admission
from postrain.core.testing import async_test


async def settle() -> None:
    """Let every task that can run, run (the admission is single-threaded, on this loop)."""
    for _ in range(10):
        await anyio.lowlevel.checkpoint()


@pytest.mark.parametrize("max_staleness, max_buffered, expect_ahead",
                         [(0, 0, 1), (2, 0, 3), (2, 1, 1), (3, 2, 2)])
@async_test
async def test_batches_run_ahead_of_training_by_the_rule(max_staleness, max_buffered, expect_ahead):
    admission = Admission(max_staleness, max_buffered)
    admitted = []

    async def admit_all():
        for b in range(6):
            batch = await admission.admit(b, groups=2, samples_per_group=3)
            admitted.append(batch.index)
            batch.generated.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(admit_all)
        for b in range(6):
            await settle()
            admission.check()
            assert admitted == list(range(min(b + expect_ahead, 6))), (b, admitted)
            if len(admitted) < 6:
                expected = "staleness" if expect_ahead == max_staleness + 1 else "buffer_full"
                assert admission.backpressure == expected
            batch = await admission.wait_generated(b)
            assert batch.num_samples == 6 and len(batch.groups) == 2
            admission.retire(b)
    assert admission.num_trained == 6 and not admission.buffered and admission.backpressure == "none"


@async_test
async def test_stop_wakes_the_admitter_and_the_trainer():
    admission = Admission(max_staleness=0, max_buffered_batches=0)
    admission.start_at(4)
    first = await admission.admit(4, groups=1, samples_per_group=1)
    results = {}

    async def admit_next():
        results["admit"] = await admission.admit(5, groups=1, samples_per_group=1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(admit_next)
        await settle()
        assert admission.figures()["backpressure"] == "staleness"
        first.generated.set()
        assert (await admission.wait_generated(4)) is first
        admission.stop()
    assert results["admit"] is None and admission.backpressure == "none"
    assert await admission.wait_generated(5) is None, "stopped before batch 5 was admitted"
