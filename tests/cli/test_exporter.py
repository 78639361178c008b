"""The head's Prometheus endpoint: real HTTP server, scraped with urllib."""
import urllib.request

import pytest

from postrain.core.errors import PostrainError
from postrain.cli.exporter import PrometheusExporter, metric_name
from postrain.cli.live import RunSnapshot
from postrain.core.load import Load

STATUS = {"actors": [
    {"name": "pool", "state": "running", "pid": 1, "restarts": 0, "heartbeat_age_s": 0.25,
     "load": Load(served=9, queued=3, running=1, workers=2,
                  figures={"hit_rate": 0.5, "note": "text is not a gauge"}).to_wire()},
    {"name": "trainer", "state": "restarting", "pid": 2, "restarts": 2, "heartbeat_age_s": None, "load": None},
]}


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


@pytest.fixture
def exporter():
    exporter = PrometheusExporter()
    exporter.start("127.0.0.1", 0)
    yield exporter
    exporter.stop()


def test_the_endpoint_serves_figures_queues_and_actor_health(exporter):
    snapshot = RunSnapshot("demo", status=STATUS)
    snapshot.add_figures({"step": 3, "reward_mean": 0.5, "kl": 0.01, "phase": "rl"})
    exporter.publish(snapshot)
    assert exporter.url.startswith("http://127.0.0.1:") and exporter.url.endswith("/metrics")
    text = scrape(exporter.url)
    for line in ('postrain_step 3.0', 'postrain_reward_mean 0.5', 'postrain_kl 0.01',
                 'postrain_actor_up{actor="pool"} 1.0', 'postrain_actor_up{actor="trainer"} 0.0',
                 'postrain_actor_state{actor="trainer",state="restarting"} 1.0',
                 'postrain_actor_restarts{actor="trainer"} 2.0',
                 'postrain_actor_heartbeat_age_seconds{actor="pool"} 0.25',
                 'postrain_actor_queued{actor="pool"} 3.0', 'postrain_actor_running{actor="pool"} 1.0',
                 'postrain_actor_workers{actor="pool"} 2.0',
                 'postrain_actor_load{actor="pool",figure="served"} 9.0',
                 'postrain_actor_load{actor="pool",figure="hit_rate"} 0.5'):
        assert line in text, line
    assert "postrain_phase" not in text and "note" not in text      # strings are not gauges
    assert 'actor_queued{actor="trainer"}' not in text, "no load yet: no load series"


def test_a_scrape_shows_the_latest_snapshot_and_nothing_stale(exporter):
    snapshot = RunSnapshot("demo", status=STATUS)
    exporter.publish(snapshot)
    assert 'actor="trainer"' in scrape(exporter.url)
    exporter.publish(RunSnapshot("demo", status={"actors": STATUS["actors"][:1]}))
    text = scrape(exporter.url)
    assert 'actor="trainer"' not in text and 'actor="pool"' in text


def test_a_taken_port_is_a_clear_error(exporter):
    port = int(exporter.url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(PostrainError, match=r"cannot serve metrics on 127.0.0.1:\d+ .*metrics_port"):
        PrometheusExporter().start("127.0.0.1", port)


def test_figure_names_become_valid_metric_names():
    assert metric_name("loss/policy-gradient") == "postrain_loss_policy_gradient"
