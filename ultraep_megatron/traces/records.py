"""Replay records: the loads of a run's trace files as one stream, each with its EP group
(:data:`Record`); selecting layers, capping and scaling them (:func:`select_records`,
:class:`TraceRecords`); merging the pieces of one run's traces (:func:`merge_traces`).

The replay (``ultraep_megatron.analysis.replay``) reads any iterable of records: a
:class:`TraceRecords`, Megatron's routing traces (:class:`~ultraep_megatron.traces.router.RouterTraceRecords`)
or a list of tuples.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Iterator, Literal, Optional, Sequence

import torch

from .format import TAG_ITER, TAG_LOAD, find_trace_files, trace_path
from .reader import TraceReader
from .writer import TraceWriter

__all__ = ["Record", "TraceRecords", "merge_traces", "select_records"]

#: A replay record: (EP group, iteration, microbatch, layer, load int64 [R, E]).
Record = tuple[int, int, int, int, torch.Tensor]


def select_records(
    records: Iterable[Record],
    *,
    layers: Optional[Iterable[int]] = None,
    max_records: Optional[int] = None,
    load_scale: float = 1.0,
) -> Iterator[Record]:
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

    def __init__(
        self,
        paths: Sequence[str | os.PathLike],
        *,
        layers: Optional[Iterable[int]] = None,
        max_records: Optional[int] = None,
        load_scale: float = 1.0,
        on_truncated: Literal["warn", "error", "ignore"] = "warn",
    ):
        self.readers = [TraceReader(p, on_truncated=on_truncated) for p in paths]
        if not self.readers:
            raise ValueError("no trace files")
        shapes = {(r.num_ranks, r.num_experts) for r in self.readers}
        if len(shapes) != 1:
            raise ValueError(f"trace files disagree on [R, E]: {sorted(shapes)}")
        self.num_ranks, self.num_experts = next(iter(shapes))
        self.layers = None if layers is None else set(int(x) for x in layers)
        self.selection = dict(
            layers=self.layers, max_records=max_records, load_scale=float(load_scale)
        )
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
            tail = {
                "closed": "closed cleanly",
                "open": "still open (or the writer died between records)",
                "truncated": f"TRUNCATED tail of {scanned.truncated_bytes} bytes ignored",
            }[scanned.status]
            lines.append(
                f"EP group {i}: {reader.path} — R={reader.num_ranks}, E={reader.num_experts}, "
                f"{scanned.committed_records} loads in {scanned.committed_iterations} iterations, {tail}"
                + (
                    f", {scanned.uncommitted_records} uncommitted loads skipped"
                    if scanned.uncommitted_records
                    else ""
                )
            )
        return lines

    def __iter__(self) -> Iterator[Record]:
        def raw():
            for group, reader in enumerate(self.readers):
                for rec in reader.records(layers=self.layers):
                    yield group, rec.iteration, rec.microbatch, rec.layer, rec.load

        return select_records(raw(), **self.selection)


def merge_traces(
    inputs: Sequence[str | os.PathLike], output_dir: str | os.PathLike, *, progress=None
) -> list[Path]:
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
            raise ValueError(
                f"EP group {key}: files disagree on [R, E] {sorted(shapes)}: "
                + ", ".join(str(r.path) for r in readers)
            )
        spans = sorted(
            (
                (first, r)
                for r in readers
                if (first := next((it for tag, it, *_ in r._walk() if tag == TAG_ITER), None))
                is not None
            ),
            key=lambda fr: fr[0],
        )
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
                        raise ValueError(
                            f"EP group {key}: iteration {rec.iteration} of {reader.path} is not after "
                            f"iteration {last} of an earlier file (overlapping pieces of a run, "
                            "or files of different runs)"
                        )
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
