"""Pieces every ``ultraep`` subcommand shares: exit codes, the trace-input, model-shape, hardware
and output flags, and progress on stderr. What the subcommands compute and print is the analysis's
and the traces' (``ultraep_megatron.analysis``, ``ultraep_megatron.traces``)."""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

#: Exit codes scripts can rely on.
EXIT_OK = 0
EXIT_FAILED = (
    1  # the command ran and found a failure: a recipe problem, a failed run, no recommendation
)
EXIT_USAGE = 2  # bad arguments or unreadable input (argparse uses 2 as well)
EXIT_INTERNAL = 3  # a bug: the traceback is printed


class CliError(Exception):
    """A problem with the command's arguments or inputs: one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    """The parser of ``ultraep`` and of every subcommand (``add_subparsers`` makes its subparsers of
    its own class): a usage error is one line, ``PROG: error: MESSAGE (see PROG --help)``, exit
    status 2 as argparse's, instead of argparse's usage block before it."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def did_you_mean(given: str, candidates, *, cutoff: float = 0.6) -> str:
    """'' or '; did you mean X?' (or 'X or Y?'): the candidates closest to ``given`` (a list of
    them is taken as already chosen when ``cutoff`` is None)."""
    import difflib

    close = (
        list(candidates)
        if cutoff is None
        else difflib.get_close_matches(given, list(candidates), n=2, cutoff=cutoff)
    )
    return f"; did you mean {' or '.join(close)}?" if close else ""


# ---------------------------------------------------------------------------------------------
# Argument types
# ---------------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (non-negative)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return values


def name_list(choices: Sequence[str]):
    """An argparse type: comma-separated names from ``choices``."""

    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {bad or 'empty list'}; choose from {','.join(choices)}"
            )
        if len(set(names)) != len(names):
            raise argparse.ArgumentTypeError(f"{text!r} names a balancer twice")
        return names

    return parse


def min_quota_arg(text: str):
    """'hw' (derived from the hardware flags) or a min quota (the planner's rule: an int >= 1)."""
    if text == "hw":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'hw' or an int >= 1, got {text!r}") from None
    setting_problem("min_quota", value, "min quota")
    return value


def setting_problem(field: str, value, name: str) -> None:
    """An argparse error, naming the setting ``name``, if ``value`` breaks the planner's rule for
    :class:`~ultraep_megatron.planner.BalancerConfig` field ``field`` (a value of a sweep)."""
    from ultraep_megatron.planner import BalancerConfig

    for problem in BalancerConfig.problems(**{field: value}):
        raise argparse.ArgumentTypeError(problem.naming(name))


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return value


def int_at_least(minimum: int):
    """An argparse type: an int >= ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum}, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    return parse


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def check_balancer_flags(args) -> None:
    """Validate the ``--moe-balancer-*`` values of ``args`` as training does (a ValueError naming the
    flag); a min quota of ``hw`` stands for a valid one."""
    from ultraep_megatron.settings.knobs import knob_values

    values = dict(vars(args))
    if values.get("moe_balancer_min_quota") == "hw":
        values["moe_balancer_min_quota"] = None
    knob_values(argparse.Namespace(**values))


# ---------------------------------------------------------------------------------------------
# Trace input
# ---------------------------------------------------------------------------------------------

TRACE_HELP = (
    "trace files or directories: the project's (--moe-balancer-trace-dir, *.uetrace, one file "
    "per EP group) or Megatron's own (--moe-routing-trace-path, router_trace_rank<r>.jsonl)"
)


def add_trace_input_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("traces", nargs="+", metavar="TRACE", help=TRACE_HELP)
    group = parser.add_argument_group("trace selection")
    group.add_argument(
        "--layers",
        type=int_list,
        default=None,
        metavar="N,N",
        help="only these layer numbers (1-based, as Megatron numbers layers)",
    )
    group.add_argument(
        "--max-records",
        type=int,
        default=None,
        metavar="N",
        help="stop after this many loads per EP group",
    )
    group.add_argument(
        "--load-scale",
        type=positive_float,
        default=1.0,
        metavar="X",
        help="multiply every load by X (project a small run onto a production microbatch "
        "size: costs scale, balance barely does)",
    )
    group.add_argument(
        "--strict",
        action="store_true",
        help="a truncated trace (a crash, or a run still writing) is an error; by default its "
        "complete part is used with a warning",
    )
    add_megatron_layout_args(parser)


def add_megatron_layout_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "Megatron routing traces (--moe-routing-trace-path)",
        "Megatron's trace has one file per rank and no layout: give the run's arguments with --run-args "
        "(its log, or its wandb config.yaml), or the flags below as in the training command.",
    )
    group.add_argument(
        "--run-args",
        type=Path,
        default=None,
        metavar="FILE",
        help="the run's log (Megatron prints its arguments at start-up), wandb config.yaml, "
        "or a JSON/YAML mapping of arguments",
    )
    group.add_argument(
        "--expert-model-parallel-size",
        type=int,
        default=None,
        metavar="EP",
        help="EP ranks per group (R)",
    )
    group.add_argument(
        "--num-experts", type=int, default=None, metavar="E", help="experts per MoE layer"
    )
    group.add_argument(
        "--num-layers",
        type=int,
        default=None,
        metavar="N",
        help="decoder layers (numbers MTP layers after them; needed with pipeline parallelism)",
    )
    group.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=None,
        metavar="PP",
        help="pipeline stages (layers split as megatron-core splits them: evenly, or with "
        "the two flags below)",
    )
    group.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        metavar="N",
        help="decoder layers of the first pipeline stage, as in the training command",
    )
    group.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        metavar="N",
        help="decoder layers of the last pipeline stage, as in the training command",
    )


def megatron_layout(args):
    """The :class:`~ultraep_megatron.traces.router_layout.RouterTraceLayout` from ``--run-args`` and the layout flags."""
    from ultraep_megatron.traces.router_layout import RouterTraceLayout, read_run_args

    run_args = None
    if args.run_args is not None:
        if not args.run_args.is_file():
            raise CliError(
                f"--run-args {args.run_args}: no such file; give the run's log (Megatron prints its "
                "arguments at start-up), its wandb config.yaml or a JSON/YAML mapping of them"
            )
        try:
            run_args = read_run_args(args.run_args)
        except ValueError as error:
            raise CliError(f"--run-args {error}") from None
    try:
        return RouterTraceLayout.resolve(
            ep_size=args.expert_model_parallel_size,
            num_experts=args.num_experts,
            num_layers=args.num_layers,
            pp_size=args.pipeline_model_parallel_size,
            first_stage_layers=args.decoder_first_pipeline_num_layers,
            last_stage_layers=args.decoder_last_pipeline_num_layers,
            run_args=run_args,
        )
    except ValueError as error:
        raise CliError(str(error)) from None


def open_records(args):
    """The replay records named by the trace arguments (project traces or a Megatron routing trace),
    with ``--layers/--max-records/--load-scale`` applied."""
    from ultraep_megatron import traces
    from ultraep_megatron.traces.router import RouterTraceRecords, is_router_trace

    chosen = dict(layers=args.layers, max_records=args.max_records, load_scale=args.load_scale)
    on_truncated = "error" if args.strict else "warn"
    if is_router_trace(args.traces):
        return RouterTraceRecords(
            args.traces[0], megatron_layout(args), on_truncated=on_truncated, **chosen
        )
    for path in args.traces:
        if (
            Path(path).is_dir()
            and not list(Path(path).glob(f"*{traces.TRACE_SUFFIX}"))
            and list(Path(path).glob("*.jsonl"))
        ):
            raise CliError(
                f"{path}: JSONL files but no router_trace_rank<r>.jsonl (is it Megatron's "
                "--moe-routing-trace-path directory?)"
            )
    if args.run_args is not None:
        raise CliError(
            "--run-args is for Megatron's routing traces; the project's traces carry their layout"
        )
    records = traces.TraceRecords(
        traces.find_trace_files(args.traces), on_truncated=on_truncated, **chosen
    )
    for flag, value in (
        ("expert_model_parallel_size", records.num_ranks),
        ("num_experts", records.num_experts),
    ):
        if getattr(args, flag) is not None and getattr(args, flag) != value:
            raise CliError(
                f"--{flag.replace('_', '-')} {getattr(args, flag)} contradicts the trace ({value})"
            )
    return records


# ---------------------------------------------------------------------------------------------
# Model shape and hardware (the cost model's inputs)
# ---------------------------------------------------------------------------------------------


def add_model_hardware_args(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group(
        "model shape (default: the trace's meta or --run-args, else a Qwen3-235B-A22B expert)"
    )
    model.add_argument("--hidden-size", type=int, default=None)
    model.add_argument("--moe-ffn-hidden-size", type=int, default=None)
    model.add_argument(
        "--swiglu",
        dest="swiglu",
        action="store_true",
        default=None,
        help="gated experts (3 matrices)",
    )
    model.add_argument(
        "--no-swiglu", dest="swiglu", action="store_false", help="plain 2-matrix experts"
    )
    model.add_argument(
        "--param-bytes", type=int, default=None, help="bytes per weight moved to replicas (2)"
    )
    model.add_argument(
        "--grad-bytes", type=int, default=None, help="bytes per gradient reduced (4, fp32)"
    )
    model.add_argument(
        "--activation-bytes", type=int, default=None, help="bytes per token element on the wire (2)"
    )
    hw = parser.add_argument_group(
        "hardware (default: --moe-balancer-hardware's preset, else the UltraEP paper's rack, Table 2; "
        "each flag given overrides it)"
    )
    hw.add_argument(
        "--scale-up-bandwidth",
        type=positive_float,
        default=None,
        metavar="GBPS",
        help="GB/s per GPU (900)",
    )
    hw.add_argument(
        "--peak-tflops",
        type=positive_float,
        default=None,
        metavar="TFLOPS",
        help="bf16 TFLOP/s per GPU (2250)",
    )
    hw.add_argument(
        "--hbm-bandwidth",
        type=positive_float,
        default=None,
        metavar="TBPS",
        help="TB/s per GPU (8)",
    )
    hw.add_argument(
        "--compute-efficiency",
        type=float,
        default=None,
        help="achieved fraction of peak FLOP/s (1)",
    )
    hw.add_argument(
        "--comm-efficiency",
        type=float,
        default=None,
        help="achieved fraction of scale-up bandwidth (1)",
    )
    hw.add_argument(
        "--scale-up-domain",
        type=int,
        default=None,
        metavar="N",
        help="GPUs per scale-up (NVLink) domain, as consecutive EP ranks: traffic between domains "
        "moves at --inter-domain-bandwidth (default: the preset's, else "
        "--moe-balancer-domain-size where given, else the whole EP group)",
    )
    hw.add_argument(
        "--inter-domain-bandwidth",
        type=positive_float,
        default=None,
        metavar="GBPS",
        help="GB/s per GPU between scale-up domains (50: 400 Gb/s)",
    )
    hw.add_argument(
        "--gemm-overhead-tokens",
        type=float,
        default=None,
        metavar="M0",
        help="fixed cost of one expert GEMM in tokens: M tokens run at M / (M + M0) of the "
        "plateau rate (100, from DeepGEMM's published grouped GEMMs; docs/traces.md)",
    )
    hw.add_argument(
        "--plan-time-us",
        type=float,
        default=None,
        help="charge this plan time (us), measured on the hardware estimated, to the exact-load "
        "balancers (default: the plan term left out, and the estimate says so: the time measured "
        "here is this host's CPU, not the GPU estimated; the paper's GPU solver takes ~111 us, "
        "ultraep's host planner 520 us per layer on an H200 node's host)",
    )
    hw.add_argument(
        "--transfer-overlap",
        type=fraction,
        default=None,
        metavar="F",
        help="fraction of its overlap window a replica transfer hides: 1 (default) is the "
        "runtime's schedule on a GPU, transfers on their own stream next to the token "
        "all-to-all and expert compute; 0 serializes them (--moe-balancer-no-overlap)",
    )
    hw.add_argument(
        "--no-relay",
        action="store_true",
        help="charge weight distribution without relay trees (both are always reported)",
    )


#: Hardware flags (argparse dest) -> the Hardware field they override.
HARDWARE_FLAGS = {
    "scale_up_bandwidth": "scale_up_gbps",
    "peak_tflops": "peak_tflops",
    "hbm_bandwidth": "hbm_tbps",
    "compute_efficiency": "compute_efficiency",
    "comm_efficiency": "comm_efficiency",
    "transfer_overlap": "transfer_overlap",
    "scale_up_domain": "scale_up_domain",
    "inter_domain_bandwidth": "inter_domain_gbps",
    "gemm_overhead_tokens": "gemm_overhead_tokens",
}


def apply_traced_run_settings(args, records) -> str:
    """Fill ``--moe-balancer-hardware`` and ``--moe-balancer-domain-size`` the user left out from the
    traced run (the project's trace meta, or a Megatron trace's ``--run-args``), and, for a named
    hardware whose NVLink domain is smaller than the trace's EP group (an HGX node), the domain size
    from it, as the HGX recipes train. Returns where the hardware comes from, for the report."""
    from ultraep_megatron.settings.hardware import hardware_preset

    meta = records.meta
    if args.moe_balancer_hardware is not None:
        where = f"{args.moe_balancer_hardware} (--moe-balancer-hardware)"
    elif meta.get("hardware"):
        args.moe_balancer_hardware = str(meta["hardware"])
        where = f"{args.moe_balancer_hardware} (the traced run's --moe-balancer-hardware)"
    else:
        where = (
            "none named, the default: the UltraEP paper's GB200-class rack (Table 2); name yours with "
            "--moe-balancer-hardware h100-hgx, h200-hgx or paper-rack"
        )
    if args.moe_balancer_domain_size is None:
        if meta.get("domain_size"):
            args.moe_balancer_domain_size = int(meta["domain_size"])
        elif args.moe_balancer_hardware is not None:
            try:
                domain = hardware_preset(args.moe_balancer_hardware).scale_up_domain
            except ValueError as error:
                raise CliError(str(error)) from None
            if domain and domain < records.num_ranks and records.num_ranks % domain == 0:
                args.moe_balancer_domain_size = domain
                where += f"; --moe-balancer-domain-size {domain}, its NVLink domain"
    return where


def shape_and_hardware(args, meta: dict):
    """(ExpertShape, where h and f came from, Hardware) from the flags and the trace's meta
    (``analysis.inputs.resolve_hardware``: ``--moe-balancer-hardware``'s preset, else the paper's
    rack, with the hardware flags given on top)."""
    from ultraep_megatron.settings.hardware import ExpertShape
    from ultraep_megatron.analysis.inputs import resolve_hardware

    try:
        shape, source = ExpertShape.from_meta(
            meta,
            hidden_size=args.hidden_size,
            ffn_hidden_size=args.moe_ffn_hidden_size,
            gated=args.swiglu,
            param_bytes=args.param_bytes,
            grad_bytes=args.grad_bytes,
            activation_bytes=args.activation_bytes,
        )
        given = {
            field: getattr(args, flag)
            for flag, field in HARDWARE_FLAGS.items()
            if getattr(args, flag, None) is not None
        }
        hardware = resolve_hardware(
            getattr(args, "moe_balancer_hardware", None),
            given,
            getattr(args, "moe_balancer_domain_size", None),
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return shape, source, hardware


def plan_seconds(args) -> Optional[float]:
    """The plan time an estimate charges: ``--plan-time-us`` (for the hardware estimated), else 0:
    the plan term left out, never the time measured on this machine (a CPU) in a GPU's estimate."""
    return 0.0 if args.plan_time_us is None else args.plan_time_us * 1e-6


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def add_output_args(parser: argparse.ArgumentParser, *, files: str) -> argparse._ArgumentGroup:
    group = parser.add_argument_group("output")
    group.add_argument(
        "--json",
        action="store_true",
        help="print the results as one JSON document on stdout instead of the report",
    )
    group.add_argument(
        "--output-dir", type=Path, default=None, metavar="DIR", help=f"write {files} here"
    )
    group.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return group


def prepare_output_dir(
    path: Optional[Path], name: str = "--output-dir", *, announce: bool = True
) -> Optional[Path]:
    """Create ``path`` (saying so on stderr, naming it as the argument ``name`` the user gave) and
    check, by writing a file there, that the outputs can be written, before any long work (None
    passes through)."""
    if path is None:
        return None
    created = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise CliError(f"{name} {path}: {exc.strerror or exc}") from None
    if created and announce:
        print(f"created {name} {path}", file=sys.stderr)
    return path


@contextlib.contextmanager
def output_dir_undone_on_failure(path: Path, name: str):
    """:func:`prepare_output_dir` for a command whose output is all or nothing (``trace merge``,
    ``trace convert``): when the body fails, the files it added to ``path`` and the directories made
    for it are removed again, so a failed command leaves no empty or half-written output behind."""
    made = [d for d in (path, *path.parents) if not d.exists()]  # innermost first
    before = set(path.iterdir()) if path.is_dir() else set()
    prepare_output_dir(path, name, announce=False)
    try:
        yield path
    except BaseException:
        for item in set(path.iterdir()) - before:
            if item.is_file() or item.is_symlink():
                item.unlink()
        for directory in made:
            try:
                directory.rmdir()
            except OSError:  # not empty: something else wrote there meanwhile
                break
        raise
    if made:
        print(f"created {name} {path}", file=sys.stderr)


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line every few seconds otherwise.

    ``progress(done)`` after each unit of work; ``total`` (if known) gives percent and ETA.
    """

    def __init__(
        self,
        label: str,
        total: int = 0,
        *,
        enabled: bool = True,
        unit: str = "records",
        stream=None,
    ):
        self.label, self.total, self.enabled, self.unit = label, int(total), enabled, unit
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.start = self.last = time.perf_counter()
        self.done = 0

    def __call__(self, done: int) -> None:
        self.done = done
        now = time.perf_counter()
        if not self.enabled or now - self.last < (0.2 if self.tty else 5.0):
            return
        self.last = now
        self._draw(now - self.start)

    def _draw(self, elapsed: float, end: str = "") -> None:
        done, total = self.done, self.total
        if total:
            share = min(done / total, 1.0)
            rate = done / elapsed if elapsed > 0 else 0.0
            eta = f", ETA {(total - done) / rate:.0f} s" if rate > 0 and done < total else ""
            bar = "#" * int(share * 24)
            text = f"[{self.label}] [{bar:<24}] {share:4.0%} {done}/{total} {self.unit}, {elapsed:.0f} s{eta}"
        else:
            text = f"[{self.label}] {done} {self.unit}, {elapsed:.0f} s"
        self.stream.write(("\r" + text + end) if self.tty else (text + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.perf_counter() - self.start, end="\n" if self.tty else "")


def progress_for(args, label: str, records=None, unit: str = "records") -> Progress:
    """A progress bar for ``records`` (counted up front when it says how many it holds)."""
    enabled = not getattr(args, "no_progress", False)
    total = records.total if (enabled and records is not None and hasattr(records, "total")) else 0
    return Progress(label, total, enabled=enabled, unit=unit)
