"""Megatron's own routing traces as replay records: the ``[R, E]`` load of every EP group,
microbatch and MoE layer, from a directory written by megatron-core 0.19's
``--moe-routing-trace-path``.

Megatron's router tracer writes one JSONL file per global rank, ``router_trace_rank<r>.jsonl``, one
line per router call: ``step``, ``block`` (``decoder`` or ``mtp``), ``layer`` (the layer's index in
its block's module list, 0-based), ``mtp_idx`` (MTP only), ``rank``, ``num_tokens``, ``topk`` and
``top_indices`` ``[num_tokens][topk]``; a step's lines are appended together when the step ends.
They become the project's replay records (:mod:`.records`) as follows:

* **EP groups.** With expert-tensor-parallel size 1 (what UltraEP balances), Megatron's rank order
  puts every EP group on consecutive global ranks: group g is ranks ``[g*EP, (g+1)*EP)``, and row r
  of its load is the expert histogram of ``top_indices`` on rank ``g*EP + r``.
* **Iterations.** The tracer stamps a step with Megatron's iteration counter before the increment:
  ``iteration = step + 1``, the number Megatron logs (and the project's traces record).
* **Microbatches.** The k-th forward of a (block, layer) on a rank within a step is microbatch k;
  every rank of a group must have the same count. Megatron's tracer also records eval forwards
  (into the next step), checked against the number of microbatches the run's arguments give, and
  activation-recompute forwards: with MoE or full recompute (``--recompute-modules moe``,
  ``--recompute-granularity full``) a layer's router runs again in each microbatch's backward. Its
  calls are then 2M per step, and which are forwards follows from Megatron's 1F1B schedule
  (:func:`forward_positions`: the stage's warm-up forwards, then a forward and a backward
  alternately, then the cool-down backwards); each recompute must repeat its forward's routing
  exactly, or the trace is refused.
* **Layers.** Decoder layer index n is layer ``n + 1 + offset`` (1-based, as Megatron numbers
  layers), the offset of the rank's pipeline stage: the layers split evenly over
  ``--pipeline-model-parallel-size``, or with ``--decoder-first/last-pipeline-num-layers`` or
  ``--account-for-embedding/loss-in-pipeline-split`` as megatron-core splits them
  (:mod:`.pipeline`); MTP head i is layer ``num_layers + 1 + i``.

The run's layout comes from flags (``ep_size``, ``num_experts``...) or from its arguments
(:mod:`.router_layout`: Megatron's log, a wandb ``config.yaml``, or a JSON/YAML mapping).
No Megatron import.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Literal, Optional, Sequence

import numpy as np
import torch

from .format import TraceFormatError, TraceTruncatedError, TraceTruncatedWarning, trace_path
from .records import Record, select_records
from .router_layout import RouterTraceLayout
from .writer import TraceWriter

__all__ = [
    "RouterTraceRecords",
    "convert_router_trace",
    "find_router_trace_files",
    "is_router_trace",
    "router_trace_info",
]

FILE_PATTERN = re.compile(r"router_trace_rank(\d+)\.jsonl$")


def find_router_trace_files(path: str | os.PathLike) -> list[Path]:
    """``router_trace_rank<r>.jsonl`` files of a directory, in rank order (empty if none)."""
    directory = Path(path)
    if not directory.is_dir():
        return []
    found = [
        (int(m.group(1)), p) for p in directory.iterdir() if (m := FILE_PATTERN.search(p.name))
    ]
    return [p for _, p in sorted(found)]


def is_router_trace(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> bool:
    """True when ``paths`` name a directory written by Megatron's ``--moe-routing-trace-path``."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return len(paths) == 1 and bool(find_router_trace_files(paths[0]))


@dataclass
class _Step:
    """One rank's records of one step: per (block, mtp_idx, layer), the expert histograms
    [E] int64 in call order, keys in first-call order."""

    step: int
    counts: dict
    complete: bool  # False: the file ends inside this step's lines


class _RankFile:
    """Streams one rank's JSONL file step by step, checking every line."""

    def __init__(self, path: Path, rank: int, num_experts: int):
        self.path, self.rank, self.num_experts = path, rank, num_experts
        self.topk: Optional[int] = None

    def _parse(self, line: bytes, number: int) -> tuple[int, tuple, np.ndarray]:
        try:
            rec = json.loads(line)
            step, block, layer = int(rec["step"]), rec["block"], int(rec["layer"])
            top = np.asarray(rec["top_indices"], dtype=np.int64)
            num_tokens, topk = int(rec["num_tokens"]), int(rec["topk"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceFormatError(
                f"{self.path}:{number}: not a router trace record ({exc})"
            ) from None
        if rec.get("rank", self.rank) != self.rank:
            raise TraceFormatError(
                f"{self.path}:{number}: a record of rank {rec['rank']} in rank {self.rank}'s "
                "file (files of different runs mixed in one directory?)"
            )
        if block not in ("decoder", "mtp"):
            raise TraceFormatError(f"{self.path}:{number}: unknown block {block!r}")
        if top.shape != (num_tokens, topk) and not (num_tokens == 0 and top.size == 0):
            raise TraceFormatError(
                f"{self.path}:{number}: top_indices has shape {top.shape}, the record says "
                f"[{num_tokens}, {topk}]"
            )
        if self.topk is None:
            self.topk = topk
        elif topk != self.topk:
            raise TraceFormatError(
                f"{self.path}:{number}: top-{topk} after top-{self.topk} "
                "(files of different runs mixed?)"
            )
        if top.size and (int(top.min()) < 0 or int(top.max()) >= self.num_experts):
            raise TraceFormatError(
                f"{self.path}:{number}: expert id {int(top.max())} outside "
                f"[0, {self.num_experts}): check --num-experts"
            )
        key = (block, rec.get("mtp_idx"), layer)
        return step, key, np.bincount(top.reshape(-1), minlength=self.num_experts)

    def steps(self) -> Iterator[_Step]:
        current: Optional[_Step] = None
        with open(self.path, "rb") as f:
            number = 0
            for line in f:
                number += 1
                if not line.endswith(b"\n"):  # the writer stopped inside this line
                    if current is not None:
                        current.complete = False
                        yield current
                    return
                step, key, counts = self._parse(line, number)
                if current is not None and step != current.step:
                    if step < current.step:
                        raise TraceFormatError(
                            f"{self.path}:{number}: step {step} after step {current.step} "
                            "(files of different runs mixed?)"
                        )
                    yield current
                    current = None
                if current is None:
                    current = _Step(step, {}, True)
                current.counts.setdefault(key, []).append(counts)
        if current is not None:
            yield current


class RouterTraceRecords:
    """Replay records from a Megatron ``--moe-routing-trace-path`` directory, streamed step by step.

    Args:
        directory: the trace directory.
        layout: the run's :class:`RouterTraceLayout`.
        layers, max_records, load_scale: see :func:`.records.select_records`.
        on_truncated: a trace that ends early (a crash, or a run still writing: the last step is
            torn or missing on some ranks) keeps the steps complete on every rank, with a
            :class:`~ultraep_megatron.traces.TraceTruncatedWarning` (``"warn"``), silently
            (``"ignore"``), or raises :class:`~ultraep_megatron.traces.format.TraceTruncatedError` (``"error"``).

    Raises (when iterated, or at construction for the file set):
        TraceFormatError: a foreign or corrupt line, missing rank files, or files that do not
            belong to one run (ranks, steps, top-k or record counts disagree).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        layout: RouterTraceLayout,
        *,
        layers: Optional[Iterable[int]] = None,
        max_records: Optional[int] = None,
        load_scale: float = 1.0,
        on_truncated: Literal["warn", "error", "ignore"] = "warn",
    ):
        self.directory = Path(directory)
        self.layout = layout
        self.files = find_router_trace_files(self.directory)
        if not self.files:
            raise TraceFormatError(
                f"{self.directory}: no router_trace_rank<r>.jsonl files "
                "(not a --moe-routing-trace-path directory)"
            )
        ranks = [int(FILE_PATTERN.search(p.name).group(1)) for p in self.files]
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        if missing:
            raise TraceFormatError(f"{self.directory}: rank files missing for ranks {missing}")
        world = len(self.files)
        if layout.world_size is not None and world != layout.world_size:
            raise TraceFormatError(
                f"{self.directory} holds {world} rank files, the run had world size "
                f"{layout.world_size} (stale files of another run?)"
            )
        if world % layout.ep_size:
            raise TraceFormatError(
                f"{world} rank files are not a whole number of EP groups of "
                f"--expert-model-parallel-size {layout.ep_size}"
            )
        if world % layout.pp_size:
            raise TraceFormatError(
                f"{world} rank files do not split into "
                f"--pipeline-model-parallel-size {layout.pp_size} stages"
            )
        self.stages = layout.stages()
        self.num_ranks, self.num_experts = layout.ep_size, layout.num_experts
        self.num_groups = world // layout.ep_size
        self.on_truncated = on_truncated
        self.selection = dict(layers=layers, max_records=max_records, load_scale=float(load_scale))
        next(select_records([], **self.selection), None)  # validate the selection now
        self.meta = dict(layout.meta or {})
        self.status: Optional[str] = None  # after a full pass: "complete" or "truncated"
        self._total: Optional[int] = None

    def _layer_number(self, group: int, key: tuple) -> int:
        block, mtp_idx, layer = key
        if block == "mtp":
            if self.layout.num_layers is None:
                raise ValueError(
                    "the trace has MTP records: give --num-layers (or --run-args) to number "
                    "MTP layers after the decoder's"
                )
            return self.layout.num_layers + 1 + int(mtp_idx or 0)
        if self.stages is None:
            return layer + 1
        stage = self.stages[self._stage(group)]
        if layer >= len(stage):
            raise TraceFormatError(
                f"{self.directory}: decoder layer index {layer} on pipeline stage "
                f"{self._stage(group)}, which builds {len(stage)} layers "
                f"({stage.start}-{stage.stop - 1}): the layout given is not the run's"
            )
        return stage[layer]

    def _stage(self, group: int) -> int:
        """The pipeline stage of EP group ``group`` (stages are blocks of consecutive ranks)."""
        return group * self.num_ranks // (len(self.files) // self.layout.pp_size)

    def _truncated(self, message: str) -> None:
        self.status = "truncated"
        if self.on_truncated == "error":
            raise TraceTruncatedError(message)
        if self.on_truncated == "warn":
            warnings.warn(message, TraceTruncatedWarning, stacklevel=3)

    def _raw(self) -> Iterator[Record]:
        readers = [_RankFile(p, rank, self.num_experts) for rank, p in enumerate(self.files)]
        streams = [r.steps() for r in readers]
        heads = [next(s, None) for s in streams]
        self.status = None
        while any(h is not None for h in heads):
            step = min(h.step for h in heads if h is not None)
            behind = [
                rank
                for rank, h in enumerate(heads)
                if h is None or h.step != step or not h.complete
            ]
            if behind:
                ended = [rank for rank in behind if heads[rank] is None or not heads[rank].complete]
                skipped = [rank for rank in behind if rank not in ended]
                if skipped:
                    raise TraceFormatError(
                        f"{self.directory}: step {step} is missing on ranks {skipped} although "
                        "they have later steps (files of different runs mixed?)"
                    )
                self._truncated(
                    f"{self.directory}: the trace ends early on ranks {ended} (torn or missing "
                    f"step {step}: a crash, or a run still writing); steps from {step} on are "
                    "left out"
                )
                return
            problem, torn_possible = self._check_step(step, heads)
            if problem is not None:
                following = [next(s, None) for s in streams]
                if not torn_possible or any(h is not None for h in following):
                    raise TraceFormatError(problem)
                self._truncated(
                    f"{problem}: the last step is incomplete (a crash, or a run still "
                    f"writing); steps from {step} on are left out"
                )
                return
            yield from self._step_records(step, heads)
            heads = [next(s, None) for s in streams]
        self.status = "complete"

    def _check_step(self, step: int, heads: list[_Step]) -> tuple[Optional[str], bool]:
        """Why the ranks' records of ``step`` do not form whole [R, E] loads (None if they do), and
        whether a crash while writing the last step could explain it."""
        R, M = self.num_ranks, self.layout.num_microbatches
        for group in range(self.num_groups):
            members = heads[group * R : (group + 1) * R]
            leader = {k: len(v) for k, v in members[0].counts.items()}
            for offset, member in enumerate(members[1:], 1):
                sizes = {k: len(v) for k, v in member.counts.items()}
                if sizes != leader:
                    return (
                        f"{self.directory}: step {step}: rank {group * R + offset} recorded router calls "
                        f"{sorted(sizes.items())} per (block, mtp_idx, layer), rank {group * R} "
                        f"{sorted(leader.items())} (files of different runs mixed?)",
                        True,
                    )
            for key, calls in leader.items():
                if M is not None and calls != M and not (self.layout.recompute and calls == 2 * M):
                    expected = f"{M} microbatches per step" + (
                        f" (or {2 * M} calls with its recompute)" if self.layout.recompute else ""
                    )
                    return (
                        f"{self.directory}: step {step}, {key[0]} layer {key[2]}: {calls} router calls on "
                        f"rank {group * R}, the run has {expected} (eval forwards recorded? trace with "
                        "--eval-iters 0"
                        + (
                            ""
                            if self.layout.recompute
                            else "; a recompute of the MoE layers needs --run-args"
                        )
                        + ")",
                        False,
                    )
        return None, False

    def _forwards(self, step: int, group: int, members: list[_Step]) -> dict:
        """Per (block, mtp_idx, layer) of an EP group's step: its forward calls' histograms on every
        member rank, the recompute calls dropped (checked to repeat their forwards exactly)."""
        M = self.layout.num_microbatches
        out = {}
        for key, calls in members[0].counts.items():
            if not (self.layout.recompute and M is not None and len(calls) == 2 * M):
                out[key] = [member.counts[key] for member in members]
                continue
            forward = forward_positions(M, self.layout.pp_size, self._stage(group))
            backward = sorted(set(range(2 * M)) - set(forward))
            kept = []
            for offset, member in enumerate(members):
                rank_calls = member.counts[key]
                firsts = [rank_calls[i] for i in forward]
                again = [rank_calls[i] for i in backward]
                for k, (first, second) in enumerate(zip(firsts, again)):
                    if not np.array_equal(first, second):
                        raise TraceFormatError(
                            f"{self.directory}: step {step}, {key[0]} layer {key[2]}, rank {group * self.num_ranks + offset}: "
                            f"the backward's router call of microbatch {k} routes differently from its forward, "
                            "so it is no activation recompute of it (another schedule than 1F1B, or "
                            "files of different runs?)"
                        )
                kept.append(firsts)
            out[key] = kept
        return out

    def _step_records(self, step: int, heads: list[_Step]) -> Iterator[Record]:
        R = self.num_ranks
        for group in range(self.num_groups):
            members = heads[group * R : (group + 1) * R]
            forwards = self._forwards(step, group, members)
            layer_of = {key: self._layer_number(group, key) for key in forwards}
            seen: dict[tuple, int] = {}
            for key in self._call_order({key: calls[0] for key, calls in forwards.items()}):
                k = seen.get(key, 0)
                seen[key] = k + 1
                load = np.stack([calls[k] for calls in forwards[key]])
                yield group, step + 1, k, layer_of[key], torch.from_numpy(load)

    @staticmethod
    def _call_order(counts: dict) -> list[tuple]:
        """Keys in the order the router ran: microbatch-major over the layers' first-call order."""
        order, rounds = list(counts), max(len(v) for v in counts.values())
        return [key for k in range(rounds) for key in order if k < len(counts[key])]

    def __iter__(self) -> Iterator[Record]:
        return select_records(self._raw(), **self.selection)

    @property
    def total(self) -> int:
        """Records the stream yields (for progress): lines of the groups' first ranks, by a scan
        (halved under recompute, where a layer's router runs twice per microbatch)."""
        if self._total is None:
            wanted = self.selection["layers"]
            wanted = None if wanted is None else set(int(x) for x in wanted)
            limit = self.selection["max_records"]
            total = 0
            for group in range(self.num_groups):
                n = 0
                with open(self.files[group * self.num_ranks], "rb") as f:
                    for line in f:
                        if wanted is not None:
                            head = re.search(rb'"block": "(\w+)", "layer": (\d+)', line[:400])
                            mtp = re.search(rb'"mtp_idx": (\d+)', line[:600])
                            if head is None:
                                continue
                            key = (
                                head.group(1).decode(),
                                int(mtp.group(1)) if mtp else None,
                                int(head.group(2)),
                            )
                            if self._layer_number(group, key) not in wanted:
                                continue
                        n += 1
                n = n // 2 if self.layout.recompute else n
                total += n if limit is None else min(n, limit)
            self._total = total
        return self._total

    def describe(self) -> list[str]:
        """What the directory holds, for a report header."""
        sizes = sum(p.stat().st_size for p in self.files)
        return [
            f"Megatron routing trace {self.directory}: {len(self.files)} rank files ({sizes / 2**20:.1f} MiB), "
            f"{self.num_groups} EP group(s) of {self.num_ranks} ranks, E={self.num_experts}"
            + (
                f", {self.layout.num_microbatches} microbatches per step"
                if self.layout.num_microbatches
                else ""
            )
        ]


def forward_positions(num_microbatches: int, pp_size: int, stage: int) -> list[int]:
    """Which of a layer's 2M router calls in a step are forwards, when each microbatch's backward
    runs the router again (activation recompute): megatron-core's 1F1B schedule
    (``forward_backward_pipelining_without_interleaving``; ``forward_backward_no_pipelining`` at
    PP 1) runs ``min(pp_size - stage - 1, M)`` warm-up forwards, then a forward and a backward
    alternately, then the remaining backwards."""
    M = num_microbatches
    warmup = min(pp_size - stage - 1, M)
    events = ["F"] * warmup + ["F", "B"] * (M - warmup) + ["B"] * warmup
    return [i for i, event in enumerate(events) if event == "F"]


def router_trace_info(records: RouterTraceRecords) -> dict:
    """What a Megatron routing trace holds (``ultraep trace info``; read with ``records``'s
    ``on_truncated``): ``path``, ``format``, ``rank_files``, ``ep_groups``, ``num_ranks``,
    ``num_experts``, ``loads``, ``iterations``, ``layers`` (layer -> loads), ``status`` and ``meta``."""
    layers: dict[int, int] = {}
    iterations = set()
    for _, iteration, _, layer, _ in records:
        layers[layer] = layers.get(layer, 0) + 1
        iterations.add(iteration)
    return {
        "path": str(records.directory),
        "format": "megatron router trace",
        "rank_files": len(records.files),
        "ep_groups": records.num_groups,
        "num_ranks": records.num_ranks,
        "num_experts": records.num_experts,
        "loads": sum(layers.values()),
        "iterations": len(iterations),
        "layers": dict(sorted(layers.items())),
        "status": records.status,
        "meta": records.meta,
    }


def convert_router_trace(
    records: RouterTraceRecords, output_dir: str | os.PathLike, *, progress=None
) -> list[Path]:
    """Write a Megatron routing trace in the project's format: one file per EP group,
    ``<output_dir>/ep_group_<first global rank>.uetrace``, committed step by step.
    ``progress(done)`` after every record. Returns the files written."""
    writers: dict[int, TraceWriter] = {}
    current: dict[int, int] = {}
    done = 0
    try:
        for group, iteration, microbatch, layer, load in records:
            writer = writers.get(group)
            if writer is None:
                first = group * records.num_ranks
                writer = writers[group] = TraceWriter(
                    trace_path(output_dir, first),
                    num_ranks=records.num_ranks,
                    num_experts=records.num_experts,
                    meta={
                        **records.meta,
                        "first_global_rank": first,
                        "converted_from": str(records.directory),
                    },
                    mode="overwrite",
                    fsync=False,
                )
            if group in current and current[group] != iteration:
                writer.flush_iteration(current[group])
            current[group] = iteration
            writer.append(iteration, microbatch, layer, load)
            done += 1
            if progress is not None:
                progress(done)
        for group, iteration in current.items():
            writers[group].flush_iteration(iteration)
    finally:
        for writer in writers.values():
            writer.close()
    return [w.path for _, w in sorted(writers.items())]
