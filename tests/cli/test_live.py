"""The live view of `postrain up`: a frame from figures and status, plain lines otherwise."""
import io
import re

from rich.console import Console

from postrain.cli.live import (LiveView, PlainView, RunSnapshot, make_view, progress_text, queue_depths,
                               render_frame)
from postrain.core.load import Load

STATUS = {"actors": [
    {"name": "pool", "state": "running", "pid": 4242, "restarts": 0, "heartbeat_age_s": 0.4,
     "load": Load(served=7, queued=3, running=2, workers=2).to_wire()},
    {"name": "driver", "state": "restarting", "pid": 4343, "restarts": 2, "heartbeat_age_s": None,
     "load": Load(queued=5, running=8, backpressure="staleness", figures={"buffer_samples": 64}).to_wire()},
    {"name": "quiet", "state": "starting", "pid": 4444, "restarts": 0, "heartbeat_age_s": None, "load": None},
]}
FIGURES = {"step": 3, "num_steps": 40, "reward_mean": 0.61, "kl": 0.0123, "tokens_per_s": 5021.3,
           "staleness_max": 1, "sync_s": 0.21}


def snapshot() -> RunSnapshot:
    snap = RunSnapshot("demo", started=100.0, status=STATUS, last_line="step 3/40: reward 0.610")
    snap.add_figures(FIGURES)
    return snap


def render_text(snap: RunSnapshot) -> str:
    console = Console(file=io.StringIO(), width=140, record=True)
    console.print(render_frame(snap, now=175.0))
    return console.export_text()


def test_a_frame_shows_the_figures_queues_and_every_actor():
    text = render_text(snapshot())
    assert "postrain up: demo   1m15s" in text and "step 3/40: reward 0.610" in text
    for expected in ("3/40", "0.610", "0.0123", "5,021", "0.21"):
        assert expected in text, expected
    lines = text.splitlines()
    assert "actor   queued  running  workers" in text
    assert "pool         3        2        2" in text and "driver       5        8        -" in text
    pool_row = next(line for line in lines if "pool " in line and "4242" in line)
    assert "running" in pool_row and "0.4" in pool_row and "queued=3 running=2 workers=2" in pool_row
    driver_row = next(line for line in lines if "driver" in line and "4343" in line)
    assert "restarting" in driver_row and " 2 " in driver_row
    assert "backpressure=staleness" in driver_row and "buffer_samples=64" in text
    quiet_row = next(line for line in lines if "quiet" in line and "4444" in line)
    assert quiet_row.rstrip().endswith("-"), "no heartbeat yet: no load"


def test_on_a_cluster_each_actor_shows_its_node_and_on_one_host_no_node_column():
    nodes = [{"name": "10.0.0.2", "address": "10.0.0.2", "state": "alive", "reason": "", "actors": ["pool"],
              "free": ""}]
    actors = [{**STATUS["actors"][0], "node": "10.0.0.2"}, {**STATUS["actors"][1], "node": "10.0.0.3"}]
    text = render_text(RunSnapshot("demo", started=100.0, status={"nodes": nodes, "actors": actors}))
    assert re.search(r"actor +node +state", text)
    assert next(line for line in text.splitlines() if "4242" in line).split()[:3] == ["pool", "10.0.0.2", "running"]
    assert next(line for line in text.splitlines() if "4343" in line).split()[:2] == ["driver", "10.0.0.3"]
    assert " node " not in render_text(snapshot())


def test_queue_depths_are_each_actors_reported_work_and_nothing_it_does_not_report():
    depths = queue_depths(snapshot())
    assert depths == {"pool_queued": 3, "pool_running": 2, "driver_queued": 5, "driver_running": 8}
    assert queue_depths(RunSnapshot("x", status={"actors": [{"name": "a", "load": Load(served=4).to_wire()}]})) == {}


def test_quiet_or_a_pipe_gives_plain_lines_and_a_terminal_gives_the_live_view():
    class Terminal(io.StringIO):
        def isatty(self):
            return True
    assert isinstance(make_view(quiet=True, stream=Terminal()), PlainView)
    assert isinstance(make_view(quiet=False, stream=io.StringIO()), PlainView)
    assert isinstance(make_view(quiet=False, stream=Terminal()), LiveView)
    out = io.StringIO()
    with make_view(quiet=True, stream=out) as view:
        view.line("step 1/2: reward 0.500", snapshot())
        view.refresh(snapshot())
        view.line("step 2/2: reward 0.750", snapshot())
    assert out.getvalue() == "step 1/2: reward 0.500\nstep 2/2: reward 0.750\n"


def test_the_live_view_keeps_every_line_above_its_frame():
    out = io.StringIO()
    console = Console(file=out, width=140, force_terminal=True)
    with LiveView(console) as view:
        view.line("held-out accuracy before: 0.000", snapshot())
        view.refresh(snapshot())
    text = out.getvalue()
    assert "held-out accuracy before: 0.000" in text and "queues" in text


def test_the_phase_under_way_shows_done_total_elapsed_and_an_eta_that_counts_down():
    figures = {"phase": "warm start", "phase_done": 50, "phase_total": 250, "phase_elapsed_s": 60.0,
               "phase_eta_s": 240.0, "phase_started": 1000.0, "phase_updated": 1060.0}
    assert progress_text(figures, now=1060.0) == "warm start 50/250  elapsed 1:00  ETA 4:00"
    assert progress_text(figures, now=1090.0) == "warm start 50/250  elapsed 1:30  ETA 3:30"
    assert progress_text({**figures, "phase_eta_s": None}, now=1060.0).endswith("ETA ?")
    assert progress_text({}, now=0.0) == ""
    snap = snapshot()
    snap.add_figures({**figures, "phase_started": 115.0, "phase_updated": 175.0})
    assert "warm start 50/250  elapsed 1:00  ETA 4:00" in render_text(snap)
