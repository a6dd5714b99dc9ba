"""The trace file format, version 1: constants, errors, file names and the record header shared by
:mod:`.writer` and :mod:`.reader` (spec with examples: ``docs/traces.md``, "File format").

A trace holds the exact ``[R, E]`` load the planner saw, for every iteration, microbatch and MoE
layer of a run, one append-only file per EP group. File layout (all integers little-endian):

* line 1: the magic ``ULTRAEP-TRACE`` and a newline;
* line 2: a one-line JSON header (``format``, ``version``, ``num_ranks``, ``num_experts``, ``meta``...);
* then records, each a 32-byte header ``<4s i q i B B H I I`` = tag, microbatch, iteration, layer,
  dtype code, codec, reserved, payload bytes, CRC-32 (of the first 28 header bytes and the payload),
  followed by the payload. Tags: ``LOAD`` (payload: the load matrix, row-major, stored in the
  smallest unsigned width that fits, optionally zlib-compressed), ``ITER`` (commit of an iteration;
  ``microbatch`` holds its LOAD count) and ``CLOS`` (clean close).

A reader returns only committed iterations by default, so a crash loses at most the iteration in
flight; a torn tail is reported as truncation, distinct from a foreign or corrupt file.
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Sequence

import numpy as np
import torch

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "TRACE_SUFFIX",
    "TraceError",
    "TraceFormatError",
    "TraceHeader",
    "TraceRecord",
    "TraceTruncatedError",
    "TraceTruncatedWarning",
    "find_trace_files",
    "trace_path",
]

FORMAT_NAME = "ultraep-trace"
FORMAT_VERSION = 1
TRACE_SUFFIX = ".uetrace"
MAGIC = b"ULTRAEP-TRACE\n"
MAX_HEADER_BYTES = 1 << 20

RECORD = struct.Struct("<4siqiBBHII")  # 32 bytes; see the module docstring
assert RECORD.size == 32
TAG_LOAD, TAG_ITER, TAG_CLOSE = b"LOAD", b"ITER", b"CLOS"
CODEC_RAW, CODEC_ZLIB = 0, 1
# dtype code = bytes per element; stored unsigned (loads are counts), little-endian.
DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
MAX_PAYLOAD = (1 << 32) - 1


class TraceError(ValueError):
    """Base class of trace reading errors."""


class TraceFormatError(TraceError):
    """Not a trace (foreign file), a newer format version, or a corrupt record."""


class TraceTruncatedError(TraceError):
    """The file ends inside a record (a crash or a writer still running): raised with ``on_truncated="error"``."""


class TraceTruncatedWarning(UserWarning):
    """The file ends inside a record; the complete records before the tear were read."""


def trace_path(trace_dir: str | os.PathLike, ep_group: int) -> Path:
    """``<trace_dir>/ep_group_<ep_group:04d>.uetrace`` (the directory is created)."""
    if not isinstance(ep_group, int) or ep_group < 0:
        raise ValueError(f"ep_group must be an int >= 0, got {ep_group!r}")
    directory = Path(trace_dir)
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"ep_group_{ep_group:04d}{TRACE_SUFFIX}"


def find_trace_files(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """Trace files named by ``paths``: a file as is, a directory as its ``*.uetrace`` files (sorted)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files = sorted(p.glob(f"*{TRACE_SUFFIX}"))
            if not files:
                raise ValueError(f"no *{TRACE_SUFFIX} files in directory {p}")
            found.extend(files)
        elif p.exists():
            found.append(p)
        else:
            raise ValueError(f"trace path does not exist: {p}")
    return found


def pack_record(
    tag: bytes,
    iteration: int,
    microbatch: int,
    layer: int,
    dtype_code: int,
    codec: int,
    payload: bytes,
) -> bytes:
    """One record: its 32-byte header (CRC filled in) and ``payload``."""
    head = RECORD.pack(tag, microbatch, iteration, layer, dtype_code, codec, 0, len(payload), 0)
    crc = zlib.crc32(payload, zlib.crc32(head[:28]))
    return head[:28] + struct.pack("<I", crc) + payload


def check_int(name: str, value, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]`` (a ValueError naming ``name`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must lie in [{lo}, {hi}], got {value}")
    return int(value)


@dataclass(frozen=True)
class TraceHeader:
    """The JSON header of a trace file."""

    version: int
    num_ranks: int
    num_experts: int
    meta: dict
    raw: dict = field(repr=False)

    @classmethod
    def from_dict(cls, raw: dict) -> "TraceHeader":
        return cls(
            int(raw["version"]),
            int(raw["num_ranks"]),
            int(raw["num_experts"]),
            dict(raw.get("meta") or {}),
            raw,
        )


class TraceRecord(NamedTuple):
    """One load of one file: ``load`` int64 [R, E] of ``layer`` in ``microbatch`` of ``iteration``
    (a replay :data:`~ultraep_megatron.traces.records.Record` adds the file's EP group)."""

    iteration: int
    microbatch: int
    layer: int
    load: torch.Tensor
