"""Reading a trace: :class:`TraceReader` (streams the records, also of a file still being written)
and :func:`read_trace` (a whole file into a :class:`Trace`). Format: :mod:`.format`.

    trace = read_trace(path)                                # trace.load: int64 [N, R, E]

A reader returns only committed iterations by default, so a crash loses at most the iteration in
flight; a torn tail is reported as truncation, distinct from a foreign or corrupt file.
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Literal, Optional

import numpy as np
import torch

from .format import (
    CODEC_ZLIB,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MAGIC,
    MAX_HEADER_BYTES,
    RECORD,
    TAG_CLOSE,
    TAG_ITER,
    TAG_LOAD,
    TraceFormatError,
    TraceHeader,
    TraceRecord,
    TraceTruncatedError,
    TraceTruncatedWarning,
)

__all__ = ["Trace", "TraceReader", "read_trace", "trace_info"]


class TraceReader:
    """Reads a trace file, also one still being written.

    Args:
        path: the trace file.
        on_truncated: what to do when the file ends inside a record: ``"warn"`` (default; a
            :class:`TraceTruncatedWarning`), ``"error"`` (:class:`TraceTruncatedError`) or ``"ignore"``.
            The complete records before the tear are read in every case but ``"error"``.

    Raises:
        TraceFormatError: on construction for a foreign file or an unsupported version; while
            iterating for a corrupt record (bad CRC or unknown tag) that is not at the end of the file.

    After a full pass (``records()`` exhausted, or ``scan()``), ``status`` is ``"closed"`` (clean
    close mark), ``"open"`` (ends at a record boundary: writer running, or killed between records)
    or ``"truncated"`` (ends inside a record; ``truncated_bytes`` says how many bytes were dropped);
    ``committed_records`` / ``uncommitted_records`` count LOAD records before / after the last commit
    (all layers), ``committed_iterations`` the commits.
    """

    def __init__(
        self, path: str | os.PathLike, *, on_truncated: Literal["warn", "error", "ignore"] = "warn"
    ):
        if on_truncated not in ("warn", "error", "ignore"):
            raise ValueError(
                f"on_truncated must be 'warn', 'error' or 'ignore', got {on_truncated!r}"
            )
        self.path = Path(path)
        self.on_truncated = on_truncated
        self.status: Optional[str] = None
        self.truncated_bytes = 0
        self.uncommitted_records = 0
        self.committed_records = 0
        self.committed_iterations = 0
        self._committed_end: Optional[int] = None
        with open(self.path, "rb") as f:
            head = f.read(MAX_HEADER_BYTES + len(MAGIC) + 1)
        # A file torn inside its header holds no record: always an error, whatever on_truncated.
        if not head.startswith(MAGIC):
            if MAGIC.startswith(head):
                raise TraceTruncatedError(
                    f"{self.path} is truncated: it ends inside its magic line ({len(head)} bytes)"
                )
            raise TraceFormatError(
                f"{self.path} is not an UltraEP trace (it does not start with {MAGIC!r})"
            )
        newline = head.find(b"\n", len(MAGIC))
        if newline < 0:
            if len(head) <= MAX_HEADER_BYTES + len(MAGIC):
                raise TraceTruncatedError(
                    f"{self.path} is truncated: it ends inside its JSON header ({len(head)} bytes)"
                )
            raise TraceFormatError(
                f"{self.path}: JSON header line longer than {MAX_HEADER_BYTES} bytes"
            )
        try:
            raw = json.loads(head[len(MAGIC) : newline])
        except ValueError as exc:
            raise TraceFormatError(f"{self.path}: header is not valid JSON ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise TraceFormatError(f"{self.path}: header does not declare format {FORMAT_NAME!r}")
        version = raw.get("version")
        if not isinstance(version, int) or version < 1:
            raise TraceFormatError(f"{self.path}: bad format version {version!r}")
        if version > FORMAT_VERSION:
            raise TraceFormatError(
                f"{self.path} has format version {version}; this reader knows "
                f"versions up to {FORMAT_VERSION} (upgrade ultraep_megatron)"
            )
        try:
            self.header = TraceHeader.from_dict(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(
                f"{self.path}: header misses or mangles a field ({exc})"
            ) from None
        R, E = self.header.num_ranks, self.header.num_experts
        if R < 1 or E < 1 or E % R:
            raise TraceFormatError(f"{self.path}: header has R={R}, E={E}")
        self._data_start = newline + 1

    @property
    def num_ranks(self) -> int:
        return self.header.num_ranks

    @property
    def num_experts(self) -> int:
        return self.header.num_experts

    @property
    def meta(self) -> dict:
        return self.header.meta

    def file_size(self) -> int:
        return self.path.stat().st_size

    def _truncated(self, where: int, what: str) -> None:
        self.status = "truncated"
        size = self.file_size()
        self.truncated_bytes = size - where
        message = (
            f"{self.path} is truncated: {what} at byte {where} of {size} "
            "(a crash, or a writer still running); the records before it were read"
        )
        if self.on_truncated == "error":
            raise TraceTruncatedError(message)
        if self.on_truncated == "warn":
            warnings.warn(message, TraceTruncatedWarning, stacklevel=3)

    def _walk(self) -> Iterator[tuple[bytes, int, int, int, int, int, bytes, int]]:
        """Yield (tag, iteration, microbatch, layer, dtype code, codec, payload, end offset) of every
        intact record; classify the end of the file into ``status``."""
        self.status, self.truncated_bytes = None, 0
        with open(self.path, "rb") as f:
            f.seek(self._data_start)
            offset = self._data_start
            closed = False
            while True:
                head = f.read(RECORD.size)
                if not head:
                    self.status = "closed" if closed else "open"
                    return
                if len(head) < RECORD.size:
                    if head.strip(b"\0"):
                        self._truncated(offset, "the file ends inside a record header")
                    else:
                        self._truncated(offset, "the file ends in zero bytes")
                    return
                tag, microbatch, iteration, layer, code, codec, _, nbytes, crc = RECORD.unpack(head)
                if (
                    tag not in (TAG_LOAD, TAG_ITER, TAG_CLOSE)
                    or code not in (0, *DTYPES)
                    or codec > 1
                ):
                    rest = head + f.read()
                    if not rest.strip(b"\0"):  # a torn write the file system padded with zeros
                        self._truncated(offset, "the file ends in zero bytes")
                        return
                    raise TraceFormatError(f"{self.path}: corrupt record header at byte {offset}")
                payload = f.read(nbytes)
                if len(payload) < nbytes:
                    self._truncated(offset, "the file ends inside a record payload")
                    return
                if zlib.crc32(payload, zlib.crc32(head[:28])) != crc:
                    if not f.read(1):  # the last record: a torn write
                        self._truncated(offset, "the last record fails its checksum")
                        return
                    raise TraceFormatError(
                        f"{self.path}: record at byte {offset} fails its checksum"
                    )
                offset += RECORD.size + nbytes
                closed = tag == TAG_CLOSE
                yield tag, iteration, microbatch, layer, code, codec, payload, offset

    def _decode(self, code: int, codec: int, payload: bytes, offset: int) -> torch.Tensor:
        R, E = self.header.num_ranks, self.header.num_experts
        try:
            raw = zlib.decompress(payload) if codec == CODEC_ZLIB else payload
        except zlib.error as exc:
            raise TraceFormatError(
                f"{self.path}: record ending at byte {offset} does not decompress ({exc})"
            ) from None
        if code not in DTYPES or len(raw) != R * E * code:
            raise TraceFormatError(
                f"{self.path}: record ending at byte {offset} holds {len(raw)} bytes, "
                f"expected R*E*{code} = {R * E * code}"
            )
        array = np.frombuffer(raw, dtype=DTYPES[code]).astype(np.int64).reshape(R, E)
        return torch.from_numpy(array)

    def records(
        self, *, layers: Optional[Iterable[int]] = None, include_uncommitted: bool = False
    ) -> Iterator[TraceRecord]:
        """Yield the records in file order.

        Args:
            layers: only these layer numbers (default: all).
            include_uncommitted: also yield LOAD records after the last commit (the iteration in
                flight of a running or crashed writer).
        """
        wanted = None if layers is None else set(int(x) for x in layers)
        pending: list[TraceRecord] = []
        uncommitted = committed_records = committed_iterations = 0
        self._committed_end = self._data_start
        for tag, iteration, microbatch, layer, code, codec, payload, end in self._walk():
            if tag == TAG_LOAD:
                uncommitted += 1
                if wanted is None or layer in wanted:
                    pending.append(
                        TraceRecord(
                            iteration, microbatch, layer, self._decode(code, codec, payload, end)
                        )
                    )
            elif tag == TAG_ITER:
                committed_records += uncommitted
                uncommitted = 0
                committed_iterations += 1
                self._committed_end = end
                yield from pending
                pending.clear()
        self.uncommitted_records = uncommitted
        self.committed_records = committed_records
        self.committed_iterations = committed_iterations
        if include_uncommitted:
            yield from pending

    def scan(self) -> "TraceReader":
        """One pass over the file without decoding loads: fills ``status``, ``truncated_bytes`` and
        the record counts. Returns self."""
        for _ in self.records(layers=()):
            pass
        return self

    def committed_end(self) -> int:
        """Byte offset just after the last commit record (where an appending writer continues)."""
        if self._committed_end is None:
            self.scan()
        return self._committed_end

    def __iter__(self) -> Iterator[TraceRecord]:
        return self.records()


@dataclass
class Trace:
    """A trace read into memory. ``load`` int64 [N, R, E]; ``iteration``, ``microbatch``,
    ``layer`` int64 [N] (file order); ``status``/``truncated_bytes``/``uncommitted_records`` as in
    :class:`TraceReader`."""

    header: TraceHeader
    iteration: torch.Tensor
    microbatch: torch.Tensor
    layer: torch.Tensor
    load: torch.Tensor
    status: str
    truncated_bytes: int
    uncommitted_records: int

    @property
    def num_records(self) -> int:
        return self.load.shape[0]

    @property
    def layers(self) -> list[int]:
        return sorted(set(self.layer.tolist()))


def read_trace(
    path: str | os.PathLike,
    *,
    layers: Optional[Iterable[int]] = None,
    include_uncommitted: bool = False,
    on_truncated: Literal["warn", "error", "ignore"] = "warn",
) -> Trace:
    """Read a whole trace file into a :class:`Trace` (see :meth:`TraceReader.records` for the args)."""
    reader = TraceReader(path, on_truncated=on_truncated)
    recs = list(reader.records(layers=layers, include_uncommitted=include_uncommitted))
    R, E = reader.num_ranks, reader.num_experts
    as_long = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return Trace(
        header=reader.header,
        iteration=as_long([r.iteration for r in recs]),
        microbatch=as_long([r.microbatch for r in recs]),
        layer=as_long([r.layer for r in recs]),
        load=torch.stack([r.load for r in recs])
        if recs
        else torch.zeros((0, R, E), dtype=torch.int64),
        status=reader.status,
        truncated_bytes=reader.truncated_bytes,
        uncommitted_records=reader.uncommitted_records,
    )


def trace_info(path: str | os.PathLike) -> dict:
    """What a trace file holds (``ultraep trace info``): ``path``, ``format``, ``num_ranks``,
    ``num_experts``, ``loads`` and ``iterations`` (the committed ones, as a replay reads them:
    :class:`TraceReader`'s ``committed_records`` and ``committed_iterations``), ``uncommitted``
    (the loads after the last commit, which a replay skips), ``layers`` (layer -> committed loads),
    ``status`` and ``truncated_bytes`` (as :class:`TraceReader`'s) and ``meta``. A torn tail is read
    up to the tear, silently."""
    reader = TraceReader(path, on_truncated="ignore")
    layers: dict[int, int] = {}
    for rec in reader.records():
        layers[rec.layer] = layers.get(rec.layer, 0) + 1
    h = reader.header
    return {
        "path": str(path),
        "format": f"ultraep trace v{h.version}",
        "num_ranks": h.num_ranks,
        "num_experts": h.num_experts,
        "loads": reader.committed_records,
        "uncommitted": reader.uncommitted_records,
        "iterations": reader.committed_iterations,
        "layers": dict(sorted(layers.items())),
        "status": reader.status,
        "truncated_bytes": reader.truncated_bytes,
        "meta": h.meta,
    }
