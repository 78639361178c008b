"""The head's eyes on a run: one snapshot feeding the view, the Prometheus endpoint and queue rows.

`postrain up` makes one `RunMonitor`. The driver's stream hands it progress
lines (`line`) and figures (`figures`); its `watch` task refreshes the
supervisor's status every `tick_s`, redraws the view, republishes the
exporter's snapshot and, every `queue_row_interval_s`, appends a `queue` row
(each actor's queued and running work, as its heartbeat load reports them:
`NAME_queued`, `NAME_running`) to metrics.jsonl, so that `postrain plot` can
draw queue depths over time.

    with RunMonitor(folder, config, quiet=False).start() as monitor:   # the exporter: monitor.metrics_url
        monitor.attach(supervisor)
        tg.start_soon(monitor.watch)
        with monitor.view:                # the live frame, while the driver runs
            monitor.line("step 1/10: ..."); monitor.figures({"step": 1, ...})
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import IO

import anyio

from postrain.core.config import RunConfig
from postrain.core.metrics import MetricsWriter

from .exporter import PrometheusExporter
from .live import RunSnapshot, make_view, queue_depths


class RunMonitor:
    def __init__(self, folder: Path, config: RunConfig, *, quiet: bool = False,
                 stream: IO[str] | None = None, tick_s: float = 1.0, queue_row_interval_s: float = 2.0):
        self.supervisor = None  # set by attach(); status refreshes need it
        self.folder = Path(folder)
        self.snapshot = RunSnapshot(run_name=config.run.name)
        self.view = make_view(quiet, stream)
        self.tick_s = tick_s
        self.queue_row_interval_s = queue_row_interval_s
        self._metrics_port = config.head.metrics_port
        self._metrics_host = config.head.metrics_host
        self.exporter: PrometheusExporter | None = None
        self.metrics_url: str | None = None
        self._queue_rows: MetricsWriter | None = None

    def start(self) -> "RunMonitor":
        """Start the Prometheus endpoint (unless metrics_port = -1); raises PostrainError when its
        port is taken. Call before any actor starts, so that the error comes first."""
        if self._metrics_port >= 0:
            self.exporter = PrometheusExporter()
            self.metrics_url = self.exporter.start(self._metrics_host, self._metrics_port)
        return self

    def attach(self, supervisor) -> None:
        """The supervisor whose status the monitor shows (the head opens it after `start`)."""
        self.supervisor = supervisor

    def __enter__(self) -> "RunMonitor":
        return self

    def __exit__(self, *exc) -> None:
        """Stop the endpoint and close the queue rows' file."""
        if self.exporter is not None:
            self.exporter.stop()
        if self._queue_rows is not None:
            self._queue_rows.close()

    # -- what the driver sends ---------------------------------------------------------

    def line(self, text: str) -> None:
        self.snapshot.last_line = text
        self.view.line(text, self.snapshot)

    def figures(self, figures: dict) -> None:
        self.snapshot.add_figures(figures)
        self._publish()

    # -- the periodic refresh -------------------------------------------------------------

    async def watch(self) -> None:
        """Refresh status, view and exporter every tick until cancelled (cancel-safe: each tick
        is synchronous; a queue row is either written whole or not at all)."""
        last_row = 0.0
        while True:
            self.refresh()
            now = time.monotonic()
            if now - last_row >= self.queue_row_interval_s:
                self.write_queue_row()
                last_row = now
            await anyio.sleep(self.tick_s)

    def refresh(self) -> None:
        if self.supervisor is not None:
            self.snapshot.status = self.supervisor.status()
        self._publish()

    def write_queue_row(self) -> dict | None:
        """Append the depths the actors report now; nothing when none reports any."""
        depths = queue_depths(self.snapshot)
        if not depths:
            return None
        if self._queue_rows is None:
            self._queue_rows = MetricsWriter(self.folder, tensorboard=False, skip_rows_when_full=True)
        return self._queue_rows.log("queue", **depths)

    def _publish(self) -> None:
        self.view.refresh(self.snapshot)
        if self.exporter is not None:
            self.exporter.publish(self.snapshot)
