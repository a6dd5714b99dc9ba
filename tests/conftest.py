"""Puts tests/ and each of its folders on the import path: the helpers every folder shares
(``processes.py``) and each folder's own (``<folder>_helpers.py`` and the like). Test modules are
imported by path (``--import-mode=importlib``), so a test file is named after the module it tests
(``tests/planner/test_solve.py`` for ``ultraep_megatron/planner/solve.py``) whatever other folders
hold."""

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parent
_SKIPPED = {"data", "workers", "__pycache__"}  # fixtures and subprocess scripts, not helpers

for _folder in [_TESTS, *sorted(p for p in _TESTS.rglob("*") if p.is_dir()
                                and not _SKIPPED & set(p.relative_to(_TESTS).parts))]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
