"""Safetensors files written tensor by tensor: the layout first, then each tensor's bytes as it comes.

    layout = {"model.embed_tokens.weight": (torch.float32, (264, 64)), ...}   # names in write order
    with StreamedSafetensors(folder, layout, metadata={"format": "pt"}, max_shard_bytes=5 * 2**30) as out:
        out.write({"model.embed_tokens.weight": tensor})     # any number of tensors per call, in order
    # folder/model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json

Design note. A safetensors file is an 8-byte header length, a JSON header naming every
tensor's dtype, shape and byte range, then the tensors' bytes. Every range follows from the
layout (names, dtypes and shapes, known before any value: a sharded model's global shapes, a
checkpoint's metadata), so each file's header is written when the file is opened and each
tensor's bytes are appended as it arrives: the writer holds nothing but the tensor in hand.
One file (`model.safetensors`) when the layout fits `max_shard_bytes`, else files of at most
that many bytes each (a larger tensor alone in its file) and the index `transformers` writes
for sharded checkpoints (`metadata.total_size`, `weight_map` name -> file). Invariants: the
tensors arrive in layout order with the layout's dtype and shape (else ValueError, naming the
tensor); `close` refuses a layout not written in full, so no file claims bytes it lacks.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import IO, Any

import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
               torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        DTYPE_NAMES[getattr(torch, _name)] = _code

Layout = dict[str, tuple[torch.dtype, tuple[int, ...]]]


def nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def plan_files(layout: Layout, max_shard_bytes: int) -> list[list[str]]:
    """The layout's names cut, in order, into files of at most max_shard_bytes each (a larger
    tensor alone); one file when all fit."""
    files: list[list[str]] = [[]]
    size = 0
    for name, (dtype, shape) in layout.items():
        n = nbytes(dtype, shape)
        if files[-1] and size + n > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += n
    return files


def file_names(count: int) -> list[str]:
    """transformers' names: model.safetensors alone, else model-0000i-of-0000n.safetensors."""
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def header_bytes(layout: Layout, names: list[str], metadata: dict[str, str] | None) -> bytes:
    """The length prefix and JSON header of a file holding `names` in order (padded to 8 bytes)."""
    header: dict[str, Any] = {}
    offset = 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name in names:
        dtype, shape = layout[name]
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name}: dtype {dtype} has no safetensors name")
        end = offset + nbytes(dtype, shape)
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


class StreamedSafetensors:
    """Writes `layout` into `folder` (module docstring). Use as a context manager or call close()."""

    def __init__(self, folder: str | Path, layout: Layout, metadata: dict[str, str] | None = None,
                 max_shard_bytes: int = 5 * 2**30):
        self.folder, self.layout, self.metadata = Path(folder), dict(layout), metadata
        self.files = plan_files(self.layout, max_shard_bytes)
        self.names = file_names(len(self.files))
        self._order = [name for names in self.files for name in names]
        self._file_of = {name: i for i, names in enumerate(self.files) for name in names}
        self._next = 0              # index in _order of the next tensor expected
        self._handle: IO[bytes] | None   # the open file of _open_index, if any
        self._open_index, self._handle = -1, None
        self.bytes_written = 0

    def __enter__(self) -> "StreamedSafetensors":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self.close()
        elif self._handle is not None:
            self._handle.close()

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        """Append `tensors` (the next names of the layout, in its order)."""
        for name, tensor in tensors.items():
            if self._next >= len(self._order) or self._order[self._next] != name:
                expected = self._order[self._next] if self._next < len(self._order) else "none (all written)"
                raise ValueError(f"tensor {name} arrived out of layout order; expected {expected}")
            dtype, shape = self.layout[name]
            if tensor.dtype != dtype or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"tensor {name} is {tensor.dtype} {tuple(tensor.shape)}; the layout says "
                                 f"{dtype} {tuple(shape)}")
            self._handle_for(self._file_of[name]).write(_buffer(tensor))
            self.bytes_written += nbytes(dtype, shape)
            self._next += 1

    def _handle_for(self, index: int):
        if index != self._open_index:
            if self._handle is not None:
                self._handle.close()
            self._handle = open(self.folder / self.names[index], "wb")
            self._handle.write(header_bytes(self.layout, self.files[index], self.metadata))
            self._open_index = index
        return self._handle

    def close(self) -> None:
        """Finish the last file and, with several files, write the index."""
        if self._next != len(self._order):
            if self._handle is not None:
                self._handle.close()
            raise ValueError(f"{len(self._order) - self._next} tensor(s) of the layout were never written, "
                             f"the first {self._order[self._next]}")
        if self._handle is None and self._order:
            raise ValueError("no tensor was written")
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        if len(self.files) > 1:
            total = sum(nbytes(*self.layout[n]) for n in self._order)
            weight_map = {name: self.names[self._file_of[name]] for name in self._order}
            index = {"metadata": {"total_size": total, **(self.metadata or {})}, "weight_map": weight_map}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _buffer(tensor: torch.Tensor):
    """The tensor's bytes as a buffer (a view: no copy of a contiguous CPU tensor)."""
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().data if t.numel() else b""
