"""``ultraep trace`` (``cli/trace.py``): synth, info (text and JSON) and merge of a run traced in
two pieces; a failed merge leaves nothing behind; synth refuses to overwrite and out-of-range
values; info counts a truncated trace as replay does."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from ultraep_megatron import traces
from ultraep_megatron.cli import main
from ultraep_megatron.cli.common import EXIT_OK, EXIT_USAGE


def test_trace_synth_info_and_merge(tmp_path, capsys):
    out = tmp_path / "s.uetrace"
    assert (
        main(
            [
                "trace",
                "synth",
                str(out),
                "--num-iterations",
                "4",
                "--num-layers",
                "2",
                "--num-ranks",
                "2",
                "--num-experts",
                "4",
            ]
        )
        == EXIT_OK
    )
    assert main(["trace", "info", str(out)]) == EXIT_OK
    printed = capsys.readouterr().out
    assert (
        "R=2, E=4, status=closed" in printed
        and "16 loads in 4 iterations, layers [1, 2]" in printed
    )
    assert main(["trace", "info", str(out), "--json"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)["traces"][0]
    assert (info["loads"], info["iterations"], info["status"]) == (16, 4, "closed")

    # A run traced in two pieces (a resume into a new directory) merges back into the whole.
    whole = traces.read_trace(out)
    pieces = []
    for n, its in enumerate(((1, 2), (3, 4))):
        path = traces.trace_path(tmp_path / f"piece{n}", 0)
        with traces.TraceWriter(path, num_ranks=2, num_experts=4, fsync=False) as writer:
            for it in its:
                for i in np.flatnonzero(whole.iteration.numpy() == it):
                    writer.append(it, int(whole.microbatch[i]), int(whole.layer[i]), whole.load[i])
                writer.flush_iteration(it)
        pieces.append(path.parent)
    assert (
        main(
            [
                "trace",
                "merge",
                str(tmp_path / "merged"),
                str(pieces[1]),
                str(pieces[0]),
                "--no-progress",
            ]
        )
        == EXIT_OK
    )
    merged = traces.read_trace(traces.trace_path(tmp_path / "merged", 0))
    assert merged.iteration.tolist() == whole.iteration.tolist() and bool(
        (merged.load == whole.load).all()
    )
    assert (
        main(
            [
                "trace",
                "merge",
                str(tmp_path / "again"),
                str(pieces[0]),
                str(pieces[0] / "ep_group_0000.uetrace"),
                "--no-progress",
            ]
        )
        == EXIT_USAGE
    )
    assert "not after iteration" in capsys.readouterr().err


def synth(path, *extra) -> int:
    return main(
        [
            "trace",
            "synth",
            str(path),
            "--num-iterations",
            "3",
            "--num-layers",
            "2",
            "--num-ranks",
            "2",
            "--num-experts",
            "4",
            *map(str, extra),
        ]
    )


def test_a_failed_merge_leaves_nothing_and_names_output_dir(tmp_path, capsys):
    """A merge that fails (a missing input, overlapping pieces) leaves no OUTPUT_DIR behind, nor any
    directory made for it; the messages name the argument the command has (OUTPUT_DIR), never a
    --output-dir flag."""
    piece = tmp_path / "piece.uetrace"
    assert synth(piece) == EXIT_OK
    out = tmp_path / "new" / "merged"
    assert (
        main(["trace", "merge", str(out), str(tmp_path / "missing"), "--no-progress"]) == EXIT_USAGE
    )
    assert "trace path does not exist" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    assert main(["trace", "merge", str(out), str(piece), str(piece), "--no-progress"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "not after iteration" in err and "--output-dir" not in err
    assert not (tmp_path / "new").exists()
    # Into an existing directory: what the failed merge wrote goes, what was there stays.
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    assert (
        main(["trace", "merge", str(kept), str(piece), str(piece), "--no-progress"]) == EXIT_USAGE
    )
    capsys.readouterr()
    assert [p.name for p in kept.iterdir()] == ["notes.txt"]
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert (
        main(["trace", "merge", str(blocker / "merged"), str(piece), "--no-progress"]) == EXIT_USAGE
    )
    assert (
        capsys.readouterr().err.strip()
        == f"ultraep trace merge: error: OUTPUT_DIR {blocker / 'merged'}: Not a directory"
    )
    assert main(["trace", "merge", str(out), str(piece), "--no-progress"]) == EXIT_OK
    err = capsys.readouterr().err
    assert f"created OUTPUT_DIR {out}" in err and "--output-dir" not in err
    assert traces.read_trace(traces.trace_path(out, 0)).num_records == 12


def test_synth_refuses_to_overwrite_and_out_of_range_values(tmp_path, capsys):
    """An existing trace is kept unless --force, said in one line; values out of range (a negative
    skew, zero ranks, experts not a multiple of ranks) are one-line errors, and no file is written."""
    out = tmp_path / "s.uetrace"
    assert synth(out) == EXIT_OK
    capsys.readouterr()
    before = out.read_bytes()
    assert synth(out, "--seed", 7) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == f"ultraep trace synth: error: {out} exists; pass --force to overwrite it\n"
    assert out.read_bytes() == before
    assert synth(out, "--seed", 7, "--force") == EXIT_OK
    assert out.read_bytes() != before
    capsys.readouterr()
    fresh = tmp_path / "fresh.uetrace"
    for extra, flag in (
        (["--skew", "-3"], "--skew"),
        (["--drift", "-0.1"], "--drift"),
        (["--num-ranks", "0"], "--num-ranks"),
        (["--topk", "0"], "--topk"),
    ):
        with pytest.raises(SystemExit) as exc:
            synth(fresh, *extra)
        err = capsys.readouterr().err
        assert exc.value.code == EXIT_USAGE and len(err.splitlines()) == 1, err
        assert err.startswith(f"ultraep trace synth: error: argument {flag}: expected "), err
    assert synth(fresh, "--num-experts", "5") == EXIT_USAGE
    assert capsys.readouterr().err == (
        "ultraep trace synth: error: --num-experts 5 must be a multiple of --num-ranks 2\n"
    )
    assert not fresh.exists()


def test_info_counts_a_truncated_trace_as_replay_does(tmp_path, capsys):
    """One definition of a trace's loads and iterations, the committed ones (the ones replayed):
    `trace info` (text and JSON) and `replay` give the same counts for a trace torn inside its last
    iteration; info shows the uncommitted loads apart."""
    whole = tmp_path / "whole.uetrace"
    assert synth(whole) == EXIT_OK  # 3 iterations x 2 microbatches x 2 layers
    torn = tmp_path / "torn.uetrace"
    torn.write_bytes(whole.read_bytes()[:-45])  # inside the last iteration
    capsys.readouterr()
    assert main(["trace", "info", str(torn)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "8 loads in 2 iterations, 4 uncommitted loads after the last commit" in out, out
    assert main(["trace", "info", str(torn), "--json"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)["traces"][0]
    assert (info["loads"], info["iterations"], info["uncommitted"], info["status"]) == (
        8,
        2,
        4,
        "truncated",
    )
    assert info["layers"] == {"1": 4, "2": 4}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert (
            main(
                [
                    "replay",
                    str(torn),
                    "--balancers",
                    "none",
                    "--no-staleness",
                    "--no-cost",
                    "--no-peers",
                    "--json",
                    "--no-progress",
                ]
            )
            == EXIT_OK
        )
    report = json.loads(capsys.readouterr().out)
    assert report["num_records"] == info["loads"]
    assert f"{info['loads']} loads in {info['iterations']} iterations" in report["inputs"][0]
