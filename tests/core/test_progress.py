"""Phase progress (core/progress.py): done / total, elapsed, ETA, on a test clock."""
from postrain.core.progress import PhaseProgress, eta_seconds, format_duration


def test_durations_read_as_minutes_and_seconds_or_hours():
    assert [format_duration(s) for s in (0, 59.6, 61, 3600 + 62, None)] == ["0:00", "1:00", "1:01", "1:01:02", "?"]


def test_the_eta_is_the_rate_so_far_times_what_is_left():
    assert eta_seconds(done_here=0, left=10, elapsed_s=5.0) is None
    assert eta_seconds(done_here=2, left=8, elapsed_s=10.0) == 40.0
    assert eta_seconds(done_here=3, left=0, elapsed_s=10.0) == 0.0


def test_a_phase_counts_reports_and_ignores_work_done_before_its_resume():
    now, reports = [100.0], []
    progress = PhaseProgress("warm start", 10, reports.append, done=4, clock=lambda: now[0], report_interval_s=5)
    assert progress.text() == "4/10, 0:00 elapsed, ETA ?"
    now[0] = 110.0
    progress.advance()                 # 1 step in 10 s here; 5 left
    assert progress.text() == "5/10, 0:10 elapsed, ETA 0:50"
    now[0] = 112.0
    progress.advance()                 # within report_interval_s: not reported
    now[0] = 120.0
    progress.advance(4)                # the last: always reported
    assert [r["phase_done"] for r in reports] == [5, 10]
    assert reports[-1]["phase"] == "warm start" and reports[-1]["phase_total"] == 10
    assert reports[-1]["phase_eta_s"] == 0.0 and reports[-1]["phase_elapsed_s"] == 20.0
