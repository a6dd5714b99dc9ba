"""The architecture, checked on the source (docs/architecture.md): data, not the layer.

The per-model context (``megatron/balanced_layer/context.py``), its observers (``megatron/balanced_layer/observers.py``) and the
data plane (``dataplane/``) are callees of the balanced MoE layer that get data (a registration's
shapes, groups and layout; tensors; the invocation's record), never the layer object: no parameter
named ``layer`` in their signatures, and nothing there matches ``\\blayer\\.`` (an attribute read of
a layer; prose too, so that the grep stays empty). With its negative control, as the rules of
``tests/test_architecture.py``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ultraep_megatron"

#: The per-model context, its observers and the data plane: callees of the balanced layer that get
#: data (shapes, groups, tensors, the invocation's record), never the layer object.
DATA_ONLY_MODULES = [
    PACKAGE / "megatron" / "balanced_layer" / "context.py",
    PACKAGE / "megatron" / "balanced_layer" / "observers.py",
    *sorted((PACKAGE / "dataplane").rglob("*.py")),
]
REACHES_INTO_A_LAYER = re.compile(r"\blayer\.")


def layer_references(paths, root: Path = REPO) -> list[str]:
    """Parameters named ``layer`` (functions and lambdas, any kind of parameter) and text matching
    ``\\blayer\\.`` (attribute reads; prose too, so the grep of the issue stays empty) in ``paths``."""
    found = []
    for path in paths:
        name = path.relative_to(root).as_posix()
        text = path.read_text()
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                args = node.args
                for arg in (
                    *args.posonlyargs,
                    *args.args,
                    *args.kwonlyargs,
                    args.vararg,
                    args.kwarg,
                ):
                    if arg is not None and arg.arg == "layer":
                        function = getattr(node, "name", "lambda")
                        found.append(
                            f"{name}:{node.lineno}: {function} takes a parameter named layer"
                        )
        for number, line in enumerate(text.splitlines(), 1):
            if REACHES_INTO_A_LAYER.search(line):
                found.append(f"{name}:{number}: reaches into a layer: {line.strip()[:60]!r}")
    return found


def test_the_context_and_the_data_plane_take_data_not_the_layer():
    assert layer_references(DATA_ONLY_MODULES) == []


def test_the_layer_rule_catches_each_kind_of_violation(tmp_path):
    """Negative control: a made-up context whose method takes the layer (positional, keyword-only,
    in a lambda) and reads its attributes is caught, line by line; its data-only twin (a
    registration, a layer number) is clean."""
    hub = tmp_path / "hub.py"
    hub.write_text(
        "class Context:\n"
        "    def register(self, layer):\n"
        "        return layer.config\n"
        "    def plan(self, load, *, layer=None):\n"
        "        key = lambda layer: 0\n"
        "        return self.layer.balancer\n"
    )
    assert layer_references([hub], tmp_path) == [
        "hub.py:2: register takes a parameter named layer",
        "hub.py:4: plan takes a parameter named layer",
        "hub.py:5: lambda takes a parameter named layer",
        "hub.py:3: reaches into a layer: 'return layer.config'",
        "hub.py:6: reaches into a layer: 'return self.layer.balancer'",
    ]
    clean = tmp_path / "clean.py"
    clean.write_text(
        "class Context:\n"
        "    def register(self, registration):\n"
        "        return registration.layer_number, registration.layers\n"
        "    def plan(self, load, *, layer_number=None):\n"
        "        return self.player.balancer\n"
    )
    assert layer_references([clean], tmp_path) == []


#: megatron/'s subpackages, bottom first: a subpackage imports nothing of those after it (the CPU
#: backend ``cpu/`` sits beside them: the layer's ``native_torch`` and the backend use each other).
MEGATRON_SUBPACKAGES = ("release", "balanced_layer", "run", "recipe_check")


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
