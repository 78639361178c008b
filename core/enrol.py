"""How a node agent gets the run's secrets without Ray seeing them: a sealed box per agent.

Ray carries every argument of its calls in its task specs over its own gRPC (plain text unless
Ray's TLS is on) and keeps them in its control store, so the run's keys must never be one. A node
agent makes an X25519 key pair when it starts and gives Ray only the public half; the head seals
the run's keys to it (an ephemeral X25519 key, HKDF-SHA256, AES-256-GCM, bound to the agent's node
name and the run) and hands the agent the sealed box. What Ray sees, public keys and ciphertext,
opens nothing.

    opener = EnrolmentKey()                                   # on the agent
    box = seal_for(opener.public, secrets, context)           # on the head (secrets: bytes)
    secrets = opener.open(box, context)                       # EnrolmentError if tampered or not ours

Holds against a reader of Ray's traffic and store; not against one who can also run code on
the cluster through Ray (Ray has no authentication of its own): run a cluster on a private
network (docs/security.md).
"""
from __future__ import annotations

import os
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from .errors import PostrainError

_INFO = b"postrain enrolment v1"
_RAW: dict[str, Any] = dict(encoding=serialization.Encoding.Raw, format=serialization.PublicFormat.Raw)


class EnrolmentError(PostrainError):
    """A sealed box that does not open: tampered, sealed for another agent or another run."""


def _box_key(private: X25519PrivateKey, peer_public: bytes, context: bytes) -> bytes:
    shared = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO + b"|" + context).derive(shared)


class EnrolmentKey:
    """The agent's side: a fresh X25519 key pair, its secret half never leaving this object."""

    def __init__(self) -> None:
        self._private = X25519PrivateKey.generate()
        self.public: bytes = self._private.public_key().public_bytes(**_RAW)

    def open(self, box: dict[str, bytes], context: bytes) -> bytes:
        """The secrets `seal_for` sealed to this key under `context`; EnrolmentError otherwise."""
        try:
            key = _box_key(self._private, box["ephemeral"], context)
            return AESGCM(key).decrypt(box["nonce"], box["ciphertext"], context)
        except (InvalidTag, KeyError, TypeError, ValueError) as exc:
            raise EnrolmentError(f"the run's sealed keys did not open ({type(exc).__name__}): sealed for "
                                 "another agent or run, or changed on the way") from None


def seal_for(public: bytes, secrets: bytes, context: bytes) -> dict[str, bytes]:
    """A box of `secrets` that only the holder of `public`'s private half opens, under `context`."""
    ephemeral = X25519PrivateKey.generate()
    nonce = os.urandom(12)
    ciphertext = AESGCM(_box_key(ephemeral, public, context)).encrypt(nonce, secrets, context)
    return {"ephemeral": ephemeral.public_key().public_bytes(**_RAW), "nonce": nonce, "ciphertext": ciphertext}
