"""One Curve identity per actor (issue 32): each actor holds its own key pair and only the secrets
its role needs; a receiver knows who calls by the caller's key and refuses a message whose declared
sender is not that key's actor; a run's actors still talk to each other."""
from __future__ import annotations

import pytest
import trio

from postrain.core import ActorSpec, AuthenticationError, CurveKeys, RemoteError, Supervisor
from postrain.core.identity import (CONTROL, Identities, KeyTable, actor_keypair, actor_server_keypair, keys_for_actor,
                                    may_send_as, server_key_of)
from postrain.core.node import Node
from postrain.core.sealed import SealedReceiver
from postrain.core.testing import async_test

ECHO = "postrain.core.testing:EchoActor"


def spec(name, cls=ECHO, **kw):
    return ActorSpec(name=name, cls=cls, cpus=0.25, memory_mb=0, bind="tcp://127.0.0.1:0", **kw)


def test_each_actor_gets_its_own_pair_and_the_bulk_key_only_when_its_role_needs_it():
    run = CurveKeys.generate()
    learner = keys_for_actor(run, "learner", bulk_key=True)
    sandbox = keys_for_actor(run, "sandbox", bulk_key=False)
    assert learner.client_public != sandbox.client_public != run.client_public
    assert keys_for_actor(run, "sandbox", bulk_key=False) == sandbox          # restarts: the same pair
    assert (sandbox.client_public, sandbox.client_secret) == actor_keypair(run.identity_seed, "sandbox")
    assert learner.bulk_key == run.bulk_key and sandbox.bulk_key == b""
    assert not learner.identity_seed and not sandbox.identity_seed           # the seed stays with supervisors
    assert sandbox.allowed_client_keys == (run.client_public,)
    assert CurveKeys.from_dict(sandbox.to_dict()) == sandbox
    assert "secret" not in repr(sandbox).replace("server_public", "")


def test_each_actor_serves_with_its_own_server_pair_and_never_holds_the_runs():
    """An actor's keys cannot serve as the head, the node agents or another actor: its inbox's
    pair is its own (derived from the seed), and callers learn its public half from the head."""
    run = CurveKeys.generate()
    learner = keys_for_actor(run, "learner", bulk_key=True)
    sandbox = keys_for_actor(run, "sandbox", bulk_key=False)
    held = {learner.server_secret, sandbox.server_secret}
    assert run.server_secret not in held and len(held) == 2
    assert (sandbox.server_public, sandbox.server_secret) == actor_server_keypair(run.identity_seed, "sandbox")
    assert sandbox.server_public != sandbox.client_public       # not the client pair under another name
    assert sandbox.control_server_key == run.server_public == run.control_server_key   # to reach its head
    assert server_key_of(run, "sandbox") == sandbox.server_public
    assert keys_for_actor(run, "sandbox", bulk_key=False).server_secret == sandbox.server_secret   # restarts
    by_hand = CurveKeys(run.server_public, run.server_secret, run.client_public, run.client_secret)
    assert server_key_of(by_hand, "sandbox") == run.server_public and server_key_of(None, "sandbox") is None


def test_a_sandbox_actors_keys_cannot_open_a_weight_stream():
    sandbox = keys_for_actor(CurveKeys.generate(), "sandbox", bulk_key=False)
    with pytest.raises(ValueError, match="needs the run's 32-byte key"):
        SealedReceiver(sandbox.bulk_key, "127.0.0.1")


@async_test
async def test_identities_name_keys_through_whois_and_trust_the_control_key():
    run = CurveKeys.generate()
    table = KeyTable(run)
    asked = []

    async def whois(public):
        asked.append(public)
        return table.name_of(public, ["learner", "sandbox"])
    identities = Identities([run.client_public], whois)
    assert await identities.name_of(run.client_public) == CONTROL
    sandbox_public = actor_keypair(run.identity_seed, "sandbox")[0]
    assert await identities.name_of(sandbox_public) == "sandbox"
    assert await identities.name_of(sandbox_public) == "sandbox" and len(asked) == 1   # kept
    assert await identities.name_of(CurveKeys.generate().client_public) is None         # a stranger
    assert may_send_as("sandbox", "sandbox") and may_send_as(CONTROL, "learner") and may_send_as(None, "x")
    assert not may_send_as("sandbox", "learner") and not may_send_as("", "")


@async_test
async def test_actors_know_each_other_by_key_and_refuse_a_forged_sender():
    run = CurveKeys.generate()
    async with Supervisor.open(keys=run, bind="tcp://127.0.0.1:0") as sup:
        learner = await sup.start(spec("learner", bulk_key=True))
        await sup.start(spec("sandbox"))
        held = await learner.ask("whoami", timeout_s=10)
        assert held["identity"] == "learner" and held["bulk_key"] and not held["seed"]
        assert held["server_public"] == actor_server_keypair(run.identity_seed, "learner")[0].decode()
        assert held["client_public"] == actor_keypair(run.identity_seed, "learner")[0].decode()
        assert held["caller"] == "head"                          # the control key may name itself
        # a normal call between actors: the callee learns the caller's name from its key
        seen = await learner.ask("ask_peer", {"name": "sandbox"}, timeout_s=20)
        assert seen["caller"] == "learner" and seen["identity"] == "sandbox" and not seen["bulk_key"]
        # the sandbox's key, declaring itself the learner: refused
        sandbox_keys = keys_for_actor(run, "sandbox", bulk_key=False)
        async with Node("learner", sandbox_keys) as forger:
            with pytest.raises(RemoteError, match="SenderMismatch.*declares sender 'learner'.*'sandbox'"):
                await forger.ref(learner.address, "learner", server_key=server_key_of(run, "learner")).ask(
                    "whoami", timeout_s=10)
        async with Node("sandbox", sandbox_keys) as honest:
            to_learner = honest.ref(learner.address, "learner", server_key=server_key_of(run, "learner"))
            assert (await to_learner.ask("whoami", timeout_s=10))["caller"] == "sandbox"
        # a key of another run's seed is no one's here
        stranger = keys_for_actor(CurveKeys.generate(), "learner", bulk_key=False)
        stranger = CurveKeys(run.server_public, b"", stranger.client_public, stranger.client_secret)
        async with Node("learner", stranger) as node:
            with pytest.raises(AuthenticationError):
                await node.ref(learner.address, "learner", server_key=server_key_of(run, "learner")).ask(
                    "whoami", timeout_s=10)


@async_test
async def test_an_actor_cannot_send_the_kernels_messages_or_speak_for_another_actor_to_the_head():
    """PEERS_MOVED would point the learner's callers at an address of the sender's choosing, a
    READY naming another actor would change its registered address, `shutdown` would end the run:
    from an actor's key, all are refused; the head's own control key may still send them."""
    from postrain.core.control import PEERS_MOVED, MovedPeer, PeersMoved
    run = CurveKeys.generate()
    async with Supervisor.open(keys=run, bind="tcp://127.0.0.1:0") as sup:
        learner = await sup.start(spec("learner"))
        address = sup.records["learner"].address
        sup.expect(["sandbox"])        # a sandbox actor of this run (its process is not needed here)
        async with Node("sandbox", keys_for_actor(run, "sandbox", bulk_key=False)) as sandbox:
            to_learner = sandbox.ref(learner.address, "learner", server_key=server_key_of(run, "learner"))
            to_head = sandbox.ref(sup.address, "head")
            with pytest.raises(RemoteError, match="SenderMismatch.*only the run's supervisors"):
                await to_learner.call(PEERS_MOVED, PeersMoved({"x": MovedPeer("tcp://127.0.0.1:1", same_node=False)}))
            with pytest.raises(RemoteError, match="SenderMismatch.*only the run's supervisors"):
                await to_head.ask("shutdown")
            with pytest.raises(RemoteError, match="SenderMismatch.*this actor's role may not send it"):
                await to_head.ask("work", {"actor": "learner", "busy": False})   # would move cores
            incarnation = sup.records["learner"].incarnation
            await to_head.ask("_ready", {"name": "learner", "pid": 1, "address": "tcp://127.0.0.1:9",
                                         "incarnation": incarnation})
        assert sup.records["learner"].address == address and not sup.shutdown_requested.is_set()
        assert await learner.call(PEERS_MOVED, PeersMoved()) is None     # the supervisor's key: served


@async_test
async def test_only_an_actor_that_hands_out_work_may_tell_the_head_who_works():
    """The head's `work` message moves elastic cores: served for an actor whose class drives work
    (the orchestrator's) and for the control key, refused for any other actor's key."""
    run = CurveKeys.generate()
    async with Supervisor.open(keys=run, bind="tcp://127.0.0.1:0") as sup:
        await sup.start(spec("driver", cls="postrain.core.testing:WorkDriverEchoActor"))
        await sup.start(spec("sandbox"))
        request = {"actor": "sandbox", "busy": True}
        async with Node("driver", keys_for_actor(run, "driver", bulk_key=False)) as driver:
            assert (await driver.ref(sup.address, "head").ask("work", request, timeout_s=10))["elastic"] is False
        async with Node("sandbox", keys_for_actor(run, "sandbox", bulk_key=False)) as sandbox:
            with pytest.raises(RemoteError, match="SenderMismatch.*this actor's role may not send it"):
                await sandbox.ref(sup.address, "head").ask("work", request, timeout_s=10)
    from postrain.core.supervisor import _class_says
    assert _class_says(ActorSpec(name="o", cls="postrain.actors.orchestrator:OrchestratorActor"), "drives_work")


def test_the_bulk_key_follows_the_class_unless_the_entry_says_otherwise():
    from postrain.core import parse_config, resolve_options
    run = parse_config({"actors": [
        {"name": "learner", "cls": "postrain.actors.weights:WeightReceiverActor"},
        {"name": "sandbox", "cls": ECHO},
        {"name": "told", "cls": ECHO, "bulk_key": True}]})
    resolve_options(run)
    assert [spec.bulk_key for spec in run.actors] == [True, False, True]


@async_test
async def test_an_actors_keys_cannot_answer_for_another_actor():
    """The sandbox's keys serving at an address a caller takes for the learner's (a hijacked
    port, a forged PEERS_MOVED): the caller, expecting the learner's server key, never talks to it."""
    from postrain.core.inbox import Handler, Inbox
    run = CurveKeys.generate()
    served = []

    async def whoami(body):
        served.append(body)
        return "the sandbox"
    async with Node("sandbox", keys_for_actor(run, "sandbox", bulk_key=False)) as impostor:
        inbox = Inbox(impostor, "tcp://127.0.0.1:0", {"whoami": Handler(whoami)})
        impostor.spawn(inbox.serve)
        async with Node("head", run) as head:
            as_learner = head.ref(inbox.bound_address, "learner", server_key=server_key_of(run, "learner"))
            with pytest.raises(AuthenticationError):
                await as_learner.ask("whoami", timeout_s=30)
            as_sandbox = head.ref(inbox.bound_address, "sandbox", server_key=server_key_of(run, "sandbox"))
            assert await as_sandbox.ask("whoami", timeout_s=30) == "the sandbox"
    assert served == [None]          # the handler ran for the caller that expected the sandbox only


@async_test
async def test_nodes_opened_one_after_another_in_a_process_each_serve_authentication():
    """The ZAP endpoint is one per process (its zmq context): a node that closes frees it at once,
    so the next one binds it (close alone frees it later, on libzmq's reaper thread)."""
    keys = CurveKeys.generate()
    for _ in range(300):
        async with Node("head", keys) as node:
            node.ensure_zap(keys.allowed_client_keys)
            await trio.sleep(0)
