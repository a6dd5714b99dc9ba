"""Plain-text tables and the JSON / CSV the reports write: numbers formatted the same way in every
report (``-`` for a missing value), NaN as JSON null."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any, Sequence

__all__ = ["ESTIMATE", "dump_json", "fmt", "format_table", "jsonable", "write_csv"]

#: The word every figure of the cost model carries: an estimate, not a measurement.
ESTIMATE = "ESTIMATE"


def jsonable(value: Any) -> Any:
    """NaN and infinities as None, numpy scalars as Python numbers, paths as strings."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def dump_json(payload: dict, stream=None) -> str:
    text = json.dumps(jsonable(payload), indent=1, sort_keys=True)
    if stream is not None:
        stream.write(text + "\n")
    return text


def write_csv(path: Path, rows: Sequence[dict]) -> Path:
    """One row per dict; the columns are the union of the keys, in first-seen order."""
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: jsonable(v) for k, v in row.items()})
    return path


def fmt(value, spec: str = ".3f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def format_table(headers: Sequence[str], rows: Sequence[Sequence], title: str = "") -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [title] if title else []
    for n, row in enumerate(cells):
        lines.append(
            "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
