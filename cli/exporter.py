"""The head's Prometheus endpoint: the run's figures and every actor's health, over HTTP.

    exporter = PrometheusExporter()
    url = exporter.start(host="127.0.0.1", port=0)   # port 0 picks a free port
    exporter.publish(snapshot)                       # after each change (the head's event loop)
    exporter.stop()

Every family is a gauge computed at scrape time from the last published
snapshot, so an actor that is gone or a figure the driver stopped sending
leaves no stale series behind:

    postrain_<figure>                            each numeric driver figure (step, reward_mean, kl,
                                                 tokens_per_s, staleness_max, sync_s, ...)
    postrain_actor_up{actor}                     1 while the actor is running, else 0
    postrain_actor_state{actor, state}           1 for the actor's current state
    postrain_actor_restarts{actor}               restarts so far
    postrain_actor_heartbeat_age_seconds{actor}  seconds since its last heartbeat
    postrain_actor_queued{actor}                 work waiting at the actor (where its load reports it)
    postrain_actor_running{actor}                work running at the actor (where reported)
    postrain_actor_workers{actor}                a pool actor's workers (pools only)
    postrain_actor_load{actor, figure}           the inbox's counters (in_flight, served, rejected) and
                                                 each numeric figure of the actor's own

The actor families read the generic heartbeat load (`postrain.core.Load`), so the
exporter names no role.

The HTTP server runs on prometheus-client's own thread; `publish` hands it a
copy (one reference assignment), so a scrape never reads a dict the event
loop is changing.
"""
from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily

from postrain.core.errors import PostrainError

from .live import RunSnapshot, actor_loads

_INVALID_NAME_CHARS = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(figure: str) -> str:
    """`postrain_` + the figure name with anything Prometheus forbids turned into `_`."""
    return "postrain_" + _INVALID_NAME_CHARS.sub("_", figure)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _SnapshotCollector:
    def __init__(self):
        self.published: tuple[dict, dict | None, dict] = ({}, None, {})  # figures, status, loads

    def collect(self):
        figures, status, loads = self.published
        for name, value in sorted(figures.items()):
            if _is_number(value):
                family = GaugeMetricFamily(metric_name(name), f"driver figure {name}")
                family.add_metric([], float(value))
                yield family
        yield from self._actor_families((status or {}).get("actors", []), loads)

    @staticmethod
    def _actor_families(actors: list[dict], loads: dict):
        up = GaugeMetricFamily("postrain_actor_up", "1 while the actor is running", labels=["actor"])
        state = GaugeMetricFamily("postrain_actor_state", "1 for the actor's current state",
                                  labels=["actor", "state"])
        restarts = GaugeMetricFamily("postrain_actor_restarts", "restarts so far", labels=["actor"])
        age = GaugeMetricFamily("postrain_actor_heartbeat_age_seconds", "seconds since the last heartbeat",
                                labels=["actor"])
        work = {name: GaugeMetricFamily(f"postrain_actor_{name}", help_text, labels=["actor"])
                for name, help_text in (("queued", "work waiting at the actor"),
                                        ("running", "work running at the actor"),
                                        ("workers", "a pool actor's workers"))}
        load = GaugeMetricFamily("postrain_actor_load", "heartbeat load figures", labels=["actor", "figure"])
        for actor in actors:
            name = actor["name"]
            up.add_metric([name], 1.0 if actor["state"] == "running" else 0.0)
            state.add_metric([name, actor["state"]], 1.0)
            restarts.add_metric([name], float(actor.get("restarts", 0)))
            if actor.get("heartbeat_age_s") is not None:
                age.add_metric([name], float(actor["heartbeat_age_s"]))
            actor_load = loads.get(name)
            if actor_load is None:
                continue
            for field, family in work.items():
                if getattr(actor_load, field) is not None:
                    family.add_metric([name], float(getattr(actor_load, field)))
            counts = {"in_flight": actor_load.in_flight, "served": actor_load.served,
                      "rejected": actor_load.rejected}
            for figure, value in sorted({**actor_load.figures, **counts}.items()):
                if _is_number(value):
                    load.add_metric([name, figure], float(value))
        yield from (up, state, restarts, age, *work.values(), load)


class PrometheusExporter:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        self._collector = _SnapshotCollector()
        self.registry.register(self._collector)
        self._server = None
        self.url: str | None = None

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve /metrics on host:port (0 picks a free port); returns the URL."""
        try:
            self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise PostrainError(f"cannot serve metrics on {host}:{port} ({exc.strerror}); choose another "
                                "[head] metrics_port, or 0 for a free one") from None
        self.url = f"http://{host}:{self._server.server_port}/metrics"
        return self.url

    def publish(self, snapshot: RunSnapshot) -> None:
        self._collector.published = (dict(snapshot.figures), snapshot.status, actor_loads(snapshot.status))

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
