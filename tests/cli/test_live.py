"""The live view of `postrain up`: a frame from figures and status, plain lines otherwise."""
import io

from rich.console import Console

from postrain.cli.live import LiveView, PlainView, RunSnapshot, make_view, queue_depths, render_frame

STATUS = {"actors": [
    {"name": "sandbox", "state": "running", "pid": 4242, "restarts": 0, "heartbeat_age_s": 0.4,
     "load": {"sandbox_queued": 3, "inbox_queued": 0}},
    {"name": "orchestrator", "state": "restarting", "pid": 4343, "restarts": 2, "heartbeat_age_s": None,
     "load": {"prompts_waiting": 5, "rollouts_in_flight": 8, "buffer_samples": 64}},
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
    assert "prompts waiting     5" in text and "rollouts in flight  8" in text
    assert "rollout buffer      64" in text and "sandbox queue       3" in text
    sandbox_row = next(line for line in text.splitlines() if "sandbox " in line and "4242" in line)
    assert "running" in sandbox_row and "0.4" in sandbox_row and "sandbox_queued=3" in sandbox_row
    orchestrator_row = next(line for line in text.splitlines() if "orchestrator" in line and "4343" in line)
    assert "restarting" in orchestrator_row and " 2 " in orchestrator_row


def test_queue_depths_prefer_heartbeat_loads_and_fall_back_on_step_figures():
    snap = snapshot()
    snap.add_figures({"rollout_buffer": 1, "generator_waiting": 7})
    depths = queue_depths(snap)
    assert depths["rollout_buffer"] == 64          # the load is fresher than the step's figure
    assert depths["generator_waiting"] == 7        # no actor reports it: the figure stands in
    assert "generator_waiting" not in queue_depths(RunSnapshot("x", status=STATUS))


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
    assert "held-out accuracy before: 0.000" in text and "rollouts in flight" in text
