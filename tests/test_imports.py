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
