"""Every module of the package imports (catches a broken import in a module no other test
reaches), and the package exposes its public surface."""

import importlib
import pkgutil

import ep_moe


def test_every_module_imports():
    names = [m.name for m in pkgutil.walk_packages(ep_moe.__path__, prefix="ep_moe.")]
    assert "ep_moe.kernels.grouped_gemm" in names and "ep_moe.integrations.deepspeed" in names
    for name in names:
        importlib.import_module(name)


def test_public_surface():
    from ep_moe.autotune import get_kernel_configs, warmup  # noqa: F401
    from ep_moe.integrations.deepspeed import MoE, replace_deepspeed_moe  # noqa: F401

    for name in ("grouped_gemm", "MoELayer", "MoEConfig", "KernelConfig", "GemmConfigs"):
        assert hasattr(ep_moe, name), name
    from ep_moe import parallel  # what users and the trainer import from it, some defined in ep_moe.distributed

    for name in ("build_ep_groups", "init_ep_mesh", "init_parallel_mesh", "sync_gradients", "broadcast_replicated",
                 "apply_fsdp", "expert_param_names", "is_expert_param", "mark_expert_param", "resolve_ep_group"):
        assert hasattr(parallel, name), name


def _third_party_imports(root):
    """(module, file, whether the import runs when its file is imported) of every import of
    ``root``'s Python files that is neither the standard library nor the project's own."""
    import ast
    import sys

    local = {p.stem for p in root.glob("*.py")} | {"ep_moe"}
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        guarded = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.Try, ast.If))
                   for n in ast.walk(node) if n is not node}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local and top != "__future__":
                    found.append((top, path.name, id(node) not in guarded))
    return found


def test_the_package_declares_what_it_imports():
    """A module imported when the package (or the trainer) is imported is a core dependency
    of pyproject.toml; one imported lazily or under try is a core dependency or in an extra.
    numpy is core although nothing imports it by name: torch needs it to pickle objects for
    collectives (``broadcast_object_list``, DCP's metadata) and Triton's interpreter runs on it."""
    import re
    from pathlib import Path

    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    repo = Path(__file__).resolve().parents[1]
    project = tomllib.loads((repo / "pyproject.toml").read_text(encoding="utf-8"))["project"]

    def names(requirements):
        return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower().replace("-", "_") for r in requirements}

    core = names(project["dependencies"])
    extras = set().union(*(names(reqs) for reqs in project["optional-dependencies"].values())) - {"ep_moe"}
    assert "numpy" in core
    for root in (repo / "ep_moe", repo / "launch"):
        for module, file, eager in _third_party_imports(root):
            allowed = core if eager else core | extras
            assert module.lower() in allowed, (f"{root.name}/{file} imports {module} "
                                               f"{'when imported' if eager else 'lazily'}, but pyproject.toml "
                                               f"declares it {'in no extra' if not eager else 'not as a dependency'}")


# The import graph of ep_moe/: which module imports which, and the floors it must respect.

FLOORS = (
    # Bottom first. A module imports only modules of its own floor or of a lower one, never
    # one above, not even inside a function; the imports within a floor form no cycle. An entry
    # names a module or a package (all of its modules); "ep_moe" is the package's root alone
    # (ep_moe/__init__.py, the public API). A new module gets its floor here.
    ("kernels", ("ep_moe.kernels", "ep_moe.routing", "ep_moe.configs", "ep_moe._version")),
    ("distributed", ("ep_moe.distributed",)),
    ("autotune", ("ep_moe.autotune",)),
    ("config", ("ep_moe.config",)),
    ("experts", ("ep_moe.grouped_mm_experts", "ep_moe.experts")),
    ("ep", ("ep_moe.ep", "ep_moe.forward_graphs")),
    ("layer", ("ep_moe.layer", "ep_moe")),
    ("parallel", ("ep_moe.parallel", "ep_moe.checkpoint")),
    ("integrations", ("ep_moe.integrations",)),
    ("train", ("ep_moe.train", "ep_moe.cli")),
)


def _module_names(package):
    """{dotted module name: file} of every Python file of the package directory ``package``."""
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _import_graph(package):
    """{module: sorted [(imported module, line, how)]} of the package directory ``package``:
    every ``import x`` and ``from x import y`` of its own modules, absolute or relative, at
    module level (``how`` ""), under ``if TYPE_CHECKING`` ("for type checking") and inside a
    function ("lazily") alike. ``from p import m`` where ``p.m`` is a module imports ``p.m``;
    the parent packages Python imports on the way are not counted."""
    import ast

    modules = _module_names(package)
    root = package.name

    def innermost(name):  # the module ``name`` is, or the innermost one that holds it
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        return name if name in modules else None

    graph = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

        def how(node):
            found = ""
            while id(node) in parents:
                node = parents[id(node)]
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    return "lazily"
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                    found = "for type checking"
            return found

        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    package_parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = ".".join(package_parts[:len(package_parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            for target in targets:
                found = innermost(target) if target.split(".")[0] == root else None
                if found is not None and found != module:
                    edges.add((found, node.lineno, how(node)))
        graph[module] = sorted(edges)
    return graph


def _cycles(graph):
    """(group, cycle) per group of modules that import each other, directly or round others
    (Tarjan's strongly connected components): the group's modules sorted, and a shortest
    cycle ``[a, b, ..., a]`` through its first one."""
    succ = {m: sorted({target for target, _, _ in edges}) for m, edges in graph.items()}
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while not group or w != v:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
            if len(group) > 1:
                groups.append(group)

    for v in succ:
        if v not in index:
            connect(v)
    cycles = []
    for group in groups:
        start = min(group)
        came_from, queue = {start: None}, [start]
        for v in queue:  # breadth first inside the group, until an import leads back to start
            if start in succ[v]:
                path = [v]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                cycles.append((sorted(group), path[::-1] + [start]))
                break
            for w in succ[v]:
                if w in group and w not in came_from:
                    came_from[w] = v
                    queue.append(w)
    return sorted(cycles)


def _show_cycle(cycle, graph):
    """``a -> b (line 12 of a, lazily) -> ... -> a``."""
    steps = [cycle[0]]
    for a, b in zip(cycle, cycle[1:]):
        line, how = next((line, how) for target, line, how in graph[a] if target == b)
        steps.append(f"{b} (line {line} of {a}{', ' + how if how else ''})")
    return " -> ".join(steps)


def _floor_of(module, floors):
    """(index, name) of the floor of ``module`` in ``floors``, or None where no entry holds it:
    the entry naming the module or its innermost package; the root's entry holds the root alone."""
    by_entry = {entry: (i, name) for i, (name, entries) in enumerate(floors) for entry in entries}
    candidate = module
    while "." in candidate:
        if candidate in by_entry:
            return by_entry[candidate]
        candidate = candidate.rsplit(".", 1)[0]
    return by_entry.get(module)


def _upward_imports(graph, floors):
    """The modules no floor holds, and each import from a floor to a higher one, worded."""
    unplaced = sorted(m for m in graph if _floor_of(m, floors) is None)
    upward = []
    for module, edges in sorted(graph.items()):
        here = _floor_of(module, floors)
        for target, line, how in edges:
            there = _floor_of(target, floors)
            if here is not None and there is not None and there[0] > here[0]:
                upward.append(f"{module} (floor {here[1]}) imports {target} (floor {there[1]}) "
                              f"{how + ' ' if how else ''}at line {line}")
    return unplaced, upward


def _ep_moe_graph():
    from pathlib import Path

    graph = _import_graph(Path(ep_moe.__file__).parent)
    assert ("ep_moe.config", "") in {(t, how) for t, _, how in graph["ep_moe.layer"]}, "the walker lost an import"
    return graph


def test_the_import_graph_of_ep_moe_has_no_cycle():
    """No module of ep_moe/ imports itself back round others, lazily or not: a cycle means a
    function sits on the wrong floor (move it down), not that an import belongs in a function."""
    graph = _ep_moe_graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles in ep_moe/:\n" + "\n".join(
        f"{len(group)} modules import each other ({', '.join(group)}), e.g. {_show_cycle(cycle, graph)}"
        for group, cycle in cycles)


def test_imports_of_ep_moe_go_down_its_floors():
    """Every module of ep_moe/ has a floor in FLOORS (ARCHITECTURE.md's module table shows
    them), and every import, lazy or not, goes to the same floor or a lower one."""
    unplaced, upward = _upward_imports(_ep_moe_graph(), FLOORS)
    assert not unplaced, f"modules of ep_moe/ on no floor: {unplaced}; give each its floor in FLOORS"
    assert not upward, "imports that go up a floor:\n" + "\n".join(upward)


def test_architecture_shows_the_floors():
    """ARCHITECTURE.md's table of floors is FLOORS: the same floors in the same order, each
    with the same modules (``ep_moe/kernels/`` is ``ep_moe.kernels``, ``ep_moe/__init__.py``
    is ``ep_moe``)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "ARCHITECTURE.md").read_text(encoding="utf-8")
    table = re.search(r"^\| floor \| modules \|\n\|---\|---\|\n((?:\|.*\n)+)", text, re.MULTILINE)
    assert table, "ARCHITECTURE.md has no table of floors (| floor | modules |)"

    def module(path):
        return path.removesuffix("/").removesuffix("/__init__.py").removesuffix(".py").replace("/", ".")

    shown = [(cells[0], tuple(module(p) for p in re.findall(r"`([^`]+)`", cells[1])))
             for cells in ([c.strip() for c in row.strip("|").split("|")] for row in table.group(1).splitlines())]
    assert shown == [(name, entries) for name, entries in FLOORS]


def test_the_import_checks_see_every_kind_of_import(tmp_path):
    """The checks on a planted package: a relative import inside a function and an import
    under ``TYPE_CHECKING`` each close a cycle with a plain one, and each goes up a floor."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.top import Top\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "low.py").write_text("def f():\n    from ..top import Top\n    return Top\n")
    (pkg / "mid.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import top\n")
    (pkg / "top.py").write_text("import pkg.sub.low\nfrom . import mid\nclass Top: ...\n")
    graph = _import_graph(pkg)
    assert graph == {"pkg": [("pkg.top", 1, "")], "pkg.mid": [("pkg.top", 3, "for type checking")],
                     "pkg.sub": [], "pkg.sub.low": [("pkg.top", 2, "lazily")],
                     "pkg.top": [("pkg.mid", 2, ""), ("pkg.sub.low", 1, "")]}
    assert _cycles(graph) == [(["pkg.mid", "pkg.sub.low", "pkg.top"], ["pkg.mid", "pkg.top", "pkg.mid"])]
    assert _show_cycle(_cycles(graph)[0][1], graph) == ("pkg.mid -> pkg.top (line 3 of pkg.mid, for type checking) "
                                                     "-> pkg.mid (line 2 of pkg.top)")
    floors = (("bottom", ("pkg.sub", "pkg.mid")), ("top", ("pkg.top", "pkg")))
    assert _upward_imports(graph, floors) == ([], [
        "pkg.mid (floor bottom) imports pkg.top (floor top) for type checking at line 3",
        "pkg.sub.low (floor bottom) imports pkg.top (floor top) lazily at line 2"])
    assert _upward_imports(graph, floors[:1])[0] == ["pkg", "pkg.top"]
    del graph["pkg.mid"][0], graph["pkg.sub.low"][0]
    assert _cycles(graph) == [] and _upward_imports(graph, floors) == ([], [])
