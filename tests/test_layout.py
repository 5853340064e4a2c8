"""The package's layers import one way: kernels and sampling, then ops, layers, models, the shared
fixed-shape steps, drafters, the engine, and last the server, development code (the benchmark
harness) and the command line. A module may import its own layer or any below it, never one above."""
import ast
from pathlib import Path

import specengine

LAYERS = ["kernels", "_C", "sampling", "ops", "layers", "models", "tokenizer", "steps", "drafters", "engine",
          "shipped", "server", "devtools", "demo", "cli", "__main__"]
ROOT = Path(specengine.__file__).parent


def imports(path: Path, module: str):
    """(line, imported module) of every `from ... import` in a file, relative ones resolved."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            yield node.lineno, ".".join(base + ([node.module] if node.module else [])) if node.level else node.module
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def layer_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "specengine" and len(parts) > 1 else None


def test_imports_point_one_way():
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join(("specengine", *path.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        own = layer_of(module)
        if own is None:
            continue  # the package's __init__ re-exports the API
        assert own in LAYERS, f"{module}: add its layer to LAYERS"
        for line, target in imports(path, module):
            other = layer_of(target or "")
            if other is not None and other in LAYERS and LAYERS.index(other) > LAYERS.index(own):
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} ({own}) imports {target} ({other})")
    assert not upward, "imports that point upward:\n" + "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path):
    path = tmp_path / "model.py"
    path.write_text("from ..engine.graphs import FixedShapeSteps\nfrom .base import Proposal\n")
    assert list(imports(path, "specengine.drafters.model")) == [(1, "specengine.engine.graphs"),
                                                                  (2, "specengine.drafters.base")]
