"""The sealed box that carries a run's keys to a node agent through Ray (core/enrol.py): it opens
for its agent under its context only, and any change to it is refused."""
import pytest

pytest.importorskip("cryptography")

from postrain.core.enrol import EnrolmentError, EnrolmentKey, seal_for  # noqa: E402

SECRETS = b"server-secret|client-secret|bulk-key"


def test_a_box_opens_for_its_agent_and_context_and_shows_nothing_of_the_secrets():
    agent = EnrolmentKey()
    box = seal_for(agent.public, SECRETS, b"node=a|run=r1")
    assert agent.open(box, b"node=a|run=r1") == SECRETS
    assert all(b"secret" not in value and b"bulk" not in value for value in box.values())
    assert seal_for(agent.public, SECRETS, b"node=a|run=r1")["ciphertext"] != box["ciphertext"], "fresh each time"


@pytest.mark.parametrize("change", ["another agent", "another node", "another run", "a flipped bit", "no nonce"])
def test_a_box_for_another_agent_node_or_run_or_changed_on_the_way_does_not_open(change):
    agent = EnrolmentKey()
    box = seal_for(agent.public, SECRETS, b"node=a|run=r1")
    opener, context = agent, b"node=a|run=r1"
    if change == "another agent":
        opener = EnrolmentKey()
    elif change == "another node":
        context = b"node=b|run=r1"
    elif change == "another run":
        context = b"node=a|run=r2"
    elif change == "a flipped bit":
        box = {**box, "ciphertext": bytes([box["ciphertext"][0] ^ 1]) + box["ciphertext"][1:]}
    else:
        box = {k: v for k, v in box.items() if k != "nonce"}
    with pytest.raises(EnrolmentError, match="did not open"):
        opener.open(box, context)
