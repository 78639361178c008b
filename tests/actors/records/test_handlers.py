"""Every handler of every role is typed: the kernel decodes its body into a declared record and
encodes the record it returns (`@handler(KIND)`, KIND a MessageKind declared once; core/typed.py).

The walk imports every module under postrain.actors, finds each Actor subclass defined there and
reads what its handlers declared on the decorator; one case per actor class, failing with the
list of its untyped handlers. The declaration cannot be bypassed: the kernel wraps the method, so
a typed handler only ever sees the record and may only return one (the last tests here)."""
from __future__ import annotations

import importlib
import pkgutil

import pytest

import postrain.actors
from postrain.actors.records import LOAD_WEIGHTS, RecordError, WeightsChannel, WeightSync, WeightSyncReply
from postrain.core.record import Record
from postrain.core import Actor, MessageKind, handler
from postrain.core.testing import async_test
from postrain.core.messages import UNTYPED


def _actor_classes() -> list[type[Actor]]:
    """Every Actor subclass defined in a module under postrain.actors (optional extras that are
    not installed are skipped: their module cannot import)."""
    for info in pkgutil.walk_packages(postrain.actors.__path__, "postrain.actors."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").startswith("postrain"):
                raise
    found, todo = set(), [Actor]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("postrain.actors."):
                found.add(sub)
    return sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")


ACTORS = _actor_classes()


def _is_record_class(cls) -> bool:
    """A role's record (actors/records) or a kernel protocol's (core, such as ResizeRequest)."""
    return isinstance(cls, type) and (issubclass(cls, Record) or cls.__module__.startswith("postrain.core."))


def test_the_walk_finds_every_role():
    names = {cls.__name__ for cls in ACTORS}
    assert {"SandboxActor", "EnvironmentActor", "GeneratorActor", "WeightReceiverActor",
            "LearnerActor", "OrchestratorActor"} <= names, names


@pytest.mark.parametrize("cls", ACTORS, ids=lambda cls: cls.__name__)
def test_every_handler_decodes_its_body_and_replies_with_a_record(cls):
    untyped = []
    for kind, (attr, _stream, _concurrent) in sorted(cls._handler_specs.items()):
        request, reply = getattr(getattr(cls, attr), "_postrain_types", (UNTYPED, UNTYPED))
        problems = [f"{what}={value!r}" for what, value in (("request", request), ("reply", reply))
                    if value is UNTYPED or not (value is None or _is_record_class(value))]
        if problems:
            untyped.append(f"{kind} ({', '.join(problems)})")
    assert not untyped, (f"{cls.__module__}.{cls.__name__}: handlers not typed with records: {untyped}; "
                         "fix: declare X = MessageKind(name, XRequest, XReply) beside the records (request=None: no "
                         "body) and use @handler(X)")


BAD_REPLY = MessageKind("bad_reply", None, WeightsChannel)
ITEMS = MessageKind("items", None, WeightsChannel, stream=True)


class _Typed(Actor):
    @handler(LOAD_WEIGHTS)
    async def load_weights(self, sync):
        self.seen = sync
        return WeightSyncReply(version=sync.version)

    @handler(BAD_REPLY)
    async def bad_reply(self, body):
        return {"address": "tcp://x"}   # a wire dict, not the record

    @handler(ITEMS)
    async def items(self, body):
        yield WeightsChannel("a")
        yield WeightsChannel("b")


@async_test
async def test_the_kernel_decodes_bodies_and_encodes_replies_of_typed_handlers():
    actor = _Typed.__new__(_Typed)
    assert await actor.load_weights({"version": 3, "weights": {}}) == {"version": 3}
    assert actor.seen == WeightSync(3, {})
    with pytest.raises(RecordError, match=r"WeightSync has no field\(s\) \['versoin'\]"):
        await actor.load_weights({"versoin": 3, "weights": {}})
    with pytest.raises(TypeError, match="must return a WeightsChannel"):
        await actor.bad_reply(None)
    with pytest.raises(TypeError, match="takes no body"):
        await actor.bad_reply({"x": 1})
    assert [item async for item in actor.items({})] == [{"address": "a"}, {"address": "b"}]


def test_a_message_kind_must_name_records_with_their_codec():
    with pytest.raises(TypeError, match="request= must be a class with from_wire"):
        MessageKind("x", request=dict, reply=None)
