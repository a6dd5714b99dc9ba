"""``ultraep trace`` (``cli/trace.py``): synth, info (text and JSON) and merge of a run traced in
two pieces."""

from __future__ import annotations

import json

import numpy as np

from ultraep_megatron import traces
from ultraep_megatron.cli import main
from ultraep_megatron.cli.common import EXIT_OK, EXIT_USAGE


def test_trace_synth_info_and_merge(tmp_path, capsys):
    out = tmp_path / "s.uetrace"
    assert main(["trace", "synth", str(out), "--num-iterations", "4", "--num-layers", "2", "--num-ranks", "2",
                 "--num-experts", "4"]) == EXIT_OK
    assert main(["trace", "info", str(out)]) == EXIT_OK
    printed = capsys.readouterr().out
    assert "R=2, E=4, status=closed" in printed and "16 loads (0 uncommitted), 4 iterations, layers [1, 2]" in printed
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
    assert main(["trace", "merge", str(tmp_path / "merged"), str(pieces[1]), str(pieces[0]), "--no-progress"]) == EXIT_OK
    merged = traces.read_trace(traces.trace_path(tmp_path / "merged", 0))
    assert merged.iteration.tolist() == whole.iteration.tolist() and bool((merged.load == whole.load).all())
    assert main(["trace", "merge", str(tmp_path / "again"), str(pieces[0]), str(pieces[0] / "ep_group_0000.uetrace"),
                 "--no-progress"]) == EXIT_USAGE
    assert "not after iteration" in capsys.readouterr().err
