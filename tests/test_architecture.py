"""The architecture, checked on the source (docs/architecture.md).

* Imports only point down the layers, planner -> settings -> dataplane -> traces -> analysis -> megatron
  -> cli (a package imports only the packages before it; planner and dataplane nothing of the package), with
  no cycle between modules (imports inside functions included), and only ``megatron/`` imports
  Megatron (megatron-core, Megatron-LM's training package, Transformer Engine, Apex).
* One owner per name: balancer names in ``planner/baselines/registry.py``, the knobs' defaults in
  ``planner/balancer.py``, the ``--moe-balancer*`` flags in ``settings/knobs.py``.
* Small surfaces: no module over 650 lines (tests included), a package ``__init__`` only re-exports
  (defines nothing), a package exports at most 15 names.
* No module imports another module's underscore-private name (a private module only from its own
  package); a ``TYPE_CHECKING`` import in ``megatron/`` only names what its module already imports
  (downward), never a module above or beside it; the Megatron integration imports of the analysis
  only what a training run draws (``analysis/figures.py``).
* Data, not the layer: the per-model context, its observers and the data plane take no parameter
  named ``layer`` and never reach into one (``tests/test_architecture_layer.py``).
Each rule has a negative control: a made-up module breaking it is caught. The exceptions are
listed by name, each with the reason and the issue that removes it; an exception that no longer
applies fails too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ultraep_megatron.planner.baselines import registry
from ultraep_megatron.settings.knobs import KNOBS

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "ultraep_megatron"
PRODUCT = [
    *sorted(PACKAGE.rglob("*.py")),
    *sorted((REPO / "tools").glob("*.py")),
    REPO / "pretrain_gpt.py",
]
TESTS = sorted((REPO / "tests").rglob("*.py"))
OWNERS = {
    PACKAGE / "planner" / "baselines" / "registry.py",
    PACKAGE / "planner" / "balancer.py",
    PACKAGE / "settings" / "knobs.py",
}

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
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
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
            problems.append(
                f"{path.relative_to(root.parent)}: a module outside the layers {LAYERS}"
            )
    # Cycles: a depth-first search over module -> imported modules (a package import counts as its
    # __init__, whose own imports count too).
    state: dict[str, int] = {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                cycle = (
                    stack[stack.index(target) :] + [target] if target in stack else [module, target]
                )
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
            outside = [
                t
                for t, _ in imports_of(path)
                if t.startswith("ultraep_megatron.")
                and not t.startswith(f"ultraep_megatron.{layer}")
            ]
            assert outside == [], (path, outside)


def write_package(root: Path, modules: dict[str, str]) -> Path:
    for name, text in modules.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize(
    "modules,expected",
    [
        (
            {
                "planner/solve.py": "def f():\n    from pkg.analysis import cost\n",
                "analysis/cost.py": "",
            },
            "planner imports pkg.analysis.cost (a layer above it)",
        ),
        ({"traces/format.py": "import megatron.core\n"}, "imports megatron.core outside megatron/"),
        (
            {
                "megatron/a.py": "from . import b\n",
                "megatron/b.py": "def f():\n    from .a import x\n",
            },
            "import cycle: pkg.megatron.a -> pkg.megatron.b -> pkg.megatron.a",
        ),
        ({"helpers.py": ""}, "a module outside the layers"),
    ],
)
def test_the_import_rule_catches_each_kind_of_violation(tmp_path, modules, expected):
    root = write_package(
        tmp_path,
        {
            "__init__.py": "",
            **{f"{m.split('/')[0]}/__init__.py": "" for m in modules if "/" in m},
            **modules,
        },
    )
    problems = import_problems(root)
    assert any(expected in p for p in problems), problems
    # ... and the same package without the offending import is clean.
    clean = write_package(
        tmp_path / "clean",
        {
            "__init__.py": "",
            "planner/__init__.py": "",
            "planner/solve.py": "",
            "megatron/__init__.py": "",
            "megatron/a.py": "from pkg.planner import solve\n",
        },
    )
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
        if (
            isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body
        ):
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") == "__all__" for t in node.targets
        ):
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
                listed = [
                    e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in names
                ]
                if len(listed) >= 2:
                    found.append(f"{where(node)}: a list of balancer names {listed}")
            if isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value == registry.NONE
                for c in [node.left, *node.comparators]
            ):
                if "balancer" in ast.unparse(node):
                    found.append(f"{where(node)}: compares a balancer with 'none'")
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", "") == "add_argument"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).startswith("--moe-balancer")
            ):
                found.append(f"{where(node)}: defines {node.args[0].value}")
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and node.target.id in knob_fields
                and isinstance(node.value, ast.Constant)
            ):
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
        '    num_slots: int = 2\n'
    )
    found = definitions_outside_the_registry([duplicate])
    kinds = " | ".join(found)
    for text in (
        "a list of balancer names",
        "compares a balancer with 'none'",
        "balancer name 'eplb-exact'",
        "defines --moe-balancer-num-slots",
        "a default for knob num_slots",
    ):
        assert text in kinds, (text, found)


# -- small surfaces -------------------------------------------------------------------------------

MAX_LINES = 650
#: Modules allowed past MAX_LINES for now, each with the work that splits it (none now).
LONG_MODULES: frozenset = frozenset()
MAX_EXPORTS = 15


def long_modules(paths, root: Path = REPO, allowed=frozenset()) -> list[str]:
    """Modules over :data:`MAX_LINES` lines that ``allowed`` (paths relative to ``root``) does not
    name, and names in ``allowed`` that are no longer over it."""
    found, seen = [], set()
    for path in paths:
        name = path.relative_to(root).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_LINES:
            seen.add(name)
            if name not in allowed:
                found.append(f"{name}: {lines} lines (at most {MAX_LINES}; split it along a seam)")
    return found + [
        f"{name}: allowed past {MAX_LINES} lines but no longer is: drop the exception"
        for name in sorted(set(allowed) - seen)
    ]


def _is_docstring(node: ast.stmt, index: int) -> bool:
    return (
        index == 0
        and isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


#: What a package ``__init__`` may assign besides importing: its export list, its version.
INIT_NAMES = {"__all__", "__version__"}


def init_definitions(root: Path = PACKAGE) -> list[str]:
    """Statements of a package ``__init__.py`` other than its docstring, imports and the names of
    :data:`INIT_NAMES`: an ``__init__`` only re-exports."""
    found = []
    for path in sorted(root.rglob("__init__.py")):
        for index, node in enumerate(ast.parse(path.read_text(), str(path)).body):
            if _is_docstring(node, index) or isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.Assign) and all(
                getattr(t, "id", None) in INIT_NAMES for t in node.targets
            ):
                continue
            found.append(
                f"{path.relative_to(root.parent)}:{node.lineno}: defines "
                f"{ast.unparse(node).splitlines()[0][:60]!r} (move it to a module of the package)"
            )
    return found


def package_exports(root: Path = PACKAGE) -> dict[str, int]:
    """Per package, the names its ``__init__`` exports: its ``__all__``, else every name its imports
    bind (``from __future__`` aside)."""
    counts = {}
    for path in sorted(root.rglob("__init__.py")):
        tree = ast.parse(path.read_text(), str(path))
        names = None
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                getattr(t, "id", None) == "__all__" for t in node.targets
            ):
                names = ast.literal_eval(node.value)
        if names is None:
            names = [
                (alias.asname or alias.name).split(".")[0]
                for node in tree.body
                if isinstance(node, (ast.Import, ast.ImportFrom))
                and getattr(node, "module", "") != "__future__"
                for alias in node.names
            ]
        counts[module_name(path, root)] = len(set(names))
    return counts


def test_modules_are_small():
    assert long_modules([*PRODUCT, *TESTS], allowed=LONG_MODULES) == []


def test_package_inits_only_reexport_a_small_surface():
    assert init_definitions() == []
    assert {package: n for package, n in package_exports().items() if n > MAX_EXPORTS} == {}


def test_the_surface_rules_catch_each_kind_of_violation(tmp_path):
    """Negative controls: a module one line too long, an allowed one that shrank, an ``__init__``
    defining a function and a constant, a package exporting 16 names."""
    long, short = tmp_path / "long.py", tmp_path / "short.py"
    long.write_text("x = 1\n" * (MAX_LINES + 1))
    short.write_text("x = 1\n" * MAX_LINES)
    assert long_modules([long, short], tmp_path) == [
        f"long.py: {MAX_LINES + 1} lines (at most {MAX_LINES}; split it along a seam)"
    ]
    assert long_modules([long, short], tmp_path, allowed={"long.py"}) == []
    assert "short.py: allowed past" in " ".join(
        long_modules([long, short], tmp_path, allowed={"long.py", "short.py"})
    )
    names = [f"n{i}" for i in range(MAX_EXPORTS + 1)]
    root = write_package(
        tmp_path / "made_up",
        {
            "__init__.py": '"""Doc."""\n__version__ = "1"\n',
            "planner/__init__.py": '"""Doc."""\nfrom .a import f\n\ndef helper():\n    pass\nLIMIT = 3\n',
            "planner/a.py": "def f(): pass\n" + "".join(f"{n} = 0\n" for n in names),
            "traces/__init__.py": f"from ..planner.a import {', '.join(names)}\n",
        },
    )
    found = init_definitions(root)
    assert (
        len(found) == 2
        and "defines 'def helper():'" in found[0]
        and "defines 'LIMIT = 3'" in found[1]
    ), found
    assert package_exports(root) == {"pkg": 0, "pkg.planner": 1, "pkg.traces": MAX_EXPORTS + 1}


# -- imports that reach past a module's own surface -----------------------------------------------


def _type_checking_blocks(tree: ast.AST) -> list[ast.If]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
    ]


def runtime_imports_of(path: Path, root: Path = PACKAGE) -> list[tuple[str, int]]:
    """:func:`imports_of` without the imports under ``if TYPE_CHECKING:`` (they never run)."""
    blocks = _type_checking_blocks(ast.parse(path.read_text(), str(path)))
    hidden = {
        line
        for block in blocks
        for node in block.body
        for line in range(node.lineno, node.end_lineno + 1)
    }
    return [(target, line) for target, line in imports_of(path, root) if line not in hidden]


def type_checking_problems(root: Path = PACKAGE, allowed=frozenset()) -> list[str]:
    """``TYPE_CHECKING`` imports in ``megatron/`` of a module of the package that the importer does
    not already import at run time (directly or through other modules): a dependency hidden from
    the import graph, up (the target imports the importer: a cycle the annotation hides) or
    sideways. Exceptions in ``allowed`` as (importer, target); one that no longer applies is
    reported too."""
    top = root.name
    modules = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph = {
        m: {t for t, _ in runtime_imports_of(p, root) if t in modules} for m, p in modules.items()
    }

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            module = todo.pop()
            if module == goal:
                return True
            if module not in seen:
                seen.add(module)
                todo += graph.get(module, ())
        return False

    found, used = [], set()
    for module, path in modules.items():
        if layer_of(module, top) != "megatron":
            continue
        tree = ast.parse(path.read_text(), str(path))
        lines = {
            node.lineno
            for block in _type_checking_blocks(tree)
            for node in ast.walk(block)
            if isinstance(node, (ast.Import, ast.ImportFrom))
        }
        for target, line in imports_of(path, root):
            if line not in lines or target not in modules or reaches(module, target):
                continue
            if (module, target) in allowed:
                used.add((module, target))
                continue
            way = "up: it imports this module" if reaches(target, module) else "sideways"
            found.append(
                f"{path.relative_to(root.parent)}:{line}: a TYPE_CHECKING import of {target}, "
                f"which it does not import at run time ({way})"
            )
    return found + [
        f"{a} -> {b}: an allowed TYPE_CHECKING import that no longer points up or sideways"
        for a, b in sorted(set(allowed) - used)
    ]


def underscore_imports(paths, root: Path = PACKAGE) -> list[str]:
    """Imports of another module's underscore-private name (``from .a import _b``), or of a private
    module from outside its own package (``from pkg.planner import _kernel`` outside
    ``pkg.planner``)."""
    top, known = root.name, {module_name(p, root) for p in root.rglob("*.py")}
    found = []
    for path in paths:
        inside = root.parent in path.parents
        importer = module_name(path, root) if inside else path.stem
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = (
                    ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1]
                        + ([node.module] if node.module else [])
                    )
                    if node.level
                    else node.module or ""
                )
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                targets = (
                    [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
                )
            for target in targets:
                parts = target.split(".")
                private = [
                    i
                    for i, part in enumerate(parts)
                    if part.startswith("_") and not part.startswith("__")
                ]
                if parts[0] != top or not private:
                    continue
                owner = ".".join(parts[: private[0]])
                if not (
                    target in known and owner == package
                ):  # a private module of its own package is fine
                    where = path.relative_to(root.parent) if inside else path.name
                    found.append(f"{where}:{node.lineno}: imports {target}, private to {owner}")
    return found


#: What a training run draws of the analysis: the figure basics and the heatmap it logs.
TRAINING_ANALYSIS = {"figures"}


def offline_imports_in_training(root: Path = PACKAGE) -> list[str]:
    """Imports of the offline analysis (anything but :data:`TRAINING_ANALYSIS`) in ``megatron/``."""
    top = root.name
    found = []
    for path in sorted((root / "megatron").rglob("*.py")):
        for target, line in imports_of(path, root):
            parts = target.split(".")
            if parts[:2] == [top, "analysis"] and (
                len(parts) < 3 or parts[2] not in TRAINING_ANALYSIS
            ):
                found.append(
                    f"{path.relative_to(root.parent)}:{line}: imports {target}, offline analysis"
                )
    return found


def test_imports_reach_only_a_module_s_surface():
    assert underscore_imports(PRODUCT) == []
    assert type_checking_problems() == []
    assert offline_imports_in_training() == []


def test_the_import_surface_rules_catch_each_kind_of_violation(tmp_path):
    """Negative controls: a private name imported from a sibling, a private module imported from
    another package, TYPE_CHECKING imports pointing up (a hidden cycle) and sideways, an allowed one
    that became downward, training importing the offline analysis; and what stays allowed: a
    private module of its own package, a TYPE_CHECKING import of what the module imports anyway."""
    root = write_package(
        tmp_path,
        {
            "__init__.py": "",
            "planner/__init__.py": "",
            "planner/_kernel.py": "def run(): pass\n",
            "planner/solve.py": "from . import _kernel\n\ndef _helper(): pass\n",
            "dataplane/__init__.py": "",
            "dataplane/buffer.py": "from pkg.planner.solve import _helper\nfrom pkg.planner import _kernel\n",
            "analysis/__init__.py": "",
            "analysis/figures.py": "",
            "analysis/cost.py": "",
            "megatron/__init__.py": "",
            "megatron/context.py": "from pkg.megatron import layer\nfrom pkg.analysis import figures\n",
            "megatron/layer.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from pkg.megatron.context import Context\n"
                "    from pkg.megatron.spec import Spec\n"
            ),
            "megatron/spec.py": "from pkg.analysis.cost import model\n",
            "megatron/hub.py": (
                "from pkg.megatron import spec\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from pkg.megatron.spec import Spec\n"
            ),
        },
    )
    paths = sorted(root.rglob("*.py"))
    assert underscore_imports(paths, root) == [
        "pkg/dataplane/buffer.py:1: imports pkg.planner.solve._helper, private to pkg.planner.solve",
        "pkg/dataplane/buffer.py:2: imports pkg.planner._kernel, private to pkg.planner",
    ]
    found = type_checking_problems(root)
    assert len(found) == 2, found
    assert (
        "pkg/megatron/layer.py:3: a TYPE_CHECKING import of pkg.megatron.context" in found[0]
        and "up" in found[0]
    )
    assert (
        "pkg/megatron/layer.py:4: a TYPE_CHECKING import of pkg.megatron.spec" in found[1]
        and "sideways" in found[1]
    )
    assert (
        type_checking_problems(
            root,
            allowed={
                ("pkg.megatron.layer", "pkg.megatron.context"),
                ("pkg.megatron.layer", "pkg.megatron.spec"),
            },
        )
        == []
    )
    stale = type_checking_problems(
        root,
        allowed={
            ("pkg.megatron.layer", "pkg.megatron.context"),
            ("pkg.megatron.layer", "pkg.megatron.spec"),
            ("pkg.megatron.hub", "pkg.megatron.spec"),
        },
    )
    assert stale == [
        "pkg.megatron.hub -> pkg.megatron.spec: an allowed TYPE_CHECKING import that no "
        "longer points up or sideways"
    ]
    assert offline_imports_in_training(root) == [
        "pkg/megatron/spec.py:1: imports pkg.analysis.cost, offline analysis"
    ]
