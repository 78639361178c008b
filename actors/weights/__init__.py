"""postrain.actors.weights: the weight-sync protocol, both ends.

    messages.py           a state dict as `load_weights` messages: whole, chunks, sealed pieces; the digest
    sync_plan.py          SyncPlanner / PublishPlan: whole weights or a patch per target (the learner's side)
    publisher.py          WeightPublisher: one publish to many targets (lookup, bookkeeping, the report)
    transport.py          WeightTransport: the interface of every way a version reaches its targets
    message_transport.py  MessageTransport: one `load_weights` message per target (/dev/shm on one host)
    sealed_transport.py   SealedTransport: chunks sealed once, sent on each target's sealed channel
    transport_choice.py   weight_transport(): the one the learner's option names; ByHostTransport ("auto")
    patch.py              LoRA and delta patches: encoded by the publisher, applied by the receiver
    assembly.py           SyncAssembler (chunks -> one sync), SealedWeights (a receiver's sealed channel)
    receiver.py           WeightReceiver: the receiving end every receiving actor uses
    reference_actor.py    WeightReceiverActor: a receiver without an engine (tests, the bench)

The learner actor publishes through WeightPublisher; the generator and the reference receiver
receive through WeightReceiver; the digest both ends check is `weights_digest`.
"""
from .messages import sealed_sync, weight_chunks, weight_messages, weights_digest
from .patch import PatchRefused
from .publisher import WeightPublisher
from .receiver import WeightReceiver, model_weights
from .reference_actor import WeightReceiverActor
from .sync_plan import WEIGHT_SYNC_MODES, PublishPlan, SyncPlanner, WeightSyncMode
from .transport import Delivery, WeightTransport
from .transport_choice import WEIGHT_TRANSPORTS, WeightTransportChoice, weight_transport

__all__ = ["Delivery", "PatchRefused", "PublishPlan", "SyncPlanner", "WEIGHT_SYNC_MODES", "WEIGHT_TRANSPORTS",
           "WeightPublisher", "WeightReceiver", "WeightReceiverActor", "WeightSyncMode", "WeightTransport",
           "WeightTransportChoice", "model_weights", "sealed_sync", "weight_chunks", "weight_messages",
           "weight_transport", "weights_digest"]
