"""Routing traces: the exact ``[R, E]`` load of every iteration, microbatch and MoE layer of a run.

No Megatron and no torch.distributed here (the integration writes traces; ``ultraep`` reads them).
Modules, from the bytes up:

* :mod:`.format`: the file format (constants, errors, file names); :mod:`.writer`
  (:class:`TraceWriter`) and :mod:`.reader` (:class:`TraceReader`, :func:`read_trace`);
* :mod:`.records`: the loads of a run's files as one replay stream (:class:`TraceRecords`, of
  :class:`~.records.Record` tuples), with its selection, and :func:`merge_traces`;
* :mod:`.router`: Megatron's own ``--moe-routing-trace-path`` traces as the same stream
  (:class:`~.router.RouterTraceRecords`, :func:`~.router.is_router_trace`), and their conversion to
  the project's files (imported from the module: they are the Megatron trace's, not the format's);
* :mod:`.synthetic`: synthetic loads (single Zipf loads, drifting traces).

    with TraceWriter(trace_path(dir, group), num_ranks=R, num_experts=E, meta={...}) as writer:
        writer.append(iteration, microbatch, layer, load)   # int64 [R, E]
        writer.flush_iteration(iteration)                   # durability point
    trace = read_trace(path)                                # trace.load: int64 [N, R, E]
    for group, iteration, microbatch, layer, load in TraceRecords(find_trace_files(dir)): ...

Format spec and tools: ``docs/traces.md``.
"""

from .format import (
    TRACE_SUFFIX,
    TraceFormatError,
    TraceTruncatedError,
    TraceTruncatedWarning,
    find_trace_files,
    trace_path,
)
from .reader import Trace, TraceReader, read_trace
from .records import TraceRecords, merge_traces
from .synthetic import write_synthetic_trace
from .writer import TraceWriter

__all__ = [
    "TRACE_SUFFIX",
    "Trace",
    "TraceFormatError",
    "TraceReader",
    "TraceRecords",
    "TraceTruncatedError",
    "TraceTruncatedWarning",
    "TraceWriter",
    "find_trace_files",
    "merge_traces",
    "read_trace",
    "trace_path",
    "write_synthetic_trace",
]
