"""Routing traces: the exact ``[R, E]`` load the planner saw, for every iteration, microbatch and
MoE layer of a run, one append-only file per EP group (format spec: ``docs/traces.md``).

No Megatron and no torch.distributed here: the integration calls a :class:`TraceWriter` on one rank
per EP group; ``ultraep replay`` / ``ultraep advise`` read the files with :class:`TraceRecords`
(:class:`TraceReader` / :func:`read_trace` underneath), also while the run is still writing them.

    with TraceWriter(path, num_ranks=R, num_experts=E, meta={...}) as writer:
        writer.append(iteration, microbatch, layer, load)   # int64 [R, E]
        writer.flush_iteration(iteration)                   # durability point
    trace = read_trace(path)                                # trace.load: int64 [N, R, E]

File layout (version 1, all integers little-endian):

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

import json
import os
import struct
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Literal, NamedTuple, Optional, Sequence

import numpy as np
import torch

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "TRACE_SUFFIX",
    "Record",
    "Trace",
    "TraceError",
    "TraceFormatError",
    "TraceHeader",
    "TraceReader",
    "TraceRecord",
    "TraceRecords",
    "TraceTruncatedError",
    "TraceTruncatedWarning",
    "TraceWriter",
    "find_trace_files",
    "merge_traces",
    "read_trace",
    "select_records",
    "synthetic_loads",
    "trace_path",
    "write_synthetic_trace",
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


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def _pack_record(tag: bytes, iteration: int, microbatch: int, layer: int, dtype_code: int,
                 codec: int, payload: bytes) -> bytes:
    head = RECORD.pack(tag, microbatch, iteration, layer, dtype_code, codec, 0, len(payload), 0)
    crc = zlib.crc32(payload, zlib.crc32(head[:28]))
    return head[:28] + struct.pack("<I", crc) + payload


def _check_int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must lie in [{lo}, {hi}], got {value}")
    return int(value)


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

    def __init__(self, path: str | os.PathLike, *, num_ranks: int, num_experts: int,
                 meta: Optional[dict] = None, compress: bool = True, fsync: bool = True,
                 mode: Literal["append", "overwrite"] = "append"):
        R = _check_int("num_ranks", num_ranks, 1, 1 << 20)
        E = _check_int("num_experts", num_experts, 1, 1 << 24)
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
                    f"cannot append R={R}, E={E} (use mode='overwrite' or another directory)")
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
                raise ValueError(f"meta is too large: header of {len(line)} bytes > {MAX_HEADER_BYTES}")
            self._file = open(self.path, "wb")
            self._file.write(MAGIC + line)
            self._sync()
            self.header = TraceHeader.from_dict(header)

    def append(self, iteration: int, microbatch: int, layer: int, load: torch.Tensor) -> None:
        """Record the load ``[R, E]`` (integer, >= 0, any device) of one layer and microbatch."""
        self._check_open()
        iteration = _check_int("iteration", iteration, -(1 << 62), 1 << 62)
        microbatch = _check_int("microbatch", microbatch, 0, (1 << 31) - 1)
        layer = _check_int("layer", layer, -(1 << 31), (1 << 31) - 1)
        if not isinstance(load, torch.Tensor):
            raise ValueError(f"load must be a torch.Tensor, got {type(load).__name__}")
        if load.dtype.is_floating_point or load.dtype.is_complex or load.dtype == torch.bool:
            raise ValueError(f"load must be an integer tensor, got {load.dtype}")
        if tuple(load.shape) != (self.num_ranks, self.num_experts):
            raise ValueError(f"load must be [R, E] = [{self.num_ranks}, {self.num_experts}], got {tuple(load.shape)}")
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
        self._file.write(_pack_record(TAG_LOAD, iteration, microbatch, layer, code, codec, payload))
        self._pending.append(iteration)

    def flush_iteration(self, iteration: int) -> None:
        """Commit the records appended since the last commit, all of which must be of ``iteration``;
        then flush (and fsync). A crash after this returns loses nothing of ``iteration``."""
        self._check_open()
        iteration = _check_int("iteration", iteration, -(1 << 62), 1 << 62)
        others = sorted(set(self._pending) - {iteration})
        if others:
            raise ValueError(f"flush_iteration({iteration}) but records of iteration(s) {others} are pending; "
                             "call flush_iteration once per iteration")
        self._file.write(_pack_record(TAG_ITER, iteration, len(self._pending), -1, 0, CODEC_RAW, b""))
        self._pending.clear()
        self._sync()

    def close(self) -> None:
        """Commit pending records (grouped by iteration), write the clean-close mark, close. Idempotent."""
        if self._closed:
            return
        for it in dict.fromkeys(self._pending):  # distinct, in order
            count = self._pending.count(it)
            self._file.write(_pack_record(TAG_ITER, it, count, -1, 0, CODEC_RAW, b""))
        self._pending.clear()
        self._file.write(_pack_record(TAG_CLOSE, 0, 0, -1, 0, CODEC_RAW, b""))
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


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------

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
        return cls(int(raw["version"]), int(raw["num_ranks"]), int(raw["num_experts"]),
                   dict(raw.get("meta") or {}), raw)


class TraceRecord(NamedTuple):
    """One load: ``load`` int64 [R, E] of ``layer`` in ``microbatch`` of ``iteration``."""

    iteration: int
    microbatch: int
    layer: int
    load: torch.Tensor


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

    def __init__(self, path: str | os.PathLike, *,
                 on_truncated: Literal["warn", "error", "ignore"] = "warn"):
        if on_truncated not in ("warn", "error", "ignore"):
            raise ValueError(f"on_truncated must be 'warn', 'error' or 'ignore', got {on_truncated!r}")
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
                raise TraceTruncatedError(f"{self.path} is truncated: it ends inside its magic line "
                                          f"({len(head)} bytes)")
            raise TraceFormatError(f"{self.path} is not an UltraEP trace (it does not start with {MAGIC!r})")
        newline = head.find(b"\n", len(MAGIC))
        if newline < 0:
            if len(head) <= MAX_HEADER_BYTES + len(MAGIC):
                raise TraceTruncatedError(f"{self.path} is truncated: it ends inside its JSON header "
                                          f"({len(head)} bytes)")
            raise TraceFormatError(f"{self.path}: JSON header line longer than {MAX_HEADER_BYTES} bytes")
        try:
            raw = json.loads(head[len(MAGIC):newline])
        except ValueError as exc:
            raise TraceFormatError(f"{self.path}: header is not valid JSON ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
            raise TraceFormatError(f"{self.path}: header does not declare format {FORMAT_NAME!r}")
        version = raw.get("version")
        if not isinstance(version, int) or version < 1:
            raise TraceFormatError(f"{self.path}: bad format version {version!r}")
        if version > FORMAT_VERSION:
            raise TraceFormatError(f"{self.path} has format version {version}; this reader knows "
                                   f"versions up to {FORMAT_VERSION} (upgrade ultraep_megatron)")
        try:
            self.header = TraceHeader.from_dict(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{self.path}: header misses or mangles a field ({exc})") from None
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
        message = (f"{self.path} is truncated: {what} at byte {where} of {size} "
                   "(a crash, or a writer still running); the records before it were read")
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
                if tag not in (TAG_LOAD, TAG_ITER, TAG_CLOSE) or code not in (0, *DTYPES) or codec > 1:
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
                    raise TraceFormatError(f"{self.path}: record at byte {offset} fails its checksum")
                offset += RECORD.size + nbytes
                closed = tag == TAG_CLOSE
                yield tag, iteration, microbatch, layer, code, codec, payload, offset

    def _decode(self, code: int, codec: int, payload: bytes, offset: int) -> torch.Tensor:
        R, E = self.header.num_ranks, self.header.num_experts
        try:
            raw = zlib.decompress(payload) if codec == CODEC_ZLIB else payload
        except zlib.error as exc:
            raise TraceFormatError(f"{self.path}: record ending at byte {offset} does not decompress ({exc})") from None
        if code not in DTYPES or len(raw) != R * E * code:
            raise TraceFormatError(f"{self.path}: record ending at byte {offset} holds {len(raw)} bytes, "
                                   f"expected R*E*{code} = {R * E * code}")
        array = np.frombuffer(raw, dtype=DTYPES[code]).astype(np.int64).reshape(R, E)
        return torch.from_numpy(array)

    def records(self, *, layers: Optional[Iterable[int]] = None,
                include_uncommitted: bool = False) -> Iterator[TraceRecord]:
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
                    pending.append(TraceRecord(iteration, microbatch, layer, self._decode(code, codec, payload, end)))
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

    def for_layer(self, layer: int) -> torch.Tensor:
        """int64 [M, R, E]: the loads of one layer in time order."""
        return self.load[self.layer == layer]


def read_trace(path: str | os.PathLike, *, layers: Optional[Iterable[int]] = None,
               include_uncommitted: bool = False,
               on_truncated: Literal["warn", "error", "ignore"] = "warn") -> Trace:
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
        load=torch.stack([r.load for r in recs]) if recs else torch.zeros((0, R, E), dtype=torch.int64),
        status=reader.status,
        truncated_bytes=reader.truncated_bytes,
        uncommitted_records=reader.uncommitted_records,
    )


# ---------------------------------------------------------------------------------------------
# Synthetic non-stationary traces (tests, demos)
# ---------------------------------------------------------------------------------------------

def synthetic_loads(*, num_iterations: int, num_microbatches: int, num_layers: int, num_ranks: int,
                    num_experts: int, tokens_per_rank: int, topk: int, skew: float = 1.0,
                    drift: float = 0.3, rank_spread: float = 0.3, seed: int = 0
                    ) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """Drifting-Zipf routing loads: yields ``(iteration, microbatch, layer, load int64 [R, E])`` in
    training order (iterations and layers 1-based, microbatches 0-based).

    Every layer starts from its own Zipf popularity (``logit_e = -skew * log(rank_e + 1)`` over a
    random expert order). Each iteration, every expert's logit takes a random-walk step of
    standard deviation ``drift`` (hot experts move over training and differ across layers); every
    source rank adds a fixed per-(layer, rank) offset of spread ``rank_spread`` (its data domain),
    and each microbatch samples ``tokens_per_rank * topk`` (token, expert) pairs per source rank
    multinomially (microbatch jitter). Row sums are exactly ``tokens_per_rank * topk``.
    """
    for name, v in (("num_iterations", num_iterations), ("num_microbatches", num_microbatches),
                    ("num_layers", num_layers), ("num_ranks", num_ranks), ("num_experts", num_experts),
                    ("tokens_per_rank", tokens_per_rank), ("topk", topk)):
        _check_int(name, v, 1, 1 << 40)
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_ranks ({num_ranks})")
    if topk > num_experts:
        raise ValueError(f"topk ({topk}) must be <= num_experts ({num_experts})")
    rng = np.random.default_rng(seed)
    R, E = num_ranks, num_experts
    zipf = -skew * np.log(np.arange(1, E + 1, dtype=np.float64))
    logits = np.stack([zipf[rng.permutation(E)] for _ in range(num_layers)])  # [L, E]
    domain = rng.normal(0.0, rank_spread, size=(num_layers, R, E))  # [L, R, E]
    pairs = tokens_per_rank * topk
    for it in range(1, num_iterations + 1):
        if it > 1:
            logits = logits + rng.normal(0.0, drift, size=logits.shape)
        for mb in range(num_microbatches):
            for li in range(num_layers):
                z = logits[li][None, :] + domain[li]  # [R, E]
                p = np.exp(z - z.max(axis=1, keepdims=True))
                p /= p.sum(axis=1, keepdims=True)
                load = np.stack([rng.multinomial(pairs, p[r]) for r in range(R)])
                yield it, mb, li + 1, torch.from_numpy(load.astype(np.int64))


def write_synthetic_trace(path: str | os.PathLike, *, meta: Optional[dict] = None, **kwargs) -> Path:
    """Write :func:`synthetic_loads` (``kwargs``) to ``path`` as a trace; returns the path."""
    meta = {"source": "synthetic drifting Zipf", **{k: v for k, v in kwargs.items()}, **(meta or {})}
    with TraceWriter(path, num_ranks=kwargs["num_ranks"], num_experts=kwargs["num_experts"],
                     meta=meta, fsync=False, mode="overwrite") as writer:
        current = None
        for it, mb, layer, load in synthetic_loads(**kwargs):
            if current is not None and it != current:
                writer.flush_iteration(current)
            current = it
            writer.append(it, mb, layer, load)
        if current is not None:
            writer.flush_iteration(current)
    return Path(path)


# ---------------------------------------------------------------------------------------------
# Record streams for replay, and merging
# ---------------------------------------------------------------------------------------------

#: A replay record: (EP group, iteration, microbatch, layer, load int64 [R, E]).
Record = tuple[int, int, int, int, torch.Tensor]


def select_records(records: Iterable[Record], *, layers: Optional[Iterable[int]] = None,
                   max_records: Optional[int] = None, load_scale: float = 1.0) -> Iterator[Record]:
    """The records of ``layers`` (default: all), at most ``max_records`` per EP group, each load
    multiplied by ``load_scale`` and rounded (e.g. to project a small run's routing onto a
    production microbatch size)."""
    if not load_scale > 0:
        raise ValueError(f"load_scale must be > 0, got {load_scale}")
    if max_records is not None and max_records < 1:
        raise ValueError(f"max_records must be >= 1, got {max_records}")
    wanted = None if layers is None else set(int(x) for x in layers)
    taken: dict[int, int] = {}
    for group, iteration, microbatch, layer, load in records:
        if wanted is not None and layer not in wanted:
            continue
        n = taken.get(group, 0)
        if max_records is not None and n >= max_records:
            continue
        taken[group] = n + 1
        if load_scale != 1.0:
            load = torch.round(load.to(torch.float64) * load_scale).to(torch.int64)
        yield group, iteration, microbatch, layer, load


class TraceRecords:
    """Replay records streamed from trace files (committed records only).

    Args:
        paths: trace files; EP group g is ``paths[g]``. All must have the same R and E.
        layers, max_records, load_scale: see :func:`select_records`.
        on_truncated: for a torn tail, as in :class:`TraceReader`.

    ``meta`` is the first file's header meta; ``total`` the number of records the stream yields
    (for progress), counted by a scan of the files; ``describe()`` one line per file.
    """

    def __init__(self, paths: Sequence[str | os.PathLike], *, layers: Optional[Iterable[int]] = None,
                 max_records: Optional[int] = None, load_scale: float = 1.0,
                 on_truncated: Literal["warn", "error", "ignore"] = "warn"):
        self.readers = [TraceReader(p, on_truncated=on_truncated) for p in paths]
        if not self.readers:
            raise ValueError("no trace files")
        shapes = {(r.num_ranks, r.num_experts) for r in self.readers}
        if len(shapes) != 1:
            raise ValueError(f"trace files disagree on [R, E]: {sorted(shapes)}")
        self.num_ranks, self.num_experts = next(iter(shapes))
        self.layers = None if layers is None else set(int(x) for x in layers)
        self.selection = dict(layers=self.layers, max_records=max_records, load_scale=float(load_scale))
        next(select_records([], **self.selection), None)  # validate the selection now
        self.meta = dict(self.readers[0].meta)
        self._total: Optional[int] = None

    @property
    def total(self) -> int:
        if self._total is None:
            total = 0
            for reader in self.readers:
                counts: dict[int, int] = {}
                pending: list[int] = []
                for tag, _, _, layer, *_ in reader._walk():  # headers only, no load decoded
                    if tag == TAG_LOAD:
                        pending.append(layer)
                    elif tag == TAG_ITER:
                        for x in pending:
                            counts[x] = counts.get(x, 0) + 1
                        pending.clear()
                n = sum(c for x, c in counts.items() if self.layers is None or x in self.layers)
                limit = self.selection["max_records"]
                total += n if limit is None else min(n, limit)
            self._total = total
        return self._total

    def describe(self) -> list[str]:
        """One line per file: shape, committed loads and iterations, how its tail ends."""
        lines = []
        for i, reader in enumerate(self.readers):
            scanned = TraceReader(reader.path, on_truncated="ignore").scan()
            tail = {"closed": "closed cleanly", "open": "still open (or the writer died between records)",
                    "truncated": f"TRUNCATED tail of {scanned.truncated_bytes} bytes ignored"}[scanned.status]
            lines.append(f"EP group {i}: {reader.path} — R={reader.num_ranks}, E={reader.num_experts}, "
                         f"{scanned.committed_records} loads in {scanned.committed_iterations} iterations, {tail}"
                         + (f", {scanned.uncommitted_records} uncommitted loads skipped"
                            if scanned.uncommitted_records else ""))
        return lines

    def __iter__(self) -> Iterator[Record]:
        def raw():
            for group, reader in enumerate(self.readers):
                for rec in reader.records(layers=self.layers):
                    yield group, rec.iteration, rec.microbatch, rec.layer, rec.load

        return select_records(raw(), **self.selection)


def merge_traces(inputs: Sequence[str | os.PathLike], output_dir: str | os.PathLike, *,
                 progress=None) -> list[Path]:
    """Merge the trace files of one run written in pieces (e.g. a resumed job with a new
    ``--moe-balancer-trace-dir``) into one file per EP group, in iteration order.

    Files belong to the same EP group when their ``meta.first_global_rank`` agrees (else their
    file name). Within a group the files must have the same R and E and disjoint, ordered
    iterations; committed records only. ``progress(done)`` is called after every record.

    Returns:
        the written files, ``<output_dir>/ep_group_NNNN.uetrace``.

    Raises:
        ValueError: on overlapping iterations or disagreeing shapes (files of different runs).
    """
    files = find_trace_files(list(inputs))
    groups: dict[object, list[TraceReader]] = {}
    for path in files:
        reader = TraceReader(path)
        key = reader.meta.get("first_global_rank", path.name)
        groups.setdefault(key, []).append(reader)
    written, done = [], 0
    for key, readers in sorted(groups.items(), key=lambda kv: str(kv[0])):
        shapes = {(r.num_ranks, r.num_experts) for r in readers}
        if len(shapes) != 1:
            raise ValueError(f"EP group {key}: files disagree on [R, E] {sorted(shapes)}: "
                             + ", ".join(str(r.path) for r in readers))
        spans = sorted(((first, r) for r in readers
                        if (first := next((it for tag, it, *_ in r._walk() if tag == TAG_ITER), None)) is not None),
                       key=lambda fr: fr[0])
        R, E = next(iter(shapes))
        group = key if isinstance(key, int) else len(written)
        path = trace_path(output_dir, group)
        if any(path.resolve() == r.path.resolve() for r in readers):
            raise ValueError(f"{path} is one of the inputs: merge into another directory")
        meta = {**readers[0].meta, "merged_from": [str(r.path) for _, r in spans]}
        last = None
        with TraceWriter(path, num_ranks=R, num_experts=E, meta=meta, mode="overwrite") as writer:
            for _, reader in spans:
                current = None
                for rec in reader.records():
                    if current is not None and rec.iteration != current:
                        writer.flush_iteration(current)
                    if rec.iteration != current and last is not None and rec.iteration <= last:
                        raise ValueError(f"EP group {key}: iteration {rec.iteration} of {reader.path} is not after "
                                         f"iteration {last} of an earlier file (overlapping pieces of a run, "
                                         "or files of different runs)")
                    current = rec.iteration
                    writer.append(rec.iteration, rec.microbatch, rec.layer, rec.load)
                    done += 1
                    if progress is not None:
                        progress(done)
                if current is not None:
                    writer.flush_iteration(current)
                    last = current
        written.append(path)
    return written
