"""Writing a trace: :class:`TraceWriter`, one append-only file per EP group (format: :mod:`.format`).

No Megatron and no torch.distributed here: the integration calls a writer on one rank per EP group.

    with TraceWriter(path, num_ranks=R, num_experts=E, meta={...}) as writer:
        writer.append(iteration, microbatch, layer, load)   # int64 [R, E]
        writer.flush_iteration(iteration)                   # durability point
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch

from .format import (
    CODEC_RAW,
    CODEC_ZLIB,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    MAX_PAYLOAD,
    TAG_CLOSE,
    TAG_ITER,
    TAG_LOAD,
    TraceHeader,
    check_int,
    pack_record,
)
from .reader import TraceReader

__all__ = ["TraceWriter"]


class TraceWriter:
    """Append-only writer of one EP group's trace; call it on one rank of the group.

    Args:
        path: the trace file (``trace_path(dir, group)`` names it).
        num_ranks: R, ranks of the EP group.
        num_experts: E, logical experts (a multiple of R).
        meta: JSON-serializable facts about the run (model shape, balancer, ...), stored in the header.
        compress: zlib-compress each load (level 1; loads are small counts and compress well).
        fsync: ``flush_iteration`` also fsyncs, so a machine crash loses at most the open iteration.
        mode: ``"append"`` (default) continues an existing trace of the same shape (a resumed run):
            any uncommitted tail is cut first; ``"overwrite"`` starts a new file.

    ``append`` records a load; ``flush_iteration`` commits the iteration's records (only committed
    iterations are read back by default); ``close`` commits what is pending and marks a clean end.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        num_ranks: int,
        num_experts: int,
        meta: Optional[dict] = None,
        compress: bool = True,
        fsync: bool = True,
        mode: Literal["append", "overwrite"] = "append",
    ):
        R = check_int("num_ranks", num_ranks, 1, 1 << 20)
        E = check_int("num_experts", num_experts, 1, 1 << 24)
        if E % R:
            raise ValueError(f"num_experts ({E}) must be a multiple of num_ranks ({R})")
        if mode not in ("append", "overwrite"):
            raise ValueError(f"mode must be 'append' or 'overwrite', got {mode!r}")
        meta = dict(meta or {})
        try:
            meta_json = json.dumps(meta, sort_keys=True)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"meta must be JSON-serializable: {exc}") from None
        self.path = Path(path)
        self.num_ranks, self.num_experts = R, E
        self.compress, self.fsync = bool(compress), bool(fsync)
        self._pending: list[int] = []  # iterations of the LOAD records since the last commit
        self._closed = False

        if mode == "append" and self.path.exists() and self.path.stat().st_size > 0:
            reader = TraceReader(self.path, on_truncated="ignore")
            if (reader.header.num_ranks, reader.header.num_experts) != (R, E):
                raise ValueError(
                    f"{self.path} holds a trace of R={reader.header.num_ranks}, E={reader.header.num_experts}; "
                    f"cannot append R={R}, E={E} (use mode='overwrite' or another directory)"
                )
            end = reader.committed_end()
            self._file = open(self.path, "r+b")
            self._file.truncate(end)  # drop a torn or uncommitted tail, and a clean-close mark
            self._file.seek(end)
            self.header = reader.header
        else:
            header = {
                "format": FORMAT_NAME,
                "version": FORMAT_VERSION,
                "num_ranks": R,
                "num_experts": E,
                "record": "<4siqiBBHII",
                "meta": json.loads(meta_json),
            }
            line = json.dumps(header, sort_keys=True).encode() + b"\n"
            if len(line) > MAX_HEADER_BYTES:
                raise ValueError(
                    f"meta is too large: header of {len(line)} bytes > {MAX_HEADER_BYTES}"
                )
            self._file = open(self.path, "wb")
            self._file.write(MAGIC + line)
            self._sync()
            self.header = TraceHeader.from_dict(header)

    def append(self, iteration: int, microbatch: int, layer: int, load: torch.Tensor) -> None:
        """Record the load ``[R, E]`` (integer, >= 0, any device) of one layer and microbatch."""
        self._check_open()
        iteration = check_int("iteration", iteration, -(1 << 62), 1 << 62)
        microbatch = check_int("microbatch", microbatch, 0, (1 << 31) - 1)
        layer = check_int("layer", layer, -(1 << 31), (1 << 31) - 1)
        if not isinstance(load, torch.Tensor):
            raise ValueError(f"load must be a torch.Tensor, got {type(load).__name__}")
        if load.dtype.is_floating_point or load.dtype.is_complex or load.dtype == torch.bool:
            raise ValueError(f"load must be an integer tensor, got {load.dtype}")
        if tuple(load.shape) != (self.num_ranks, self.num_experts):
            raise ValueError(
                f"load must be [R, E] = [{self.num_ranks}, {self.num_experts}], got {tuple(load.shape)}"
            )
        array = load.detach().to("cpu", torch.int64).numpy()
        top = int(array.max()) if array.size else 0
        if array.size and int(array.min()) < 0:
            raise ValueError("load has negative entries")
        code = next(c for c in (1, 2, 4, 8) if top < (1 << (8 * c)))
        payload = np.ascontiguousarray(array, dtype=DTYPES[code]).tobytes()
        codec = CODEC_RAW
        if self.compress:
            packed = zlib.compress(payload, 1)
            if len(packed) < len(payload):
                payload, codec = packed, CODEC_ZLIB
        if len(payload) > MAX_PAYLOAD:
            raise ValueError("load too large for one record (> 4 GiB)")
        self._file.write(pack_record(TAG_LOAD, iteration, microbatch, layer, code, codec, payload))
        self._pending.append(iteration)

    def flush_iteration(self, iteration: int) -> None:
        """Commit the records appended since the last commit, all of which must be of ``iteration``;
        then flush (and fsync). A crash after this returns loses nothing of ``iteration``."""
        self._check_open()
        iteration = check_int("iteration", iteration, -(1 << 62), 1 << 62)
        others = sorted(set(self._pending) - {iteration})
        if others:
            raise ValueError(
                f"flush_iteration({iteration}) but records of iteration(s) {others} are pending; "
                "call flush_iteration once per iteration"
            )
        self._file.write(
            pack_record(TAG_ITER, iteration, len(self._pending), -1, 0, CODEC_RAW, b"")
        )
        self._pending.clear()
        self._sync()

    def close(self) -> None:
        """Commit pending records (grouped by iteration), write the clean-close mark, close. Idempotent."""
        if self._closed:
            return
        for it in dict.fromkeys(self._pending):  # distinct, in order
            count = self._pending.count(it)
            self._file.write(pack_record(TAG_ITER, it, count, -1, 0, CODEC_RAW, b""))
        self._pending.clear()
        self._file.write(pack_record(TAG_CLOSE, 0, 0, -1, 0, CODEC_RAW, b""))
        self._sync()
        self._file.close()
        self._closed = True

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"TraceWriter for {self.path} is closed")

    def _sync(self) -> None:
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
