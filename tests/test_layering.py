"""The package's layering (docs/design.md §2), read from the source: every import of a
``jax_seqpar`` module, at module level or inside a function, points down a layer or
within one; no import cycle; no module imports another's private name or private module.
"""

import ast
import pathlib


ROOT = pathlib.Path(__file__).resolve().parent.parent / "jax_seqpar"
#: The layers, lowest first; a module may import its own layer and the ones before it.
LAYERS = ("core", "kernels", "strategies", "planning", "api", "flax", "examples", "tools")
#: The top-level module outside the layers: the facade that re-exports the public API.
TOP = {"jax_seqpar"}


def _modules() -> dict:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("jax_seqpar",) + path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    return LAYERS.index(module.split(".")[1])


def _package(module: str) -> str:
    is_package = MODULES[module].name == "__init__.py"
    return module if is_package else module.rpartition(".")[0]


def _imports(module: str):
    """``(imported module, name or None, line)`` for every jax_seqpar import in ``module``,
    plus ``(module, attribute, line)`` for each private attribute read off an imported
    jax_seqpar module (``plan._mesh_axes``)."""
    tree = ast.parse(MODULES[module].read_text())
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jax_seqpar"):
                    aliases[alias.asname or alias.name] = alias.name
                    yield alias.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax_seqpar"):
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in MODULES:
                    aliases[alias.asname or alias.name] = submodule
                    yield submodule, None, node.lineno
                else:
                    yield node.module, alias.name, node.lineno
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            yield aliases[node.value.id], node.attr, node.lineno


def _edges():
    for module in MODULES:
        for target, name, line in _imports(module):
            yield module, target, name, line


def test_every_module_is_in_a_layer():
    stray = [m for m in MODULES if m not in TOP and m.split(".")[1] not in LAYERS]
    assert not stray, f"modules outside the layers {LAYERS}: {stray}"


def test_imports_point_down_or_within_a_layer():
    upward = [f"{module}:{line} imports {target} (layer {LAYERS[_layer(target)]} is above "
              f"{LAYERS[_layer(module)]})"
              for module, target, _, line in _edges()
              if module not in TOP and target not in TOP and _layer(target) > _layer(module)]
    assert not upward, "\n".join(upward)


def test_no_private_names_of_other_modules():
    private = []
    for module, target, name, line in _edges():
        if target == module or module in TOP:
            continue
        if name is not None and name.startswith("_"):
            private.append(f"{module}:{line} uses {target}.{name}")
        leaf = target.rpartition(".")[2]
        if name is None and leaf.startswith("_") and _package(target) != _package(module):
            private.append(f"{module}:{line} imports the private module {target} from "
                           f"outside its package")
    assert not private, "\n".join(private)


def test_no_import_cycles():
    """No cycle among the package's imports, annotation-only ones (``if TYPE_CHECKING:``)
    included: a cycle of annotations is still two modules that cannot be read apart."""
    graph = {m: set() for m in MODULES}
    for module, target, _, _ in _edges():
        if target != module and module not in TOP:
            graph[module].add(target)
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)
