"""The architecture, checked on the source (docs/architecture.md): nothing of megatron.training on
the path Megatron-Bridge runs.

Megatron-Bridge runs its own training loop, which sets none of Megatron-LM's training globals
(``megatron.training.global_vars``: the args, the writers). The balanced layer
(``megatron/balanced_layer/``) and the Bridge entry (``megatron/bridge/``) import nothing of
``megatron.training``, even lazily inside a function: the iteration number and the writers come
from the model's iteration hook or the caller. ``pretrain_gpt.py``'s entry (``megatron/run/``) may
read them. A structural rule, with its negative control, as the rules of
``tests/test_architecture.py``; the run-time check is ``tests/bridge/test_bridge_pipeline.py``
(the globals stay unset through Bridge's ``pretrain()``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ultraep_megatron"
#: Megatron-LM's training package, whose globals Bridge's loop does not set.
TRAINING = "megatron.training"
#: The modules on Bridge's path that must not import it.
BRIDGE_PATH = [
    *sorted((PACKAGE / "megatron" / "balanced_layer").rglob("*.py")),
    *sorted((PACKAGE / "megatron" / "bridge").rglob("*.py")),
]


def training_imports(paths, root: Path = REPO) -> list[str]:
    """Imports of ``megatron.training`` or a module under it (at any depth in the module, inside
    functions and ``TYPE_CHECKING`` blocks too) in ``paths``, one line each."""
    found = []
    for path in paths:
        name = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            hits = [t for t in targets if t == TRAINING or t.startswith(TRAINING + ".")]
            if hits:
                found.append(f"{name}:{node.lineno}: imports {hits[0]}")
    return found


def test_the_balanced_layer_and_the_bridge_entry_import_nothing_of_megatron_training():
    assert BRIDGE_PATH and training_imports(BRIDGE_PATH) == []


def test_the_rule_catches_a_lazy_import_of_megatron_training(tmp_path):
    """Negative control: what ``observers.py`` did (a lazy ``get_args`` for the trace's first
    iteration), and the other spellings, are caught; megatron-core imports are not."""
    bad = tmp_path / "observers.py"
    bad.write_text(
        "def first_iteration():\n"
        "    from megatron.training.global_vars import get_args\n"
        "    return get_args().iteration\n"
        "def writers():\n"
        "    import megatron.training\n"
        "    from megatron import training\n"
    )
    clean = tmp_path / "context.py"
    clean.write_text("from megatron.core import parallel_state\nimport megatron.core.utils\n")
    found = training_imports([bad, clean], tmp_path)
    assert found == [
        "observers.py:2: imports megatron.training.global_vars",
        "observers.py:5: imports megatron.training",
        "observers.py:6: imports megatron.training",
    ], found
