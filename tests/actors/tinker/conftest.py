"""Fixtures of the Tinker server's tests: the tiny base model, loaded once, and a served server."""
import pytest

from postrain.actors.tinker import BaseModels, TinkerOptions
from tinker_server import tinker_served


@pytest.fixture(scope="module")
def tiny_bases():
    return BaseModels.load(["tiny"], seed=0)


@pytest.fixture(scope="module")
def served(tiny_bases):
    """(base URL, TinkerService) of a server holding `tiny`, keyed with tinker_server.API_KEY."""
    with tinker_served(tiny_bases, TinkerOptions(seq_gap_timeout_s=1.0, poll_wait_s=2.0)) as out:
        yield out
