"""A run's actors start in order with their imports overlapping (Supervisor.start_in_order), and
an actor's process exits without the interpreter's teardown of modules but with an exit's duties."""
import anyio
import pytest

from postrain.core import ActorSpec, ActorStartError, Supervisor
from postrain.core.errors import PlacementError
from postrain.core.testing import assert_nothing_left, async_test

ECHO = "postrain.core.testing:EchoActor"

FIRST = """
import pathlib, time
from postrain.core.testing import EchoActor

class First(EchoActor):
    async def setup(self):
        # READY only once the next actor's module is imported: a start one at a time never gets there
        marker = pathlib.Path(__file__).parent / "second_imported"
        for _ in range(1200):
            if marker.exists():
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("the second actor's module was not imported while the first set up")
        await super().setup()
"""

SECOND = """
import pathlib
from postrain.core.testing import ASK_PEER, EchoActor

(pathlib.Path(__file__).parent / "second_imported").write_text("imported")

class Second(EchoActor):
    async def setup(self):
        await super().setup()
        # its setup comes after the first's READY: the first answers already
        self.first_said = await self.ask_peer({"name": "first"})

    async def teardown(self):
        pathlib.Path(__file__).parent.joinpath("second_saw").write_text(repr(self.first_said["caller"]))
"""

LOOKS_AHEAD = """
from postrain.core.testing import EchoActor

class LooksAhead(EchoActor):
    async def setup(self):
        await super().setup()
        await self.lookup("later")  # an actor after this one in the order: not there yet
"""

EXIT_DUTIES = """
import atexit, pathlib, threading, time
from postrain.core.testing import EchoActor

OUT = pathlib.Path(__file__).parent

class LeavesWork(EchoActor):
    async def teardown(self):
        atexit.register((OUT / "atexit_ran").write_text, "ran")
        def finish():
            time.sleep(0.5)  # a last write still going when the actor's loop has ended
            (OUT / "thread_finished").write_text("finished")
        threading.Thread(target=finish).start()
"""


def spec(name, **kw):
    kw.setdefault("cpus", 0.25)
    kw.setdefault("memory_mb", 0)
    kw.setdefault("cls", ECHO)
    return ActorSpec(name=name, **kw)


@pytest.fixture
def actor_modules(tmp_path, monkeypatch):
    """The folder of the modules above, on the spawned processes' path."""
    for module, text in {"first_actor": FIRST, "second_actor": SECOND, "looks_ahead_actor": LOOKS_AHEAD,
                         "exit_duties_actor": EXIT_DUTIES}.items():
        (tmp_path / f"{module}.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))  # the spawned processes start with this sys.path
    return tmp_path


@async_test
async def test_the_next_actor_imports_while_one_sets_up_and_sets_up_after_it_is_ready(actor_modules):
    started = []
    async with Supervisor.open() as sup:
        await sup.start_in_order([spec("first", cls="first_actor:First", start_timeout_s=300),
                                  spec("second", cls="second_actor:Second")],
                                 lambda s: started.append(s.name))
        assert started == ["first", "second"]
        assert [e.detail.split(",")[0] for e in sup.events if e.event == "started"] == [
            f"pid {sup.records['first'].pid}", f"pid {sup.records['second'].pid}"]
        await sup.stop("second")
    assert (actor_modules / "second_saw").read_text() == "'second'", "the first answered the second's setup"


@async_test
async def test_a_lookup_in_setup_finds_only_the_actors_before_it(actor_modules):
    async with Supervisor.open() as sup:
        with pytest.raises(ActorStartError, match="no actor named 'later'"):
            await sup.start_in_order([spec("echo"), spec("ahead", cls="looks_ahead_actor:LooksAhead"),
                                      spec("later")])
        assert sup.records["echo"].state == "running" and "later" not in sup.records
        run_tag = sup.run_tag
    assert_nothing_left(run_tag)


@async_test
async def test_a_failed_start_kills_the_actors_waiting_for_their_turn_and_leaves_nothing():
    async with Supervisor.open() as sup:
        with pytest.raises(ActorStartError, match="setup failed on purpose"):
            await sup.start_in_order([spec("bad", options={"fail_setup": True}), spec("next"), spec("last")])
        assert list(sup.records) == ["bad"] and sup.records["bad"].state == "failed"
        assert_nothing_left(sup.run_tag)  # while the head lives: the waiting ones were killed, not orphaned
        assert sup.scheduler.free_memory_mb() == sup.scheduler.inventory.memory_mb, "placements released"


@async_test
async def test_an_actor_that_does_not_fit_fails_the_start_before_any_process_starts():
    async with Supervisor.open() as sup:
        with pytest.raises(PlacementError):
            await sup.start_in_order([spec("echo"), spec("huge", memory_mb=10**9)])
        assert not sup.records and sup.scheduler.free_memory_mb() == sup.scheduler.inventory.memory_mb
        assert_nothing_left(sup.run_tag)


@async_test
async def test_a_start_cancelled_midway_keeps_the_ready_ones_and_kills_the_rest(actor_modules):
    async with Supervisor.open() as sup:
        with anyio.CancelScope() as scope:
            await sup.start_in_order([spec("echo"), spec("slow", options={"setup_s": 600}), spec("last")],
                                     lambda s: scope.cancel() if s.name == "echo" else None)
        assert sup.records["echo"].state == "running" and "last" not in sup.records
        assert await sup.ref("echo").ask("echo", "still here") == "still here"
        run_tag = sup.run_tag
    assert_nothing_left(run_tag)


@async_test
async def test_a_stopped_actor_exits_0_after_its_threads_and_atexit_handlers(actor_modules):
    async with Supervisor.open() as sup:
        await sup.start(spec("worker", cls="exit_duties_actor:LeavesWork"))
        await sup.stop("worker")
        assert sup.events[-1].detail == "exited with code 0"
    assert (actor_modules / "thread_finished").read_text() == "finished"
    assert (actor_modules / "atexit_ran").read_text() == "ran"
