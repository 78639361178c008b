"""Which torch device a role computes on: the one rule for the learner and the generator.

    device = resolve_device("auto")     # cuda:0 where a GPU is visible, else cpu
    device = resolve_device("cuda")     # DeviceError (with the fix) where none is visible

The scheduler decides what a process may see: an actor spec with `gpus = N` gets
`CUDA_VISIBLE_DEVICES` set to the N GPU ids it was placed on, and a spec with `gpus = 0`
gets it set empty, so "auto" in such an actor is the CPU even on a GPU machine. Inside
the process the visible GPUs are renumbered from 0, so "cuda" means the first one placed.
"""
from __future__ import annotations

import os

import torch

from postrain.core.errors import PostrainError

DEVICE_CHOICES = "'auto', 'cpu', 'cuda' or 'cuda:N'"


class DeviceError(PostrainError, ValueError):
    """A device was asked for that this process cannot use; the message says how to fix it."""


def resolve_device(requested: str) -> torch.device:
    """The torch.device for a role's `device` option ("auto", "cpu", "cuda", "cuda:N")."""
    text = str(requested).strip().lower()
    if text == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise DeviceError(f"device must be {DEVICE_CHOICES}, got {requested!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DeviceError(f"device must be {DEVICE_CHOICES}, got {requested!r}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not torch.cuda.is_available():
        where = ("torch here is a CPU build" if torch.version.cuda is None else
                 f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "no GPU was found")
        raise DeviceError(f"device {requested!r} asked for, but this process sees no CUDA GPU ({where}); "
                          "fix: give the actor's spec gpus = 1 (the scheduler then places it on a GPU), "
                          "or set device = 'auto' or 'cpu'")
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise DeviceError(f"device {requested!r} asked for, but this process sees "
                          f"{torch.cuda.device_count()} GPU(s) (numbered from 0 inside the process); "
                          "fix: ask for 'cuda' or give the actor's spec more gpus")
    return torch.device("cuda", index)
