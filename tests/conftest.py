"""Shared test settings."""
import logging

import pytest


@pytest.fixture(autouse=True)
def _quiet_logs():
    logging.getLogger("postrain.core").setLevel(logging.ERROR)
    yield
