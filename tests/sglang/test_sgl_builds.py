"""The sgl-deep-gemm build entries (``moewire.megamoe.builds``): detection on the public API
of the released wheels, read from their source (``deep_gemm/__init__.py`` and
``deep_gemm/mega/__init__.py``, parsed, never imported: the package loads its CUDA host
library), and the layouts the entries give."""

from __future__ import annotations

import ast
import inspect
import os
import types
from pathlib import Path

import pytest

from moewire.megamoe import flavours

WHEELS = Path(os.environ.get("MOEWIRE_SGL_DEEP_GEMM_WHEELS", ".venv-sglang/sgl-deep-gemm"))
REAL_KERNEL = Path(os.environ.get("MOEWIRE_REAL_KERNEL", ".real-kernel"))


def _defs(path: Path) -> dict[str, list[str]]:
    """Module-level functions and classes of ``path`` (also under ``if``/``try``) -> the
    parameter names (a class: its ``__init__``'s, without ``self``)."""
    found: dict[str, list[str]] = {}

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef):
                args = node.args
                found[node.name] = [a.arg for a in (*args.posonlyargs, *args.args,
                                                    *args.kwonlyargs)]
            elif isinstance(node, ast.ClassDef):
                init = next((n for n in node.body if isinstance(n, ast.FunctionDef)
                             and n.name == "__init__"), None)
                found[node.name] = [a.arg for a in init.args.args[1:]] if init else []
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
    visit(ast.parse(path.read_text()).body)
    return found


def _callable(name: str, params: list[str]):
    def fn(*args, **kwargs):
        raise AssertionError("a namespace of signatures only")

    fn.__name__ = name
    fn.__signature__ = inspect.Signature(
        [inspect.Parameter(p, inspect.Parameter.POSITIONAL_OR_KEYWORD) for p in params])
    return fn


def namespace(package: Path) -> types.SimpleNamespace:
    """The public functions of a ``deep_gemm`` package, with their parameters."""
    top = _defs(package / "__init__.py")
    mega = _defs(package / "mega" / "__init__.py") if (package / "mega").is_dir() else {}
    names = dict(top)
    for node in ast.parse((package / "__init__.py").read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            source = mega if node.module == "mega" else {}
            for alias in node.names:
                names.setdefault(alias.asname or alias.name, source.get(alias.name, []))
    return types.SimpleNamespace(**{n: _callable(n, p) for n, p in names.items()})


@pytest.mark.parametrize(("version", "build"), [("0.2.3.post2", "sgl-deep-gemm-0.2.3"),
                                                ("0.2.5", "sgl-deep-gemm-0.2.5")],
                         ids=["0.2.3.post2", "0.2.5"])
def test_released_wheel_detected(version, build):
    package = WHEELS / version / "deep_gemm"
    if not package.is_dir():
        pytest.skip(f"sgl-deep-gemm {version} is not unpacked at {package} (make test-sglang)")
    assert flavours.detect(namespace(package)).name == build


def test_pr323_is_not_taken_for_sgl_deep_gemm():
    package = REAL_KERNEL / "deep_gemm"
    if not package.is_dir():
        pytest.skip("DeepGEMM PR #323's package is not at .real-kernel")
    assert flavours.detect(namespace(package)).name == "deepgemm-sm90"


def test_layouts():
    old, new = flavours.get("sgl-deep-gemm-0.2.3"), flavours.get("sgl-deep-gemm-0.2.5")
    for flavour in (old, new):
        assert flavour.layout("fp8_mega_moe") == flavours.KernelLayout("after_l2_scales", None)
        assert {"mega_moe_pre_dispatch_sm90", "mega_moe_pre_dispatch"} <= set(
            flavour.staging_casts)
    # The shared slot k: added last by 0.2.3.post2 (ascending __ffs), first by 0.2.5.
    assert old.layout("fp8_fp4_mega_moe") == flavours.KernelLayout("after_l2_scales", "last")
    assert new.layout("fp8_fp4_mega_moe") == flavours.KernelLayout("after_l2_scales", "first")
    with pytest.raises(ValueError, match="has no Mega-MoE kernel 'nvfp4_mega_moe'"):
        new.layout("nvfp4_mega_moe")
