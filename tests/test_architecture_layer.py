"""The architecture, checked on the source (docs/architecture.md): data, not the layer.

The balanced layer's callees (the per-model context, the invocation, the dispatchers, the replica
autograd, the observers, the data plane) get data (a registration's shapes and groups, tensors, the
invocation), never the layer object: none of them imports the layer's module (``balanced_moe``),
even lazily or for type checking, so none can name the class or reach into one. A structural rule,
with its negative control, as the rules of ``tests/test_architecture.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ultraep_megatron"
LAYER_MODULE = "ultraep_megatron.megatron.balanced_layer.balanced_moe"

#: The balanced layer's callees: they get data, never the layer object.
DATA_ONLY_MODULES = [
    *(
        PACKAGE / "megatron" / "balanced_layer" / f"{name}.py"
        for name in ("context", "invocation", "dispatchers", "replica_autograd", "observers")
    ),
    *sorted((PACKAGE / "dataplane").rglob("*.py")),
]


def layer_references(paths, root: Path = REPO, layer_module: str = LAYER_MODULE) -> list[str]:
    """Imports of ``layer_module`` (or of a name from it; inside functions and ``TYPE_CHECKING``
    blocks too) in ``paths``, one line each."""
    package, _, module = layer_module.rpartition(".")
    found = []
    for path in paths:
        name = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            if any(t == layer_module or t.startswith(layer_module + ".") for t in targets):
                found.append(f"{name}:{node.lineno}: imports the layer's module ({module})")
    return found


def test_the_context_and_the_data_plane_take_data_not_the_layer():
    assert layer_references(DATA_ONLY_MODULES) == []


def test_the_layer_rule_catches_each_kind_of_violation(tmp_path):
    """Negative control: made-up callees importing the layer's module (at the top, inside a
    function, for type checking only, a name from it) are caught, line by line; a twin importing
    its siblings is clean."""
    hub = tmp_path / "hub.py"
    hub.write_text(
        "from typing import TYPE_CHECKING\n"
        "import pkg.layer.balanced_moe\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.layer.balanced_moe import BalancedMoELayer\n"
        "def plan(load):\n"
        "    from pkg.layer import balanced_moe\n"
    )
    assert layer_references([hub], tmp_path, "pkg.layer.balanced_moe") == [
        "hub.py:2: imports the layer's module (balanced_moe)",
        "hub.py:4: imports the layer's module (balanced_moe)",
        "hub.py:6: imports the layer's module (balanced_moe)",
    ]
    clean = tmp_path / "clean.py"
    clean.write_text("from pkg.layer import invocation\nimport pkg.layer.balanced_moe_helpers\n")
    assert layer_references([clean], tmp_path, "pkg.layer.balanced_moe") == []


#: megatron/'s subpackages, bottom first: a subpackage imports nothing of those after it (the CPU
#: backend ``cpu/`` lifts its device mapping around the layer's host code: above the layer).
MEGATRON_SUBPACKAGES = ("release", "balanced_layer", "cpu", "run", "bridge", "recipe_check")


def upward_subpackage_imports(root: Path = PACKAGE) -> list[str]:
    """Imports (lazy ones too) from a subpackage of ``megatron/`` of a subpackage after it."""
    top = root.name
    found = []
    for own_index, own in enumerate(MEGATRON_SUBPACKAGES):
        for path in sorted((root / "megatron" / own).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    targets = [node.module] + [
                        f"{node.module}.{alias.name}" for alias in node.names
                    ]
                elif isinstance(node, ast.Import):
                    targets = [alias.name for alias in node.names]
                else:
                    continue
                for target in targets:
                    parts = target.split(".")
                    if (
                        parts[:2] == [top, "megatron"]
                        and len(parts) > 2
                        and parts[2] in MEGATRON_SUBPACKAGES
                        and MEGATRON_SUBPACKAGES.index(parts[2]) > own_index
                    ):
                        found.append(
                            f"{path.relative_to(root.parent).as_posix()}:{node.lineno}: "
                            f"megatron/{own} imports {target}, above it"
                        )
                        break
    return found


def test_megatron_subpackages_import_only_downward():
    assert upward_subpackage_imports() == []


def test_the_subpackage_rule_catches_an_upward_import(tmp_path):
    """Negative control: the layer importing the run surface, and the release layer the layer, both caught."""
    root = tmp_path / "pkg"
    files = {
        "megatron/balanced_layer/a.py": "def f():\n    from pkg.megatron.run import telemetry\n",
        "megatron/release/b.py": "import pkg.megatron.balanced_layer.a\n",
        "megatron/run/c.py": "from pkg.megatron.balanced_layer import a\nfrom pkg.megatron.release import b\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert upward_subpackage_imports(root) == [
        "pkg/megatron/release/b.py:1: megatron/release imports pkg.megatron.balanced_layer.a, above it",
        "pkg/megatron/balanced_layer/a.py:2: megatron/balanced_layer imports pkg.megatron.run, above it",
    ]
