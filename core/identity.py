"""One Curve identity per actor: whose key a caller holds, and the keys each actor is given.

Design note. The run's keys (`CurveKeys.generate`, made by the head) carry an `identity_seed`
that only the control plane holds: the head, each node agent (sealed to it, core/enrol.py) and
nothing else. Actor NAME's client key pair is derived from it (`actor_keypair`: HMAC-SHA256 of
the seed and the name, used as a Curve25519 secret key), so every supervisor of a run gives an
actor, and its restarts, on whatever node, the same pair without any of them sending it
anywhere. An actor receives only its own pair (`keys_for_actor`), never the seed, and the bulk
key only where its spec says it needs it (`ActorSpec.bulk_key`, or the class's
`Actor.needs_bulk_key`): an actor without it cannot open a sealed weight stream.

A process's ZeroMQ authentication handler (core/node.py) asks `Identities.name_of` which
name a connecting client key belongs to: the run's control key (the head, the node agents,
`postrain status` and `down`: the operator) and any key the process was told to trust are
`CONTROL`; any other key is resolved by the process's supervisor (`whois`: a supervisor knows
the names of its actors, its peers' and those it was told to expect, `Supervisor.expect`, as a
cluster's agents are before each actor starts, and derives each one's public key). The answer
becomes the connection's ZAP User-Id, which every message on it carries, and an inbox refuses
a message whose declared sender is not that name (core/inbox.py), unless it is `CONTROL`.

Each actor's inbox serves with its own server pair too (`actor_server_keypair`, derived from
the seed under another label), so a caller knows it reached that actor and no other: an actor's
keys never hold the run's server secret (which only the head and the node agents serve with)
nor another actor's. A caller learns an actor's server key where it learns its address: the
head's `lookup` answers both (`server_key_of`); a supervisor derives it; a reference that moves
(PEERS_MOVED) keeps it, since an actor's name, and so its keys, never change within a run.

Invariant: `Identities.name_of(key)` never names a key that is not the derived key of that
name or a trusted key (tests/core/test_identity.py).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
from typing import Awaitable, Callable, Iterable

import zmq
from zmq.utils import z85

from .transport import CurveKeys

log = logging.getLogger("postrain.core")

CONTROL = "@control"   # the User-Id of a trusted key: it may declare any sender
_INFO = b"postrain actor identity v1\0"
_SERVER_INFO = b"postrain actor server v1\0"


def actor_keypair(seed: bytes, name: str) -> tuple[bytes, bytes]:
    """(public, secret), Z85, of actor `name`'s Curve identity under the run's `seed`."""
    if not seed:
        raise ValueError("deriving an actor's key pair needs the run's identity_seed (CurveKeys.generate())")
    secret = z85.encode(hmac.new(seed, _INFO + name.encode(), hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def actor_server_keypair(seed: bytes, name: str) -> tuple[bytes, bytes]:
    """(public, secret), Z85, that actor `name`'s inbox serves with under the run's `seed`."""
    if not seed:
        raise ValueError("deriving an actor's server key needs the run's identity_seed (CurveKeys.generate())")
    secret = z85.encode(hmac.new(seed, _SERVER_INFO + name.encode(), hashlib.sha256).digest())
    return zmq.curve_public(secret), secret


def server_key_of(keys: CurveKeys | None, name: str) -> bytes | None:
    """The server key actor `name`'s inbox presents, as the control plane (which holds the seed)
    derives it; the run's one server key where the keys have no seed (made by hand); None
    without keys."""
    if keys is None:
        return None
    if not keys.identity_seed:
        return keys.server_public
    return actor_server_keypair(keys.identity_seed, name)[0]


def keys_for_actor(keys: CurveKeys, name: str, *, bulk_key: bool) -> CurveKeys:
    """The keys actor `name` is started with: its own server pair (its inbox serves with it) and
    client pair, the control plane's server key (to reach its head), the control key as the one
    it trusts without asking, the bulk key only when `bulk_key`; never the seed, and never the
    run's server secret."""
    public, secret = actor_keypair(keys.identity_seed, name)
    server_public, server_secret = actor_server_keypair(keys.identity_seed, name)
    return dataclasses.replace(keys, server_public=server_public, server_secret=server_secret,
                               client_public=public, client_secret=secret,
                               allowed_client_keys=(keys.client_public,),
                               bulk_key=keys.bulk_key if bulk_key else b"", identity_seed=b"", identity=name,
                               control_server_public=keys.control_server_key)


def group_secret(seed: bytes, names: list[str]) -> bytes:
    """The secret the ranks of one collective group prove to each other at their rendezvous
    (actors/learner/rendezvous_store.py): derived from the run's seed and the group's names, so
    every supervisor of the run gives every rank, and its restarts, the same one."""
    return hmac.new(seed, b"postrain group secret v1\0" + "\0".join(names).encode(), hashlib.sha256).digest()


class KeyTable:
    """A supervisor's view: the public key of each name it knows, derived from the seed. Answers
    `whois` for its actors. Cheap: a name is derived once."""

    def __init__(self, keys: CurveKeys):
        self._seed = keys.identity_seed
        self._control = keys.client_public
        self._names: dict[bytes, str] = {}
        self._known: set[str] = set()

    def name_of(self, public: bytes, names: Iterable[str]) -> str | None:
        """The name among `names` (and those seen before) whose derived key is `public`;
        CONTROL for the run's control key; None otherwise."""
        if public == self._control:
            return CONTROL
        if not self._seed:
            return None
        for name in names:
            if name not in self._known:
                self._known.add(name)
                self._names[actor_keypair(self._seed, name)[0]] = name
        return self._names.get(public)


class Identities:
    """Who holds a client key, as one process's authentication handler sees it.

    trusted: Z85 keys answered CONTROL (the run's control key, keys a caller was told to allow);
    whois(key) -> name | None: asks the process's supervisor (awaitable), or None: only trusted
    keys are let in. A name once found is kept (a key's name never changes within a run)."""

    def __init__(self, trusted: Iterable[bytes], whois: Callable[[bytes], Awaitable[str | None]] | None = None):
        self.trusted = frozenset(trusted)
        self._whois = whois
        self._names: dict[bytes, str] = {}

    async def name_of(self, public: bytes) -> str | None:
        """The name `public` (Z85) authenticates as, CONTROL, or None (refuse). A whois that
        fails counts as None (logged): the client's handshake fails and it retries."""
        if public in self.trusted:
            return CONTROL
        name = self._names.get(public)
        if name is None and self._whois is not None:
            try:
                name = await self._whois(public)
            except Exception as exc:
                log.warning("could not ask the supervisor whose key %s is: %s", public[:8].decode(), exc)
                return None
            if name:
                self._names[public] = name
        return name


def may_send_as(authenticated: str | None, declared: str) -> bool:
    """Whether a message declaring `declared` as its sender may be served on a connection
    authenticated as `authenticated` (None: the socket does not authenticate callers)."""
    if authenticated is None:
        return True
    return bool(authenticated) and (authenticated == CONTROL or authenticated == declared)
