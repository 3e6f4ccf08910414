"""The package's shape, checked from its source: every import inside speclab resolves (a moved module leaves no
import that only fails when its code path runs), no import circles (lazy imports included), no module reaches
into another's private names, and every dotted speclab name in backticks in the code, the docs and the
notebooks exists."""

from __future__ import annotations

import ast
import importlib
import json
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "speclab"
LAYERS = ("engine", "models", "drafters", "serve", "load", "analysis", "app", "family", "viz")


KERNELS = ROOT / "kernels"  # installed as speclab.kernels (setup.py; a checkout: speclab/__init__.py)


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    out["speclab.kernels"] = KERNELS
    for p in KERNELS.glob("*.py"):
        out[f"speclab.kernels.{p.stem}"] = p
    return out


MODULES = _modules()


@lru_cache(maxsize=None)
def _tree(name: str) -> ast.Module:
    path = MODULES[name]
    return ast.parse(path.read_text(encoding="utf-8") if path.is_file() else "")  # a folder: a namespace package


def _target(module: str, node: ast.ImportFrom) -> str | None:
    """The absolute module an ``ImportFrom`` in ``module`` names."""
    if node.level == 0:
        return node.module
    base = module.split(".")
    if MODULES[module].name != "__init__.py" and MODULES[module].is_file():
        base = base[:-1]
    if node.level > 1:
        base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str):
    """(line, imported module, names) for every speclab import in ``module``, at any depth (lazy ones too)."""
    for node in ast.walk(_tree(module)):
        if isinstance(node, ast.ImportFrom):
            t = _target(module, node)
            if t and (t == "speclab" or t.startswith("speclab.")):
                yield node.lineno, t, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "speclab" or a.name.startswith("speclab."):
                    yield node.lineno, a.name, []


@lru_cache(maxsize=None)
def _defined(module: str) -> frozenset[str]:
    """Names a module binds at its top level (also inside if/try blocks), plus the lazy exports in ``__all__``."""
    names: set[str] = set()

    def bind(target):
        for n in ast.walk(target):
            if isinstance(n, ast.Name):
                names.add(n.id)

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    bind(t)
                    if isinstance(t, ast.Name) and t.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                        names.update(e.value for e in node.value.elts if isinstance(e, ast.Constant))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                bind(node.target)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)

    visit(_tree(module).body)
    return frozenset(names)


def _exports(module: str) -> set[str]:
    """A package's lazy exports: the keys of a module-level ``_EXPORTS`` dict (served by ``__getattr__``)."""
    for node in _tree(module).body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
                and isinstance(node.value, ast.Dict)):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return set()


def test_the_design_layers_are_packages():
    for layer in LAYERS:
        assert f"speclab.{layer}" in MODULES, f"speclab/{layer}/ is missing"


def test_every_import_inside_speclab_resolves():
    """A moved module must not leave an import behind that fails only when its code path runs (as
    ``speclab.family.train`` importing ``.report`` after the acceptance report moved to ``speclab.analysis``)."""
    bad = []
    for m in sorted(MODULES):
        for line, t, names in _imports(m):
            where = f"{MODULES[m].relative_to(ROOT)}:{line}"
            if t not in MODULES:
                bad.append(f"{where}: no module {t}")
                continue
            for name in names:
                if name != "*" and name not in _defined(t) and name not in _exports(t) and f"{t}.{name}" not in MODULES:
                    bad.append(f"{where}: {t} has no {name}")
    assert not bad, "\n".join(bad)


def _graph() -> dict[str, set[str]]:
    """module -> the speclab modules it imports, lazily or not. ``from pkg import sub`` is an edge to ``pkg.sub``
    only: a package is always imported before its modules, and that is not a circle."""
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for _, t, names in _imports(m):
            subs = [f"{t}.{n}" for n in names if f"{t}.{n}" in MODULES]
            if subs:
                g[m].update(subs)
            if not names or len(subs) < len(names):
                g[m].add(t)
        g[m].discard(m)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iteratively)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in g:
                    continue
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_cycle_finder_finds_a_planted_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(g) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles_lazy_imports_included():
    circles = _cycles(_graph())
    assert not circles, "import circles (a lazy import hides one, it does not remove it):\n" + "\n".join(
        " <-> ".join(c) for c in circles)


# Dependencies point down: app -> serve/load/analysis -> engine -> models. For each package, the packages it may never
# import, lazily or not (a lazy import inside a function hides an upward tie, it does not make it right). The engine
# owns the drafting contracts, so drafters plug into it from above; models sit below the engine (a model knows nothing
# of decoding) and kernels below everything (tested apart: they import nothing of speclab).
UPWARD = ("drafters", "serve", "load", "analysis", "app", "family", "cli", "nb", "viz")
FORBIDDEN = {
    "engine": set(UPWARD),
    "models": {"engine"} | set(UPWARD),
    "drafters": {"serve", "load", "analysis", "app", "cli", "nb", "viz"},
    "family": {"analysis", "serve", "load", "app", "cli", "nb", "viz"},
    "serve": {"analysis", "app", "cli", "nb", "viz"},
    "load": {"serve", "analysis", "app", "cli", "nb", "viz"},
    "events": {"engine", "models"} | set(UPWARD),
    "metrics": {"engine", "models"} | set(UPWARD),
}


def _package(module: str) -> str:
    """speclab.engine.round -> engine; speclab.errors -> errors."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _upward_imports(modules) -> list[tuple[str, int, str]]:
    """(module, line, imported module) for each import that points up."""
    return [(m, line, t) for m in sorted(modules) for line, t, _ in _imports(m)
            if _package(t) in FORBIDDEN.get(_package(m), ())]


def test_imports_point_down_between_packages():
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: {_package(m)} -> {t}" for m, line, t in _upward_imports(MODULES)]
    assert not bad, "imports that point up (a lower package importing a higher one):\n" + "\n".join(bad)


def test_the_direction_check_sees_a_lazy_upward_import(tmp_path, monkeypatch):
    """A function-local import of a drafter from the engine is caught, as a top-level one is."""
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from ..drafters.base import StatelessDrafter\n    return StatelessDrafter\n")
    monkeypatch.setitem(MODULES, "speclab.engine.planted", planted)
    _tree.cache_clear()
    try:
        assert _upward_imports(["speclab.engine.planted"]) == [("speclab.engine.planted", 2, "speclab.drafters.base")]
    finally:
        _tree.cache_clear()


def test_no_engine_function_is_longer_than_a_screen():
    """The decode loop reads top to bottom: no function of the engine (or a kernel) over 80 lines."""
    long = []
    for m, path in MODULES.items():
        if _package(m) not in ("engine", "kernels"):
            continue
        for node in ast.walk(_tree(m)):
            size = node.end_lineno - node.lineno + 1 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else 0
            if size > 80:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name} ({size} lines)")
    assert not long, "\n".join(long)


def test_no_module_reaches_into_another_modules_private_names():
    bad = []
    for m in sorted(MODULES):
        modules_bound = {}  # local name -> speclab module it is bound to
        for line, t, names in _imports(m):
            where = f"{MODULES[m].relative_to(ROOT)}:{line}"
            for name in names:
                if name.startswith("_") and not name.startswith("__"):
                    bad.append(f"{where}: from {t} import {name}")
        for node in ast.walk(_tree(m)):
            if isinstance(node, ast.ImportFrom):
                t = _target(m, node)
                for a in node.names:
                    if t and f"{t}.{a.name}" in MODULES:
                        modules_bound[a.asname or a.name] = f"{t}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("speclab.") and a.asname:
                        modules_bound[a.asname] = a.name
        for node in ast.walk(_tree(m)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules_bound and node.attr.startswith("_")
                    and not node.attr.startswith("__") and modules_bound[node.value.id] != m):
                bad.append(f"{MODULES[m].relative_to(ROOT)}:{node.lineno}: {modules_bound[node.value.id]}.{node.attr}")
    assert not bad, "\n".join(bad)


REF = re.compile(r"`(?::\w+:`)?(speclab(?:\.[A-Za-z_]\w*)+)")  # `speclab.x.y` or :func:`speclab.x.y`


def _texts():
    for p in sorted(PKG.rglob("*.py")):
        yield p, p.read_text(encoding="utf-8")
    for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        yield p, p.read_text(encoding="utf-8")
    for p in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(p.read_text(encoding="utf-8"))
        yield p, "\n".join("".join(c.get("source", [])) for c in nb.get("cells", []))


def _exists(ref: str) -> bool:
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name not in MODULES:
            continue
        obj = importlib.import_module(name)
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_speclab_name_in_backticks_exists():
    pytest.importorskip("gradio")  # the app's modules import it
    bad = []
    for path, text in _texts():
        for line_no, line in enumerate(text.splitlines(), 1):
            for m in REF.finditer(line):
                ref = m.group(1)
                if not _exists(ref):
                    bad.append(f"{path.relative_to(ROOT)}:{line_no}: {ref}")
    assert not bad, "names that do not exist (moved or renamed?):\n" + "\n".join(bad)


def test_only_the_apps_layout_imports_gradio():
    """Each tab's logic (the modules of speclab/app/ outside its ui/ package) is Gradio-free, so it is tested
    without a browser."""
    bad = []
    for m in MODULES:
        if not m.startswith("speclab.") or m == "speclab.app" or m.split(".")[:3] == ["speclab", "app", "ui"]:
            continue
        for node in ast.walk(_tree(m)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(n == "gradio" or n.startswith("gradio.") for n in names):
                bad.append(f"{MODULES[m].relative_to(ROOT)}:{node.lineno}")
    assert not bad, "Gradio imported outside speclab/app/ui/:\n" + "\n".join(bad)


def test_no_top_level_folder_shadows_an_installed_package():
    """A top-level package of ours shadows an installed package of that name whenever the checkout is on sys.path
    (tests, scripts, notebooks run from it). ``kernels`` and ``datasets`` are Hugging Face's libraries, which
    transformers imports: with a top-level ``kernels`` package of ours, every model load failed. So the top-level
    ``kernels/`` and ``datasets/`` folders have no ``__init__.py`` (a namespace folder never stands in for an installed
    package, and transformers takes a namespace for no install), and setup.py installs them inside the package."""
    import importlib.metadata

    ours = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    installed = importlib.metadata.packages_distributions()
    assert "speclab" in ours and not [n for n in ours if n != "speclab" and n in installed], ours
    for folder in ("kernels", "datasets"):
        assert (ROOT / folder).is_dir() and not (ROOT / folder / "__init__.py").exists(), folder
    setup = (ROOT / "setup.py").read_text()
    assert '"speclab.kernels"]' in setup and '"speclab.kernels": "kernels"' in setup
    assert "[tool.setuptools.packages" not in (ROOT / "pyproject.toml").read_text()  # it would override setup.py's


def test_the_kernels_load_from_the_top_level_folder():
    import speclab.kernels.rejection as rejection

    assert Path(rejection.__file__).resolve() == (KERNELS / "rejection.py").resolve()


def test_the_kernels_import_nothing_of_speclab():
    """The engine imports the kernels; a kernel importing the engine back would be a circle."""
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: {t}" for m in MODULES if m.startswith("speclab.kernels")
           for line, t, _ in _imports(m)]
    assert not bad, bad
