"""The architecture as a test: imports point down the layers, never in a circle, and never at a stand-in.

The layers are DESIGN's and the README's ("How it is built"): ``devices/`` knows no Kubernetes,
``resources/`` and ``cdi/`` never import ``node/`` or ``kubelet/``, ``kubelet/`` only translates,
and the programs sit on top. The test reads every module's imports with :mod:`ast` (nothing is
imported, so a module's import-time work cannot hide or fake an edge) and counts every kind:
top-level, inside functions, under ``TYPE_CHECKING``, and a module named in a string (what
``importlib.import_module`` or ``python -m`` runs), since each is a dependency a reader must follow.

A new module must be placed in :data:`LAYERS`; a new stand-in goes in :data:`STAND_IN_PACKAGE`.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dra_driver"

# Lowest first. A module may import modules of its own layer and of the layers below it.
# ``pkg.*`` is the package and everything under it; a plain name is that one module.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("dra_driver", "dra_driver.errors", "dra_driver.names", "dra_driver.crashpoint")),
    (
        "devices",  # hardware, real or simulated; knows no Kubernetes (see FORBIDDEN_EXTERNAL)
        (
            "dra_driver.devices.*",
            "dra_driver.simulated",
            "dra_driver.simulated.gpus",
            "dra_driver.simulated.nodes",
            "dra_driver.simulated.state",
            "dra_driver.simulated.sysfs",
            "dra_driver.simulated.health",
        ),
    ),
    ("apiserver", ("dra_driver.apiserver.*",)),  # the API-server edge
    ("cdi", ("dra_driver.cdi.*",)),  # the runtime's view
    ("resources", ("dra_driver.resources.*", "dra_driver.labels.*")),  # the Kubernetes view
    (
        "node",  # prepare/unprepare, the node's store, and the MPS daemons a prepare starts
        ("dra_driver.node.*", "dra_driver.simulated.mps_daemons", "dra_driver.simulated.mps_control"),
    ),
    ("kubelet", ("dra_driver.kubelet.*",)),  # gRPC adapters; see KUBELET_MAY_USE
    (
        "programs",  # a package per program, and the entry point, CLI and settings they share
        (
            "dra_driver.__main__",
            "dra_driver.cli",
            "dra_driver.settings",
            "dra_driver.log",
            "dra_driver.gpu_plugin.*",
            "dra_driver.webhook.*",
            "dra_driver.hardware_report.*",
            "dra_driver.computedomain.*",
            "dra_driver.simulated.imex_daemon",
        ),
    ),
]

# kubelet/ only translates protocol messages to domain objects and back: outside its own layer it
# may use the domain types, nothing that decides or does anything.
KUBELET_MAY_USE = ("dra_driver.node.types", "dra_driver.devices.types")

# Third-party packages a layer must not import (the hardware layer knows no Kubernetes, nor gRPC).
FORBIDDEN_EXTERNAL: Mapping[str, tuple[str, ...]] = {"devices": ("kubernetes", "aiohttp", "grpc")}

# What is not real: the simulated GPUs and what acts on them, and the stand-ins for NVIDIA's
# programs, all in one package. (devices/faults.py is not one: it is what a fault *is*, read from
# NVML on a real node.)
STAND_IN_PACKAGE = "dra_driver.simulated"

# The real modules that reach a stand-in, each under its why: the switch between the real thing and
# its stand-in, the one program-level choice the switch cannot make, and the simulator's own commands.
STAND_IN_USERS: frozenset[tuple[str, str]] = frozenset(
    {
        # the switch: --simulate picks the GPU backend, its health source and the host IMEX check
        ("dra_driver.devices.backends", "dra_driver.simulated.gpus"),
        ("dra_driver.devices.backends", "dra_driver.simulated.health"),
        # a simulated node runs its MPS daemons as local processes (a real one: a Deployment each),
        # a choice of the plugin's, above the hardware layer where the switch lives
        ("dra_driver.gpu_plugin.app", "dra_driver.simulated.mps_daemons"),
        # `dra-driver simulate` (the simulator's fault injection) and `inventory --list-profiles`
        ("dra_driver.cli", "dra_driver.simulated.gpus"),
        ("dra_driver.cli", "dra_driver.simulated.nodes"),
        # --simulate's value is checked against the node profiles with the other settings
        ("dra_driver.settings", "dra_driver.simulated.nodes"),
        # `compute-domain-daemon` runs the simulated IMEX daemon
        ("dra_driver.computedomain.cli", "dra_driver.simulated.imex_daemon"),
    }
)


# The programs, each a package of its own (the entry point and CLI, above them, may use them all),
# and the few places one program uses another's modules, each under its why.
PROGRAMS = (
    "dra_driver.gpu_plugin",
    "dra_driver.webhook",
    "dra_driver.hardware_report",
    "dra_driver.computedomain",
    "dra_driver.simulated.imex_daemon",
)
PROGRAMS_MAY_USE: frozenset[tuple[str, str]] = frozenset(
    {
        # the GPU plugin's process also serves the node's compute-domain driver
        ("dra_driver.gpu_plugin", "dra_driver.computedomain"),
        # the IMEX daemon's stand-in reads the config and names prepare gives it; its command is
        # one of the compute-domain commands
        ("dra_driver.simulated.imex_daemon", "dra_driver.computedomain"),
        ("dra_driver.computedomain", "dra_driver.simulated.imex_daemon"),
    }
)


def program_of(module: str) -> str | None:
    return next((p for p in PROGRAMS if module == p or module.startswith(f"{p}.")), None)


def stand_ins(package: Path) -> list[str]:
    """The modules of the stand-in package."""
    return [name for name in modules(package) if f"{name}.".startswith(f"{STAND_IN_PACKAGE}.")]


# Circles that exist today, each with why it is left for now. (app <-> launch was one: KubeletFront
# moved to kubelet/front.py; node/store <-> node/legacy another: the store's errors are in records.py.)
KNOWN_CYCLES: Mapping[frozenset[str], str] = {}


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} imports {self.imported} (line {self.line})"


def modules(package: Path) -> dict[str, Path]:
    """Every module of ``package`` by dotted name (a package by its own name, not ``__init__``)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(package: Path) -> list[Import]:
    """Every import from a module of ``package`` of another module of it, resolved to a module."""
    known = modules(package)
    found = []
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(name, is_package, node.level, node.module)
                # `from pkg import sub` imports the module pkg.sub; `from mod import thing`, mod.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in known:
                targets = [node.value]  # importlib.import_module("..."), python -m ...
            line = getattr(node, "lineno", 0)
            found += [
                Import(name, target, line)
                for target in dict.fromkeys(targets)
                if target in known and target != name
            ]
    return found


def external_imports(package: Path) -> list[Import]:
    """Every import of a top-level package other than ``package`` itself, by its top-level name."""
    found = []
    for name, path in modules(package).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.split(".")[0]]
            else:
                continue
            found += [Import(name, top, node.lineno) for top in tops if top != package.name]
    return found


def _absolute(importer: str, is_package: bool, level: int, module: str | None) -> str:
    if level == 0:
        return module or ""
    parts = importer.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, module] if module else parts)


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]]) -> tuple[int, str]:
    for rank, (layer, patterns) in enumerate(layers):
        for pattern in patterns:
            if module == pattern or (pattern.endswith(".*") and f"{module}.".startswith(pattern[:-1])):
                return rank, layer
    raise LookupError(f"{module} is in no layer: place it in LAYERS")


def upward(found: Iterable[Import], layers: list[tuple[str, tuple[str, ...]]]) -> list[str]:
    """The imports of a module of a higher layer by one of a lower one."""
    wrong = []
    for imp in found:
        (low, importer_layer), (high, imported_layer) = (
            layer_of(imp.importer, layers),
            layer_of(imp.imported, layers),
        )
        if high > low:
            wrong.append(f"{imp}: {importer_layer}/ must not import {imported_layer}/")
    return wrong


def cycles(found: Iterable[Import]) -> list[list[str]]:
    """The groups of modules that import each other, directly or round a circle (Tarjan's SCCs)."""
    graph: dict[str, set[str]] = {}
    for imp in found:
        graph.setdefault(imp.importer, set()).add(imp.imported)
        graph.setdefault(imp.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def stand_in_uses(
    found: Iterable[Import], stand_ins: Iterable[str], allowed: Iterable[tuple[str, str]]
) -> list[str]:
    """The imports of a stand-in by real code that are not among the ``allowed`` switches."""
    fake, switches = set(stand_ins), set(allowed)
    return [
        str(imp)
        for imp in found
        if imp.imported in fake and imp.importer not in fake and (imp.importer, imp.imported) not in switches
    ]


# --- the project ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def project() -> list[Import]:
    """The project's imports, read once for the tests below."""
    return imports(PACKAGE)


def test_every_module_is_placed_in_a_layer() -> None:
    unplaced = []
    for module in modules(PACKAGE):
        try:
            layer_of(module, LAYERS)
        except LookupError as error:
            unplaced.append(str(error))
    assert unplaced == []


def test_imports_point_down_the_layers(project: list[Import]) -> None:
    assert upward(project, LAYERS) == []


def test_kubelet_layer_only_translates(project: list[Import]) -> None:
    """Outside its own layer, kubelet/ uses only the domain types it translates to and from."""
    wrong = [
        str(imp)
        for imp in project
        if layer_of(imp.importer, LAYERS)[1] == "kubelet"
        and layer_of(imp.imported, LAYERS)[1] not in ("kubelet", "base")
        and imp.imported not in KUBELET_MAY_USE
    ]
    assert wrong == []


def test_layers_import_none_of_the_packages_they_must_not_know() -> None:
    wrong = [
        f"{imp}: {layer}/ must not know {imp.imported}"
        for imp in external_imports(PACKAGE)
        for layer in [layer_of(imp.importer, LAYERS)[1]]
        if imp.imported in FORBIDDEN_EXTERNAL.get(layer, ())
    ]
    assert wrong == []


def test_no_two_modules_import_each_other(project: list[Import]) -> None:
    found = [frozenset(group) for group in cycles(project)]
    assert [sorted(group) for group in found if group not in KNOWN_CYCLES] == []
    assert [sorted(group) for group in KNOWN_CYCLES if group not in found] == [], (
        "stale: drop it from KNOWN_CYCLES"
    )


def test_real_code_reaches_the_stand_ins_only_through_the_listed_switches(project: list[Import]) -> None:
    assert stand_in_uses(project, stand_ins(PACKAGE), STAND_IN_USERS) == []


def test_every_listed_stand_in_and_switch_exists(project: list[Import]) -> None:
    """A stale entry would let a new import through under an old name's cover."""
    edges = {(imp.importer, imp.imported) for imp in project}
    assert len(stand_ins(PACKAGE)) > 5  # the package is where the stand-ins are
    assert [pair for pair in STAND_IN_USERS if pair not in edges] == []


def test_programs_use_one_another_only_where_listed(project: list[Import]) -> None:
    used = {
        (importer, imported)
        for imp in project
        for importer, imported in [(program_of(imp.importer), program_of(imp.imported))]
        if importer and imported and importer != imported
    }
    assert sorted(used - PROGRAMS_MAY_USE) == []
    assert sorted(PROGRAMS_MAY_USE - used) == [], "stale: drop it from PROGRAMS_MAY_USE"


def test_no_simulated_thing_is_defined_outside_the_stand_in_package() -> None:
    """``Simulated*`` is how a stand-in is named: one outside the package escaped the checks above."""
    outside = [
        f"{name}: class {node.name}"
        for name, path in modules(PACKAGE).items()
        if name not in stand_ins(PACKAGE)
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef) and node.name.startswith("Simulated")
    ]
    assert outside == []


def test_the_readme_draws_the_package_as_it_is() -> None:
    """README's "How it is built" names every folder and top-level module of the package, and no other."""
    readme = (PACKAGE.parent / "README.md").read_text()
    section = readme.split("## How it is built", 1)[1]
    tree = section.split("```", 2)[1].split("\ne2e/", 1)[0]
    drawn = set(re.findall(r"^  (?:(\w+)/|((?:\w+\.py ?)+)$)", tree, flags=re.M))
    named = {folder for folder, _ in drawn if folder} | {
        module.removesuffix(".py") for _, line in drawn for module in line.split()
    }
    actual = {
        path.stem if path.is_file() else path.name
        for path in PACKAGE.iterdir()
        if (path.is_dir() and any(path.glob("*.py"))) or (path.suffix == ".py" and path.stem != "__init__")
    }
    assert named == actual
    assert len([path for path in PACKAGE.glob("*.py") if path.stem != "__init__"]) <= 8


# --- the checker, on a planted tree ---------------------------------------------------------------


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    """A package of three layers whose imports are all fine; each test then plants one wrong one."""
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/hw.py": "import os\n",
        "low/fake.py": "from pkg.low import hw\n",
        "low/switch.py": "from pkg.low import fake, hw\n",
        "mid/__init__.py": "",
        "mid/logic.py": "from ..low.hw import thing\n",
        "top.py": "from pkg.mid import logic\nfrom pkg.low.switch import pick\n",
    }
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path / "pkg"


PLANTED_LAYERS = [("low", ("pkg", "pkg.low.*")), ("mid", ("pkg.mid.*",)), ("top", ("pkg.top",))]
PLANTED_SWITCH = {("pkg.low.switch", "pkg.low.fake")}


def test_the_checker_passes_the_planted_tree_as_it_is(planted: Path) -> None:
    found = imports(planted)
    assert {(i.importer, i.imported) for i in found} >= {
        ("pkg.mid.logic", "pkg.low.hw"),
        ("pkg.top", "pkg.mid.logic"),
    }
    assert upward(found, PLANTED_LAYERS) == []
    assert cycles(found) == []
    assert stand_in_uses(found, ["pkg.low.fake"], PLANTED_SWITCH) == []


def test_the_checker_finds_an_upward_import_wherever_it_hides(planted: Path) -> None:
    (planted / "low" / "hw.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.mid.logic import Plan\n"
        "def later():\n    from pkg import top\n"
    )
    assert upward(imports(planted), PLANTED_LAYERS) == [
        "pkg.low.hw imports pkg.mid.logic (line 3): low/ must not import mid/",
        "pkg.low.hw imports pkg.top (line 5): low/ must not import top/",
    ]


def test_the_checker_finds_a_module_imported_by_name(planted: Path) -> None:
    (planted / "mid" / "logic.py").write_text('import importlib\nimportlib.import_module("pkg.top")\n')
    assert upward(imports(planted), PLANTED_LAYERS) == [
        "pkg.mid.logic imports pkg.top (line 2): mid/ must not import top/"
    ]


def test_the_checker_finds_two_modules_importing_each_other(planted: Path) -> None:
    (planted / "mid" / "other.py").write_text("from pkg.mid import logic\n")
    (planted / "mid" / "logic.py").write_text("from . import other\n")
    assert cycles(imports(planted)) == [["pkg.mid.logic", "pkg.mid.other"]]


def test_the_checker_finds_real_code_importing_a_stand_in(planted: Path) -> None:
    (planted / "mid" / "logic.py").write_text("from pkg.low.fake import FakeGpu\n")
    assert stand_in_uses(imports(planted), ["pkg.low.fake"], PLANTED_SWITCH) == [
        "pkg.mid.logic imports pkg.low.fake (line 1)"
    ]


def test_a_module_in_no_layer_is_named(planted: Path) -> None:
    (planted / "stray.py").write_text("")
    with pytest.raises(LookupError, match=r"pkg\.stray is in no layer"):
        layer_of("pkg.stray", PLANTED_LAYERS)
