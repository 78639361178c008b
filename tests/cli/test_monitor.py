"""The head's monitor: queue rows in metrics.jsonl, and a real `postrain up` serving its figures."""
import json
import subprocess
import sys
import time
import urllib.request

from postrain.cli.config import parse_up_config
from postrain.core.load import Load
from postrain.core.metrics import read_metrics
from postrain.cli.monitor import RunMonitor
from postrain.core.testing import counting_run_config

class ReportingSupervisor:
    """Stands in for the supervisor: a status whose loads report queue depths."""

    def __init__(self, loads):
        self.loads = loads

    def status(self):
        return {"actors": [{"name": f"a{i}", "state": "running", "pid": i, "restarts": 0,
                            "heartbeat_age_s": 0.1, "load": load.to_wire()} for i, load in enumerate(self.loads)]}


def test_queue_rows_hold_the_depths_the_actors_report_and_nothing_when_none_does(tmp_path):
    config = parse_up_config({"run": {"name": "m"}, "head": {"metrics_port": -1}})
    with RunMonitor(tmp_path, config, quiet=True).start() as monitor:
        assert monitor.metrics_url is None                        # -1 turns the endpoint off
        monitor.attach(ReportingSupervisor([Load(served=4)]))
        monitor.refresh()
        assert monitor.write_queue_row() is None
        monitor.attach(ReportingSupervisor([Load(queued=2, running=1, workers=1), Load(queued=3),
                                            Load(running=4, figures={"buffer_samples": 9})]))
        monitor.figures({"a0_queued": 9})                       # a step figure is not a fresh depth
        monitor.refresh()
        monitor.write_queue_row()
    rows = read_metrics(tmp_path, "queue")
    assert len(rows) == 1
    assert {k: v for k, v in rows[0].items() if k not in ("time", "kind")} == {
        "a0_queued": 2, "a0_running": 1, "a1_queued": 3, "a2_running": 4}


def test_up_prints_and_records_its_metrics_url_and_serves_the_drivers_figures(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(counting_run_config(tmp_path / "runs", name="m", steps=100, step_s=0.05,
                                          heartbeat_interval_s=0.2))
    head = subprocess.Popen([sys.executable, "-m", "postrain.cli", "up", "--quiet", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder = tmp_path / "runs" / "m"
    try:
        printed_url = None
        for line in head.stdout:
            if line.strip().startswith("metrics: "):
                printed_url = line.split("metrics: ", 1)[1].strip()
            if line.startswith("step 1"):   # the driver is streaming: the head serves its figures
                break
        recorded_url = json.loads((folder / "head.json").read_text())["metrics_url"]
        assert printed_url == recorded_url and recorded_url.startswith("http://127.0.0.1:")
        deadline = time.monotonic() + 60
        while True:   # the exporter publishes on each figures item and each 1 s tick
            text = urllib.request.urlopen(recorded_url, timeout=10).read().decode()
            if "postrain_step " in text and 'postrain_actor_up{actor="driver"} 1.0' in text:
                break
            assert time.monotonic() < deadline, text
        assert "postrain_num_steps 100.0" in text and 'postrain_actor_restarts{actor="echo"} 0.0' in text
        assert head.wait(timeout=120) == 0
        assert not (folder / "head.json").exists()
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()
