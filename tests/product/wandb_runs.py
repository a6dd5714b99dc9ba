"""Reading a wandb run's history back from its offline ``run-*.wandb`` file (no sync, no network),
for the dashboard tests. wandb has no Python reader of its transaction log (its Go core reads it),
so this follows the format: a 7-byte file header, then LevelDB-log-style 32 KiB blocks of records,
each a 7-byte header (crc32, length, type) and a chunk of a serialized
``wandb_internal_pb2.Record``; a record split over blocks is FIRST/MIDDLE/LAST.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator

_WANDB_HEADER = struct.Struct("<4sHB")
_WANDB_IDENT, _WANDB_MAGIC = b":W&B", 0xBEE1
_BLOCK = 32 * 1024
_CHUNK = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_run_file(run: str | Path, run_id: str | None = None) -> Path:
    """The ``run-<id>.wandb`` file of a run: the file itself, a run directory
    (``offline-run-*``/``run-*``), or a wandb save dir (``<dir>`` or ``<dir>/wandb``).

    A save dir can hold several runs (a relaunch into the same directory, a crashed launch);
    ``latest-run`` is only the newest of them, so it is never followed: give ``run_id`` when
    there is more than one.

    Raises:
        FileNotFoundError: no run file, or none with ``run_id``.
        ValueError: several runs and no ``run_id`` to choose (their ids are listed).
    """
    run = Path(run)
    if run.is_file():
        return run
    files = sorted(run.glob("run-*.wandb"))
    if not files:
        files = sorted(
            {
                f.resolve()
                for pattern in ("*run-*/run-*.wandb", "wandb/*run-*/run-*.wandb")
                for f in run.glob(pattern)
            }
        )
    if run_id is not None:
        files = [f for f in files if f.name == f"run-{run_id}.wandb"]
    if not files:
        raise FileNotFoundError(
            f"no wandb run file (run-*.wandb{f' of run {run_id}' if run_id else ''}) under {run}"
        )
    if len(files) > 1:
        ids = [f.stem[len("run-") :] for f in files]
        raise ValueError(f"{len(files)} wandb runs under {run} ({', '.join(ids)}): pass run_id")
    return files[0]


def iter_wandb_records(run: str | Path, run_id: str | None = None) -> Iterator[Any]:
    """Every ``wandb_internal_pb2.Record`` of a run file (see :func:`wandb_run_file`), in order.

    Raises:
        ValueError: on a file that is not a wandb run log, or a chunk failing its checksum.
    """
    from wandb.proto import wandb_internal_pb2

    data = wandb_run_file(run, run_id).read_bytes()
    if len(data) < _WANDB_HEADER.size:
        raise ValueError("wandb run file too short for its header")
    ident, magic, _ = _WANDB_HEADER.unpack_from(data, 0)
    if ident != _WANDB_IDENT or magic != _WANDB_MAGIC:
        raise ValueError(f"not a wandb run file (header {ident!r}, {magic:#x})")
    pos, pending = _WANDB_HEADER.size, b""
    while pos + _CHUNK.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK.size:  # block trailer
            pos += left
            continue
        crc, length, kind = _CHUNK.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding at the end of a block / of the file
            pos += left
            continue
        chunk = data[pos + _CHUNK.size : pos + _CHUNK.size + length]
        if len(chunk) < length:
            break  # a record still being written
        if zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF != crc:
            raise ValueError(f"wandb run file: bad checksum at byte {pos}")
        pos += _CHUNK.size + length
        if kind in (_FULL, _FIRST):
            pending = chunk
        elif kind in (_MIDDLE, _LAST):
            pending += chunk
        else:
            raise ValueError(f"wandb run file: unknown chunk type {kind} at byte {pos}")
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def read_wandb_history(run: str | Path, run_id: str | None = None) -> list[dict]:
    """The run's history rows (what ``wandb.log`` wrote), oldest first (see :func:`wandb_run_file`).

    Returns:
        One dict per logged step: ``_step`` and every key logged at it, values decoded from
        JSON; an image is wandb's media dict (``_type`` ``image-file``, ``path`` relative to
        the run's ``files/`` directory, ``sha256``, ``width``, ``height``, ``caption``).
    """
    rows: dict[int, dict] = {}
    for record in iter_wandb_records(run, run_id):
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        for item in record.history.item:
            path = [item.key] if item.key else list(item.nested_key)
            target = row
            for part in path[:-1]:  # media (images) arrive as one item per field
                target = target.setdefault(part, {})
            target[path[-1]] = json.loads(item.value_json)
        step = int(row.get("_step", record.history.step.num))
        rows.setdefault(step, {}).update(row)
        rows[step]["_step"] = step
    return [rows[step] for step in sorted(rows)]
