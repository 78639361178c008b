"""core/gate.py's rate-limited log (the connection caps are tested on the sealed channel, in
tests/core/test_sealed.py): one line per key per interval, the next one counting the rest."""
from __future__ import annotations

import logging

from postrain.core.gate import RateLimitedLog


def test_one_line_per_key_and_interval_and_the_next_counts_what_was_not_logged(caplog):
    now = [100.0]
    limiter = RateLimitedLog(logging.getLogger("postrain.core"), 10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="postrain.core"):
        for _ in range(5):
            limiter.warning("10.0.0.3", "junk from %s", "10.0.0.3")
        limiter.warning("10.0.0.4", "junk from %s", "10.0.0.4")     # another peer: its own line
        now[0] += 10.0
        limiter.warning("10.0.0.3", "junk from %s", "10.0.0.3")
    assert [r.getMessage() for r in caplog.records] == [
        "junk from 10.0.0.3", "junk from 10.0.0.4",
        "junk from 10.0.0.3 (and 4 more like it from there in the last 10 s, not logged)"]
