"""The package's shape: the module map in docs/architecture.md lists exactly its files, imports
form no circle, no module outgrows 400 lines, and the adapters use the core's public names."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvcomm_agents"
INTEGRATIONS = ROOT / "integrations"
#: what an adapter may import from the core: the package itself and its public subpackages
PUBLIC = {"kvcomm_agents", "kvcomm_agents.paged", "kvcomm_agents.framing", "kvcomm_agents.errors"}


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every Python file under ``root`` (packages by __init__)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _top_level_imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules ``name`` imports when it is imported: statements at module level and under
    ``if`` blocks (``TYPE_CHECKING`` included), not inside functions. ``from package import
    module`` imports the module (the package is already being imported)."""
    tree = ast.parse(path.read_text())
    package = name if _is_package(path) else name.rpartition(".")[0]
    targets: set[str] = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    targets.add(sub if sub in modules else module)

    visit(tree.body)
    return targets


def test_the_module_map_lists_every_module_of_the_package_and_nothing_else():
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"<!-- module map -->\s*```\n(.*?)```\s*<!-- end module map -->", text, re.S)
    assert block, "docs/architecture.md has no marked module map"
    listed = [line.split()[0] for line in block.group(1).splitlines() if line.strip()]
    files = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py") if path.name != "__init__.py")
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert sorted(listed) == files, (
        f"missing from the map: {sorted(set(files) - set(listed))}; not in the package: {sorted(set(listed) - set(files))}")


def test_the_core_and_the_adapters_import_without_circles():
    modules = {**_modules(PACKAGE), **_modules(INTEGRATIONS / "kvcomm_vllm"),
               **_modules(INTEGRATIONS / "kvcomm_langgraph")}
    graph = {name: sorted(target for target in _top_level_imports(name, path, modules) if target in modules and target != name)
             for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def walk(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in graph[name]:
            assert state.get(target) != 1, "import circle: " + " -> ".join(path[path.index(target):] + [target])
            if target not in state:
                walk(target, path + [target])
        state[name] = 2

    for name in graph:
        if name not in state:
            walk(name, [name])
    assert graph["kvcomm_agents.call"] and "kvcomm_agents.engine" not in graph["kvcomm_agents.call"]


def test_no_module_is_over_400_lines():
    long = {str(path.relative_to(ROOT)): n for root in (PACKAGE, INTEGRATIONS) for path in root.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 400}
    assert not long, long


def test_the_adapters_use_the_cores_public_names_and_the_core_no_framework():
    for path in INTEGRATIONS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvcomm_agents"):
                assert node.module in PUBLIC, f"{path.relative_to(ROOT)} imports {node.module}"
    frameworks = ("langchain", "langgraph", "vllm", "ray", "kvcomm_vllm", "kvcomm_langgraph", "integrations")
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            assert not any(n.split(".")[0] in frameworks for n in names), f"{path.relative_to(ROOT)} imports {names}"
