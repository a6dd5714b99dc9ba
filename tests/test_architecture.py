"""The architecture, checked on the source (docs/architecture.md).

* Imports only point down the layers, planner -> settings -> dataplane -> traces -> analysis -> megatron
  -> cli (a package imports only the packages before it; planner and dataplane nothing of the package), with
  no cycle between modules (imports inside functions included), and only ``megatron/`` imports
  Megatron (megatron-core, Megatron-LM's training package, Transformer Engine, Apex).
* One owner per name: balancer names in ``planner/baselines/registry.py``, the knobs' defaults in
  ``planner/balancer.py``, the ``--moe-balancer*`` flags in ``settings/knobs.py``.
Each rule has a negative control: a made-up module breaking it is caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ultraep_megatron.planner.baselines import registry
from ultraep_megatron.settings.knobs import KNOBS

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ultraep_megatron"
PRODUCT = [*sorted(PACKAGE.rglob("*.py")), *sorted((REPO / "tools").glob("*.py")), REPO / "pretrain_gpt.py"]
OWNERS = {PACKAGE / "planner" / "baselines" / "registry.py", PACKAGE / "planner" / "balancer.py",
          PACKAGE / "settings" / "knobs.py"}

#: The layers, bottom first: a module may import its own layer and the layers before it.
LAYERS = ("planner", "settings", "dataplane", "traces", "analysis", "megatron", "cli")
#: What only the Megatron integration may import.
MEGATRON_PACKAGES = ("megatron", "transformer_engine", "apex")


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = PACKAGE) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import in ``path``, at any depth (lazy imports too).
    ``from pkg import name`` names ``pkg.name`` when that is a module of the package, else ``pkg``."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    known = {module_name(p, root) for p in root.rglob("*.py")}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                found.append((full if full in known else target, node.lineno))
    return found


def layer_of(module: str, top: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == top and parts[1] in LAYERS else None


def import_problems(root: Path = PACKAGE) -> list[str]:
    """Upward imports, Megatron imports outside ``megatron/``, and import cycles between modules."""
    top = root.name
    problems, graph = [], {}
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        own = layer_of(module, top)
        graph[module] = set()
        for target, line in imports_of(path, root):
            where = f"{path.relative_to(root.parent)}:{line}"
            if target.split(".")[0] in MEGATRON_PACKAGES and own != "megatron":
                problems.append(f"{where}: imports {target} outside megatron/")
            if target.split(".")[0] != top:
                continue
            graph[module].add(target)
            theirs = layer_of(target, top)
            if own is None and module != top:
                continue  # a top-level module outside the layers: none should exist (below)
            if module == top and target != top:
                problems.append(f"{where}: the package's __init__ imports {target}")
            elif own and theirs and LAYERS.index(theirs) > LAYERS.index(own):
                problems.append(f"{where}: {own} imports {target} (a layer above it)")
        if module != top and layer_of(module, top) is None:
            problems.append(f"{path.relative_to(root.parent)}: a module outside the layers {LAYERS}")
    # Cycles: a depth-first search over module -> imported modules (a package import counts as its
    # __init__, whose own imports count too).
    state: dict[str, int] = {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                cycle = stack[stack.index(target):] + [target] if target in stack else [module, target]
                problems.append("import cycle: " + " -> ".join(cycle))
            elif target not in state:
                visit(target, stack + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return problems


def test_imports_point_down_without_cycles():
    assert import_problems() == []


def test_planner_and_dataplane_import_nothing_of_the_package():
    for layer in ("planner", "dataplane"):
        for path in sorted((PACKAGE / layer).rglob("*.py")):
            outside = [t for t, _ in imports_of(path) if t.startswith("ultraep_megatron.")
                       and not t.startswith(f"ultraep_megatron.{layer}")]
            assert outside == [], (path, outside)


def write_package(root: Path, modules: dict[str, str]) -> Path:
    for name, text in modules.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("modules,expected", [
    ({"planner/solve.py": "def f():\n    from pkg.analysis import cost\n", "analysis/cost.py": ""},
     "planner imports pkg.analysis.cost (a layer above it)"),
    ({"traces/format.py": "import megatron.core\n"}, "imports megatron.core outside megatron/"),
    ({"megatron/a.py": "from . import b\n", "megatron/b.py": "def f():\n    from .a import x\n"},
     "import cycle: pkg.megatron.a -> pkg.megatron.b -> pkg.megatron.a"),
    ({"helpers.py": ""}, "a module outside the layers"),
])
def test_the_import_rule_catches_each_kind_of_violation(tmp_path, modules, expected):
    root = write_package(tmp_path, {"__init__.py": "", **{f"{m.split('/')[0]}/__init__.py": "" for m in modules
                                                          if "/" in m}, **modules})
    problems = import_problems(root)
    assert any(expected in p for p in problems), problems
    # ... and the same package without the offending import is clean.
    clean = write_package(tmp_path / "clean", {"__init__.py": "", "planner/__init__.py": "", "planner/solve.py": "",
                                               "megatron/__init__.py": "", "megatron/a.py": "from pkg.planner import solve\n"})
    assert import_problems(clean) == []


def _string_constants(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node


def _not_a_name(tree: ast.AST) -> set[int]:
    """Strings that are not balancer names whatever they say: docstrings, ``__all__`` (function
    names) and the command's ``prog``."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            ids.update(id(c) for c in ast.walk(node.value))
        if isinstance(node, ast.keyword) and node.arg == "prog":
            ids.add(id(node.value))
    return ids


def definitions_outside_the_registry(paths) -> list[str]:
    """Where a module other than its owner (:data:`OWNERS`) names a balancer in code, lists balancer
    names, defines a --moe-balancer* flag or gives a knob field a literal default."""
    names = set(registry.MOE_BALANCERS) | {registry.IDEAL}
    distinctive = names - {registry.NONE}  # "none" is also an ordinary word of other flags' values
    knob_fields = {k.field for k in KNOBS}
    found = []
    for path in paths:
        if path in OWNERS:
            continue
        tree = ast.parse(path.read_text(), str(path))
        ignored = _not_a_name(tree)
        where = lambda node: f"{path.name}:{node.lineno}"  # noqa: E731
        for node in _string_constants(tree):
            if id(node) not in ignored and node.value in distinctive:
                found.append(f"{where(node)}: balancer name {node.value!r}")
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and id(node) not in ignored:
                listed = [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names]
                if len(listed) >= 2:
                    found.append(f"{where(node)}: a list of balancer names {listed}")
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value == registry.NONE for c in [node.left, *node.comparators]):
                if "balancer" in ast.unparse(node):
                    found.append(f"{where(node)}: compares a balancer with 'none'")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args \
                    and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("--moe-balancer"):
                found.append(f"{where(node)}: defines {node.args[0].value}")
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                    and node.target.id in knob_fields and isinstance(node.value, ast.Constant):
                found.append(f"{where(node)}: a default for knob {node.target.id}")
    return found


def test_balancer_names_and_defaults_are_defined_in_one_module(tmp_path):
    assert definitions_outside_the_registry(PRODUCT) == []
    # Negative control: each kind of duplicate the rule is for is caught.
    duplicate = tmp_path / "duplicate.py"
    duplicate.write_text(
        'BALANCERS = ("none", "ultraep", "eplb")\n'
        'def f(args, parser):\n'
        '    if args.moe_balancer == "none":\n'
        '        return "eplb-exact"\n'
        '    parser.add_argument("--moe-balancer-num-slots", type=int, default=2)\n'
        'class Spec:\n'
        '    num_slots: int = 2\n')
    found = definitions_outside_the_registry([duplicate])
    kinds = " | ".join(found)
    for text in ("a list of balancer names", "compares a balancer with 'none'", "balancer name 'eplb-exact'",
                 "defines --moe-balancer-num-slots", "a default for knob num_slots"):
        assert text in kinds, (text, found)
