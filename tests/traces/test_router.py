"""Megatron's routing traces as loads, on files written by megatron-core's own RouterTracer (its
``record_indices`` + ``advance_step``, what the training loop drives): grouping into EP groups,
iterations, microbatches and layer numbers (decoder, MTP, pipeline stages) against histograms
computed here, the run's arguments from its log or wandb config, and the errors on truncated,
mixed or inconsistent files."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.router_trace import RouterTracer

from ultraep_megatron import traces
from ultraep_megatron.traces.router import RouterTraceRecords, convert_router_trace
from ultraep_megatron.traces.router_layout import RouterTraceLayout, read_run_args

E, TOKENS, TOPK = 8, 12, 2


def top_indices(rank: int, step: int, microbatch: int, key: tuple, seed: int = 0) -> torch.Tensor:
    """Deterministic, rank- and layer-dependent top-k ids [TOKENS, TOPK] (distinct per token)."""
    rng = np.random.default_rng([seed, rank, step, microbatch, sum(map(ord, str(key)))])
    weights = rng.dirichlet(np.ones(E) * 0.5)
    return torch.tensor(
        np.stack([rng.choice(E, TOPK, replace=False, p=weights) for _ in range(TOKENS)])
    )


def write_run(
    directory: Path,
    *,
    world: int,
    steps: int,
    microbatches: int,
    keys,
    start_step: int = 0,
    seed: int = 0,
) -> dict:
    """Write a run's trace with megatron's RouterTracer, one tracer per rank, calls in the training
    order (microbatch-major). Returns {(rank, step, microbatch, key): ids}."""
    written = {}
    for rank in range(world):
        tracer = RouterTracer(str(directory), max_steps=10_000, rank=rank, training_mode=True)
        for step in range(start_step, start_step + steps):
            for mb in range(microbatches):
                for key in keys:
                    block, mtp_idx, layer = key
                    ids = top_indices(rank, step, mb, key, seed)
                    written[(rank, step, mb, key)] = ids
                    tracer.record_indices([ids], layer_ids=[layer], block=block, mtp_idx=mtp_idx)
            tracer.advance_step(step)
        tracer.flush()
    return written


def histogram(ids: torch.Tensor) -> np.ndarray:
    return np.bincount(ids.numpy().ravel(), minlength=E)


DECODER = [("decoder", None, 0), ("decoder", None, 1)]
MTP = [("mtp", 0, 0)]


def test_loads_per_ep_group_microbatch_and_layer(tmp_path):
    written = write_run(
        tmp_path, world=4, steps=2, microbatches=2, keys=DECODER + MTP, start_step=5
    )
    layout = RouterTraceLayout.resolve(ep_size=2, num_experts=E, num_layers=6)
    records = list(RouterTraceRecords(tmp_path, layout, on_truncated="error"))
    assert len(records) == 2 * 2 * 2 * 3  # groups x steps x microbatches x layers
    layer_of = {DECODER[0]: 1, DECODER[1]: 2, MTP[0]: 7}  # decoder n -> n + 1; MTP head 0 -> 6 + 1
    seen = set()
    for group, iteration, microbatch, layer, load in records:
        key = next(k for k, v in layer_of.items() if v == layer)
        expected = np.stack(
            [histogram(written[(group * 2 + r, iteration - 1, microbatch, key)]) for r in range(2)]
        )
        assert np.array_equal(load.numpy(), expected)
        assert load.dtype == torch.int64 and int(load.sum()) == 2 * TOKENS * TOPK
        seen.add((group, iteration, microbatch, layer))
    assert {it for _, it, _, _ in seen} == {6, 7}  # step + 1: Megatron's logged iteration
    assert len(seen) == len(records)
    # Training order within a group and step: microbatch-major, layers in call order.
    first = [(r[2], r[3]) for r in records if r[0] == 0 and r[1] == 6]
    assert first == [(0, 1), (0, 2), (0, 7), (1, 1), (1, 2), (1, 7)]
    # Selection and totals for progress.
    selected = RouterTraceRecords(tmp_path, layout, layers=[2], max_records=3)
    picked = list(selected)
    assert [r[3] for r in picked] == [2] * 6 and selected.total == 6  # 3 per EP group


def test_pipeline_stages_number_their_layers(tmp_path):
    write_run(tmp_path, world=4, steps=1, microbatches=1, keys=DECODER)
    layout = RouterTraceLayout.resolve(ep_size=2, num_experts=E, num_layers=4, pp_size=2)
    layers = {(g, layer) for g, _, _, layer, _ in RouterTraceRecords(tmp_path, layout)}
    assert layers == {(0, 1), (0, 2), (1, 3), (1, 4)}  # stage 1 (ranks 2-3) holds layers 3-4
    with pytest.raises(ValueError, match="--num-layers"):
        RouterTraceRecords(tmp_path, RouterTraceLayout.resolve(ep_size=2, num_experts=E, pp_size=2))
    mtp_dir = tmp_path / "mtp"
    write_run(mtp_dir, world=2, steps=1, microbatches=1, keys=MTP)
    with pytest.raises(ValueError, match="MTP records: give --num-layers"):
        list(RouterTraceRecords(mtp_dir, RouterTraceLayout.resolve(ep_size=2, num_experts=E)))


def test_the_runs_arguments_from_its_log_or_wandb_config(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text(
        "[rank0]: starting\n------------------------ arguments ------------------------\n"
        "  expert_model_parallel_size ...................... 2\n"
        "  global_batch_size ............................... 8\n"
        "  hidden_size ..................................... 64\n"
        "  micro_batch_size ................................ 2\n"
        "  data_parallel_size .............................. 2\n"
        "  num_experts ..................................... 8\n"
        "  num_layers ...................................... 2\n"
        "  rampup_batch_size ............................... None\n"
        "  swiglu .......................................... True\n"
        "  world_size ...................................... 4\n"
        "-------------------- end of arguments ---------------------\n"
    )
    args = read_run_args(log)
    assert (args["expert_model_parallel_size"], args["swiglu"], args["rampup_batch_size"]) == (
        2,
        True,
        None,
    )
    layout = RouterTraceLayout.resolve(run_args=args)
    assert (layout.ep_size, layout.num_experts, layout.num_microbatches, layout.world_size) == (
        2,
        8,
        2,
        4,
    )
    assert layout.meta["hidden_size"] == 64 and layout.meta["swiglu"] is True
    wandb_config = tmp_path / "config.yaml"
    wandb_config.write_text(
        "_wandb:\n  value: {}\nexpert_model_parallel_size:\n  value: 2\nnum_experts:\n  value: 8\n"
    )
    assert RouterTraceLayout.resolve(run_args=read_run_args(wandb_config)).ep_size == 2
    with pytest.raises(ValueError, match="--expert-model-parallel-size 4 contradicts"):
        RouterTraceLayout.resolve(ep_size=4, run_args=args)
    with pytest.raises(ValueError, match="give --num-experts"):
        RouterTraceLayout.resolve(ep_size=2)
    with pytest.raises(ValueError, match="multiple of --expert-model-parallel-size"):
        RouterTraceLayout.resolve(ep_size=3, num_experts=E)
    (tmp_path / "notes.txt").write_text("just words\n")
    with pytest.raises(ValueError, match="neither a Megatron log"):
        read_run_args(tmp_path / "notes.txt")
    # The microbatch count is checked: a step with an eval forward recorded into it is refused.
    write_run(tmp_path / "run", world=4, steps=1, microbatches=3, keys=DECODER)
    with pytest.raises(traces.TraceFormatError, match="3 router calls .* 2 microbatches per step"):
        list(RouterTraceRecords(tmp_path / "run", layout))


def test_truncated_traces_keep_their_complete_steps(tmp_path):
    write_run(tmp_path, world=2, steps=3, microbatches=1, keys=DECODER)
    layout = RouterTraceLayout.resolve(ep_size=2, num_experts=E)
    whole = list(RouterTraceRecords(tmp_path, layout))
    rank1 = tmp_path / "router_trace_rank1.jsonl"
    blob = rank1.read_bytes()
    rank1.write_bytes(blob[:-40])  # a torn last line: step 2 incomplete on rank 1
    with pytest.warns(traces.TraceTruncatedWarning, match="steps from 2 on are left out"):
        kept = RouterTraceRecords(tmp_path, layout)
        records = list(kept)
    assert kept.status == "truncated" and len(records) == 4
    assert all(torch.equal(a[4], b[4]) and a[:4] == b[:4] for a, b in zip(records, whole))
    with pytest.raises(traces.TraceTruncatedError):
        list(RouterTraceRecords(tmp_path, layout, on_truncated="error"))
    # Whole lines, but the last step's records stop early on one rank (a crash between lines).
    lines = blob.splitlines(keepends=True)
    rank1.write_bytes(b"".join(lines[:-1]))
    with pytest.warns(traces.TraceTruncatedWarning, match="last step is incomplete"):
        assert len(list(RouterTraceRecords(tmp_path, layout))) == 4
    # A rank that stopped a whole step early.
    rank1.write_bytes(b"".join(lines[:-2]))
    with pytest.warns(traces.TraceTruncatedWarning, match=r"ends early on ranks \[1\]"):
        assert len(list(RouterTraceRecords(tmp_path, layout))) == 4


def test_mixed_and_foreign_files_are_refused(tmp_path):
    layout = RouterTraceLayout.resolve(ep_size=2, num_experts=E)
    write_run(tmp_path / "a", world=2, steps=3, microbatches=1, keys=DECODER)
    rank1 = tmp_path / "a" / "router_trace_rank1.jsonl"
    lines = rank1.read_bytes().splitlines(keepends=True)
    # A middle step missing on one rank while it has later steps.
    rank1.write_bytes(b"".join(lines[:2] + lines[4:]))
    with pytest.raises(traces.TraceFormatError, match="step 1 is missing on ranks \\[1\\]"):
        list(RouterTraceRecords(tmp_path / "a", layout))
    # Steps going backwards (two runs appended to one file).
    rank1.write_bytes(b"".join(lines + lines))
    with pytest.raises(traces.TraceFormatError, match="step 0 after step 2"):
        list(RouterTraceRecords(tmp_path / "a", layout))
    # Another rank's records in a rank's file, a missing rank file, expert ids out of range.
    write_run(tmp_path / "b", world=2, steps=1, microbatches=1, keys=DECODER)
    (tmp_path / "b" / "router_trace_rank1.jsonl").write_bytes(
        (tmp_path / "b" / "router_trace_rank0.jsonl").read_bytes()
    )
    with pytest.raises(traces.TraceFormatError, match="a record of rank 0 in rank 1's file"):
        list(RouterTraceRecords(tmp_path / "b", layout))
    write_run(tmp_path / "c", world=3, steps=1, microbatches=1, keys=DECODER)
    (tmp_path / "c" / "router_trace_rank1.jsonl").unlink()
    with pytest.raises(traces.TraceFormatError, match="missing for ranks \\[1\\]"):
        RouterTraceRecords(tmp_path / "c", layout)
    write_run(tmp_path / "d", world=2, steps=1, microbatches=1, keys=DECODER)
    with pytest.raises(traces.TraceFormatError, match="check --num-experts"):
        list(
            RouterTraceRecords(tmp_path / "d", RouterTraceLayout.resolve(ep_size=2, num_experts=4))
        )
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "router_trace_rank0.jsonl").write_text("not json\n")
    with pytest.raises(traces.TraceFormatError, match="not a router trace record"):
        list(
            RouterTraceRecords(tmp_path / "e", RouterTraceLayout.resolve(ep_size=1, num_experts=E))
        )
    with pytest.raises(traces.TraceFormatError, match="not a whole number of EP groups"):
        RouterTraceRecords(tmp_path / "a", RouterTraceLayout.resolve(ep_size=4, num_experts=E))


def test_convert_writes_the_projects_traces(tmp_path):
    write_run(tmp_path / "m", world=4, steps=2, microbatches=2, keys=DECODER)
    layout = RouterTraceLayout.resolve(ep_size=2, num_experts=E)
    source = RouterTraceRecords(tmp_path / "m", layout)
    done = []
    files = convert_router_trace(source, tmp_path / "out", progress=done.append)
    assert [f.name for f in files] == ["ep_group_0000.uetrace", "ep_group_0002.uetrace"]
    assert done[-1] == source.total == 16
    converted = list(traces.TraceRecords(files))
    original = list(RouterTraceRecords(tmp_path / "m", layout))
    assert len(converted) == len(original)
    for a, b in zip(sorted(converted, key=lambda r: r[:4]), sorted(original, key=lambda r: r[:4])):
        assert a[:4] == b[:4] and torch.equal(a[4], b[4])
    header = traces.TraceReader(files[1]).meta
    assert header["first_global_rank"] == 2 and header["source"].startswith("megatron")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a complete trace converts without a warning
        convert_router_trace(RouterTraceRecords(tmp_path / "m", layout), tmp_path / "again")


def write_pipeline_run(
    directory: Path,
    *,
    ep: int,
    stage_layers: list[int],
    microbatches: int,
    steps: int = 1,
    recompute: bool = False,
    num_experts: int = E,
    tokens: int = TOKENS,
    topk: int = TOPK,
    broken_recompute: bool = False,
) -> dict:
    """A pipelined run's trace as megatron's RouterTracer records it: ranks in blocks of one stage
    (stage = rank // (ranks per stage)), each stage's layers named by their index on the stage;
    per step the 1F1B schedule's calls: warm-up forwards, then a forward and a backward alternately,
    then the cool-down backwards; a forward routes the stage's layers in order, a backward (with
    ``recompute``) routes them again in reverse, exactly as the forward did (``broken_recompute``:
    as the next microbatch's forward did). Returns {(rank, step, microbatch, layer index): ids}."""
    pp = len(stage_layers)
    world = ep * pp
    rng = np.random.default_rng(7)
    written = {}
    for rank in range(world):
        stage = rank // ep
        tracer = RouterTracer(str(directory), max_steps=10_000, rank=rank, training_mode=True)
        for step in range(steps):
            ids = {
                (mb, layer): torch.tensor(
                    np.stack([rng.choice(num_experts, topk, replace=False) for _ in range(tokens)])
                )
                for mb in range(microbatches)
                for layer in range(stage_layers[stage])
            }
            written.update({(rank, step, mb, layer): v for (mb, layer), v in ids.items()})
            warmup = min(pp - stage - 1, microbatches)
            events = ["F"] * warmup + ["F", "B"] * (microbatches - warmup) + ["B"] * warmup
            forward = backward = 0
            for event in events:
                if event == "F":
                    for layer in range(stage_layers[stage]):
                        tracer.record_indices([ids[(forward, layer)]], layer_ids=[layer])
                    forward += 1
                    continue
                if recompute:
                    again = min(backward + 1, microbatches - 1) if broken_recompute else backward
                    for layer in reversed(range(stage_layers[stage])):
                        tracer.record_indices([ids[(again, layer)]], layer_ids=[layer])
                backward += 1
            tracer.advance_step(step)
        tracer.flush()
    return written


def test_an_uneven_first_stage_is_numbered_as_megatron_numbers_it(tmp_path):
    """Issue 45: decoder_first_pipeline_num_layers 12 in the run's arguments (28 layers on 2
    stages): stage 1's layers are 13-28, as megatron-core's get_transformer_layer_offset numbers
    them (tests/traces/test_pipeline.py), not 15-30 (the even split's offset)."""
    written = write_pipeline_run(tmp_path, ep=2, stage_layers=[12, 16], microbatches=1)
    run_args = {
        "expert_model_parallel_size": 2,
        "num_experts": E,
        "num_layers": 28,
        "pipeline_model_parallel_size": 2,
        "decoder_first_pipeline_num_layers": 12,
        "decoder_last_pipeline_num_layers": None,
    }
    records = list(RouterTraceRecords(tmp_path, RouterTraceLayout.resolve(run_args=run_args)))
    layers = {g: sorted(layer for group, _, _, layer, _ in records if group == g) for g in (0, 1)}
    assert layers == {0: list(range(1, 13)), 1: list(range(13, 29))}
    for group, _, microbatch, layer, load in records:
        index = layer - 1 - (12 if group else 0)
        expected = np.stack(
            [histogram(written[(group * 2 + r, 0, microbatch, index)]) for r in range(2)]
        )
        assert np.array_equal(load.numpy(), expected)
    # The same through flags; and a split that cannot be says so instead of "need --num-layers".
    flagged = RouterTraceLayout.resolve(
        ep_size=2, num_experts=E, num_layers=28, pp_size=2, first_stage_layers=12
    )
    assert [r[3] for r in RouterTraceRecords(tmp_path, flagged)] == [r[3] for r in records]
    with pytest.raises(
        ValueError,
        match=r"^--num-layers 27 does not split evenly over "
        r"--pipeline-model-parallel-size 2 stages, so the run must have split "
        r"them otherwise: give its --decoder-first-pipeline-num-layers",
    ):
        RouterTraceLayout.resolve(ep_size=2, num_experts=E, num_layers=27, pp_size=2)
    # A layout that builds fewer layers on a stage than the trace names is refused, not mislabelled.
    short = RouterTraceLayout.resolve(
        ep_size=2, num_experts=E, num_layers=20, pp_size=2, first_stage_layers=12
    )
    with pytest.raises(
        traces.TraceFormatError, match="decoder layer index 8 on pipeline stage 1, which builds 8"
    ):
        list(RouterTraceRecords(tmp_path, short))


@pytest.mark.parametrize("pp", [1, 3])
def test_moe_recompute_calls_are_dropped_by_the_1f1b_schedule(tmp_path, pp):
    """With --recompute-modules moe each layer's router runs again in every microbatch's backward:
    2M calls per step. The forwards are picked by the 1F1B schedule of the rank's stage and the
    loads are theirs (each once); a backward call that does not repeat its forward is refused.
    Without the recompute in the run's arguments, 2M calls are not M microbatches: refused."""
    M = 3
    written = write_pipeline_run(
        tmp_path / "run", ep=2, stage_layers=[2] * pp, microbatches=M, steps=2, recompute=True
    )
    run_args = {
        "expert_model_parallel_size": 2,
        "num_experts": E,
        "num_layers": 2 * pp,
        "pipeline_model_parallel_size": pp,
        "global_batch_size": M * 2,
        "micro_batch_size": 1,
        "data_parallel_size": 2,
        "recompute_granularity": "selective",
        "recompute_modules": ["moe"],
    }
    records = list(
        RouterTraceRecords(
            tmp_path / "run", RouterTraceLayout.resolve(run_args=run_args), on_truncated="error"
        )
    )
    assert len(records) == pp * 2 * M * 2  # groups x steps x microbatches x layers on a stage
    for group, iteration, microbatch, layer, load in records:
        index = (layer - 1) % 2
        expected = np.stack(
            [
                histogram(written[(group * 2 + r, iteration - 1, microbatch, index)])
                for r in range(2)
            ]
        )
        assert np.array_equal(load.numpy(), expected), (group, iteration, microbatch, layer)
    plain = {k: v for k, v in run_args.items() if not k.startswith("recompute")}
    with pytest.raises(
        traces.TraceFormatError,
        match=f"{2 * M} router calls on rank 0, the run has {M} microbatches per step",
    ):
        list(RouterTraceRecords(tmp_path / "run", RouterTraceLayout.resolve(run_args=plain)))
    write_pipeline_run(
        tmp_path / "broken",
        ep=2,
        stage_layers=[2] * pp,
        microbatches=M,
        recompute=True,
        broken_recompute=True,
    )
    with pytest.raises(traces.TraceFormatError, match="routes differently from its forward"):
        list(RouterTraceRecords(tmp_path / "broken", RouterTraceLayout.resolve(run_args=run_args)))
    with pytest.raises(ValueError, match="recomputes its MoE layers"):
        RouterTraceLayout.resolve(
            run_args={k: v for k, v in run_args.items() if k != "global_batch_size"}
        )


#: The Qwen3 HGX recipe's layout until issue 44 (Megatron-Bridge's interleaved TP2 x PP8 (VP4) layout
#: since): PP4 as 23/24/24/23, EP32, MoE recompute, on 16 nodes. Megatron names a virtual pipeline's
#: layers in its trace by their virtual stage, which the reader refuses (RouterTraceLayout).
PP4_LAYOUT = {
    "--tensor-model-parallel-size": "1",
    "--pipeline-model-parallel-size": "4",
    "--decoder-first-pipeline-num-layers": "23",
    "--decoder-last-pipeline-num-layers": "23",
    "--recompute-granularity": "selective",
    "--recompute-modules": "moe",
}
PP4_DROPPED = (
    "--sequence-parallel",
    "--num-virtual-stages-per-pipeline-rank",
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
    "--overlap-moe-expert-parallel-comm",
    "--delay-wgrad-compute",
)


def pp4_layout(args: list[str]) -> list[str]:
    """``args`` with :data:`PP4_DROPPED` removed and :data:`PP4_LAYOUT` set (appended: megatron takes
    a flag's last value)."""
    out, skip = [], False
    for i, token in enumerate(args):
        if skip:
            skip = False
            continue
        if token in PP4_DROPPED:
            skip = token == "--num-virtual-stages-per-pipeline-rank"  # the only one with a value
            continue
        out.append(token)
    return out + [token for flag, value in PP4_LAYOUT.items() for token in (flag, value)]


def test_a_trace_of_the_qwen3_hgx_recipe_model_in_a_pp4_layout_replays(tmp_path, capsys):
    """Issue 45: a megatron-native trace of recipes/qwen3_235b_a22b_ep32_pp8_hgx.sh's model in
    :data:`PP4_LAYOUT` (94 layers on PP4 as 23/24/24/23, EP32, MoE recompute), the run's log being
    what Megatron prints for that launch (the checker's validation of it, global batch cut to 2
    microbatches): every stage's layers are numbered as megatron-core's own functions number them,
    each layer and microbatch is one load, and `ultraep trace info` and `ultraep replay` read it."""
    import json

    from ultraep_megatron.cli import main
    from ultraep_megatron.megatron import recipe_check
    from ultraep_megatron.megatron.recipe_check.memory import stage_layers

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "qwen3_235b_a22b_ep32_pp8_hgx.sh"
    launch = recipe_check.capture_launch(
        recipe, {"GLOBAL_BATCH_SIZE": "64", "DISPATCHER": "alltoall", "NNODES": "16"}
    )
    args, printed = recipe_check.validate_arguments(pp4_layout(launch.args), launch.world_size)
    log = tmp_path / "log.txt"
    log.write_text(printed)
    assert "------------------------ arguments ------------------------" in printed
    stages = [list(s) for s in stage_layers(args)]  # megatron-core's own numbering
    assert [len(s) for s in stages] == [23, 24, 24, 23]
    M = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    assert (args.expert_model_parallel_size, args.pipeline_model_parallel_size, M) == (32, 4, 2)
    write_pipeline_run(
        tmp_path / "trace",
        ep=32,
        stage_layers=[len(s) for s in stages],
        microbatches=M,
        recompute=True,
        num_experts=128,
        tokens=2,
        topk=8,
    )

    assert main(["trace", "info", str(tmp_path / "trace"), "--run-args", str(log), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)["traces"][0]
    assert info["ep_groups"] == 4 and info["status"] == "complete"
    assert info["layers"] == {str(n): M for n in range(1, 95)}
    records = RouterTraceRecords(
        tmp_path / "trace", RouterTraceLayout.resolve(run_args=read_run_args(log))
    )
    by_group = {}
    for group, _, _, layer, load in records:
        by_group.setdefault(group, set()).add(layer)
        assert int(load.sum()) == 32 * 2 * 8
    assert [sorted(by_group[g]) for g in range(4)] == stages  # EP group g is pipeline stage g
    assert (
        main(
            [
                "replay",
                str(tmp_path / "trace"),
                "--run-args",
                str(log),
                "--balancers",
                "none,ultraep",
                "--no-cost",
                "--no-peers",
                "--no-staleness",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "ultraep" in capsys.readouterr().out
