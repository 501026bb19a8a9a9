"""The core op imports nothing of DTensor or FSDP2; the distributed layer registers what it needs.

import-linter (``lint-imports``) checks the layer order, but its forbidden contracts take only
top-level external packages (``torch``, not ``torch.distributed.tensor``), so this test reads
the imports of the core modules with ``ast``: every import statement, also inside functions.
"""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import fp8func
from fp8func import _hooks

PACKAGE = pathlib.Path(fp8func.__file__).parent

# The pure core but the modules that speak DTensor's vocabulary by design: ``_sharding`` (a mesh and
# its placements), ``_ops`` (quantize of a DTensor), ``_collectives`` and ``_gathered`` (collectives
# over a mesh, gathered casts of DTensor weights) and ``_gemm`` (the GEMM of DTensor operands).
CORE = ["_formats", "_hooks", "_metrics", "_structural", "_scaling", "_qtensor", "_delayed", "_plan", "kernels",
        "_casts", "_operands", "_autograd", "_grouped"]
FORBIDDEN = ("torch.distributed.tensor", "torch.distributed._tensor", "torch.distributed.fsdp",
             "torch.distributed._composable")


def _files(name: str) -> list[pathlib.Path]:
    path = PACKAGE / name
    return sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]


def _imported(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in ``tree``; ``from a import b`` gives ``a.b`` too."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _forbidden(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FORBIDDEN)


@pytest.mark.parametrize("name", CORE)
def test_the_core_imports_nothing_of_dtensor_or_fsdp(name):
    files = _files(name)
    assert files and all(f.exists() for f in files), f"fp8func.{name}: no such module (update CORE)"
    bad = [f"{f.relative_to(PACKAGE.parent)}:{line}: {module}" for f in files
           for line, module in _imported(ast.parse(f.read_text())) if _forbidden(module)]
    assert not bad, ("the core op asks fp8func._hooks about distributed tensors, answered by fp8func.distributed; "
                     "it imports none of " + ", ".join(FORBIDDEN) + ":\n" + "\n".join(bad))


def test_the_scan_sees_the_import_forms():
    src = ("import torch.distributed.tensor\nfrom torch.distributed import fsdp\n"
           "def f():\n    from torch.distributed.tensor import DTensor\n")
    assert sorted({line for line, m in _imported(ast.parse(src)) if _forbidden(m)}) == [1, 2, 4]


def test_importing_fp8func_registers_the_dtensor_answers():
    from fp8func.distributed._dtensor import DTENSOR_HOOKS

    assert _hooks.registered() is DTENSOR_HOOKS
    t = torch.ones(3)
    assert not _hooks.is_distributed(t) and _hooks.full_tensor(t) is t


def test_register_distributed_refuses_anything_but_hooks():
    with pytest.raises(TypeError, match="expected a DistributedHooks"):
        _hooks.register_distributed({"is_distributed": bool})
