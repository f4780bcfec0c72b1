"""The library's layout: no import cycle between the modules of `jaxdec/` and
`pallas_kernels/`, no folder over a quarter of the library's lines, and no module reaching
into another's private names.

Every import counts, a lazy one inside a function too (a cycle broken only by deferring an
import is still a cycle in the design); `if TYPE_CHECKING:` blocks do not.
"""

from __future__ import annotations

import ast
import pathlib

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOT = REPO / "jaxdec"
PACKAGES = ("jaxdec", "pallas_kernels")


def _module(path: pathlib.Path, repo: pathlib.Path) -> str:
    parts = path.relative_to(repo).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(repo: pathlib.Path = REPO, packages=PACKAGES) -> dict[str, pathlib.Path]:
    return {_module(p, repo): p for pkg in packages for p in sorted((repo / pkg).rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: pathlib.Path, modules: set[str],
             packages=PACKAGES) -> list[tuple[str, list[str]]]:
    """(module imported, [names taken from it]) for every import of `packages` in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for c in child.orelse:
                    visit(c)
                continue
            if isinstance(child, ast.Import):
                out.extend((a.name, []) for a in child.names if a.name.split(".")[0] in packages)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[:len(base) - child.level + 1]
                    src = ".".join(base + ([child.module] if child.module else []))
                else:
                    src = child.module or ""
                if src.split(".")[0] not in packages:
                    continue
                for a in child.names:  # `from jaxdec.cache import dense` imports a module
                    sub = f"{src}.{a.name}"
                    out.append((sub, []) if sub in modules else (src, [a.name]))
            visit(child)

    visit(tree)
    return out


def _owner(mod: str, modules: set[str]) -> str:
    while mod not in modules:
        mod = mod.rpartition(".")[0]
    return mod


def _graph(repo: pathlib.Path = REPO, packages=PACKAGES) -> dict[str, set[str]]:
    sources = _sources(repo, packages)
    modules = set(sources)
    graph = {m: set() for m in modules}
    for name, path in sources.items():
        for mod, _ in _imports(name, path, modules, packages):
            dst = _owner(mod, modules)
            if dst != name:
                graph[name].add(dst)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
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

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycle_between_modules():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_fail_on_a_temporary_module_that_breaks_them(tmp_path):
    """A copy of the real tree plus one module that imports back into its importer, and one
    that takes a private name: both checks must name them (and pass without them)."""
    import shutil
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("csrc", "__pycache__"))
    assert _cycles(_graph(tmp_path)) == [] and _private_reach_ins(tmp_path) == []
    _write(tmp_path, {
        "jaxdec/zz_cycle.py": "from jaxdec import api\n",
        "jaxdec/api.py": (REPO / "jaxdec/api.py").read_text() + "\nfrom jaxdec import zz_cycle\n",
        "pallas_kernels/zz_private.py": "from jaxdec.cache import entry\nx = entry._private_thing\n",
        "jaxdec/zz_private2.py": "from jaxdec.api import _secret\n",
    })
    cycles = _cycles(_graph(tmp_path))
    assert any({"jaxdec.api", "jaxdec.zz_cycle"} <= set(c) for c in cycles), cycles
    bad = _private_reach_ins(tmp_path)
    assert "pallas_kernels.zz_private uses entry._private_thing" in bad, bad
    assert "jaxdec.zz_private2 imports jaxdec.api._secret" in bad, bad


def test_no_module_takes_another_modules_private_names():
    bad = _private_reach_ins()
    assert not bad, "\n".join(bad)


def _private_reach_ins(repo: pathlib.Path = REPO, packages=PACKAGES) -> list[str]:
    sources = _sources(repo, packages)
    modules = set(sources)
    bad = []
    for name, path in sources.items():
        for mod, names in _imports(name, path, modules, packages):
            bad += [f"{name} imports {mod}.{n}" for n in names
                    if n.startswith("_") and not n.startswith("__") and _owner(mod, modules) != name]
        text = path.read_text()
        tree = ast.parse(text)
        aliases = {a.asname or a.name.rsplit(".", 1)[-1]: f"{node.module or ''}.{a.name}"
                   for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   for a in node.names}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and aliases[node.value.id].lstrip(".") and
                    _is_module_alias(aliases[node.value.id], name, modules)):
                bad.append(f"{name} uses {node.value.id}.{node.attr}")
    return sorted(set(bad))


def _is_module_alias(spec: str, name: str, modules: set[str]) -> bool:
    """Whether `spec` (from an ImportFrom: "module.name") names another jaxdec module."""
    if spec.split(".")[0] in PACKAGES:
        return spec in modules and spec != name
    package = name.rpartition(".")[0]
    return f"{package}.{spec.lstrip('.')}" in modules


def test_no_folder_holds_over_a_quarter_of_the_library():
    lines = {p: len(p.read_text().splitlines()) for p in ROOT.rglob("*") if p.suffix in (".py", ".cc", ".h", ".cpp")}
    total = sum(lines.values())
    folders = {}
    for p, n in lines.items():
        rel = p.relative_to(ROOT)
        if len(rel.parts) > 1:
            folders[rel.parts[0]] = folders.get(rel.parts[0], 0) + n
    big = {f: n for f, n in folders.items() if n > total / 4}
    assert folders and not big, (big, total)
