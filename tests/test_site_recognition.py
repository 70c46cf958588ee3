"""Site recognition (``moewire.integrations.vllm.sites.recognise``) reads calls, not text.

Each negative source differs from a recognised one only in that the staging function, the
staging cast, a required call or DeepGEMM's access is *defined*, named in a comment or a
string, or imported without being called: none of these is the structure moewire hooks.
The module is read, never run (no vLLM needed).
"""

from __future__ import annotations

import importlib
import itertools
import sys

import pytest

from moewire.integrations import _host
from moewire.integrations.vllm import sites as vllm_sites
from moewire.integrations.vllm.sites import IMPORT_ACCESS, ExpertsSite

_COUNTER = itertools.count()

STAGING = """
from torch import nn

def prepare_megamoe_inputs(*args):
    pass

def _import_deep_gemm():
    return None

class Experts(nn.Module):
    def forward(self, x):
        STAGE
        ACCESS
        return x
"""
STAGE_CALL = "prepare_megamoe_inputs(x)"
ACCESS_CALL = "dg = _import_deep_gemm()"

INLINE = """
from torch import nn

class Experts:
    def forward(self, x):
        IMPORT
        CAST
        KERNEL
        return x
"""
IMPORT = "import deep_gemm.utils as dg"
CAST = "q = dg.utils.per_token_cast_to_fp8(x)"
KERNEL = "dg.fp8_fp4_mega_moe(x, q)"


def _staging(stage: str = STAGE_CALL, access: str = ACCESS_CALL) -> str:
    return STAGING.replace("STAGE", stage).replace("ACCESS", access)


def _inline(imp: str = IMPORT, cast: str = CAST, kernel: str = KERNEL) -> str:
    return INLINE.replace("IMPORT", imp).replace("CAST", cast).replace("KERNEL", kernel)


@pytest.fixture
def load(tmp_path, monkeypatch):
    """``load(source)``: the class ``Experts`` of a fresh module holding ``source``."""
    monkeypatch.syspath_prepend(str(tmp_path))
    names = []

    def _load(source: str) -> type:
        name = f"moewire_recognise_case_{next(_COUNTER)}"
        (tmp_path / f"{name}.py").write_text(source)
        names.append(name)
        return importlib.import_module(name).Experts

    yield _load
    for name in names:
        sys.modules.pop(name, None)


def _staging_site(module: str) -> ExpertsSite:
    return ExpertsSite(module, "Experts")


def _inline_site(module: str) -> ExpertsSite:
    return ExpertsSite(module, "Experts", stage_fn=None, stage_cast="per_token_cast_to_fp8",
                       calls=("fp8_fp4_mega_moe(",), kernel_access=IMPORT_ACCESS,
                       buffer="buffer", holder="experts", holder_class="torch.nn:Module")


NEVER_STAGES = "never calls prepare_megamoe_inputs(...)"
NO_ACCESS = "does not reach DeepGEMM through _import_deep_gemm()"


@pytest.mark.parametrize(
    "source, why",
    [
        (_staging(), None),
        (_staging(stage="y = [prepare_megamoe_inputs(t) for t in (x,)]"), None),
        (_staging(stage="pass  # prepare_megamoe_inputs(x)"), NEVER_STAGES),
        (_staging(stage='"prepare_megamoe_inputs(x) is called by the caller"'), NEVER_STAGES),
        (_staging(stage="f = f'{x}prepare_megamoe_inputs(x)'"), NEVER_STAGES),
        (_staging(stage="def  prepare_megamoe_inputs(y): pass"), NEVER_STAGES),
        (_staging(stage="async def prepare_megamoe_inputs(y): pass"), NEVER_STAGES),
        (_staging(stage="stage = prepare_megamoe_inputs"), NEVER_STAGES),
        (_staging(access="pass  # dg = _import_deep_gemm()"), NO_ACCESS),
        (_staging(access="doc = 'reaches DeepGEMM via _import_deep_gemm()'"), NO_ACCESS),
        (_staging(access="def _import_deep_gemm(): pass"), NO_ACCESS),
        (_staging(access="fn = _import_deep_gemm"), NO_ACCESS),
    ],
    ids=["called", "called-in-a-comprehension", "comment", "docstring-like-string",
         "f-string", "defined-two-spaces", "defined-async", "referenced-not-called",
         "access-in-comment", "access-in-string", "access-defined", "access-referenced"],
)
def test_staging_site_needs_real_calls(load, source, why):
    cls = load(source)
    got = vllm_sites.recognise(cls, _staging_site(cls.__module__))
    if why is None:
        assert got is None
    else:
        assert got == f"{cls.__module__} {why}"


@pytest.mark.parametrize(
    "source, why",
    [
        (_inline(), None),
        (_inline(imp="import deep_gemm as dg"), None),
        (_inline(cast="q = per_token_cast_to_fp8(x)"), "never calls per_token_cast_to_fp8(...)"),
        (_inline(cast="def per_token_cast_to_fp8(t): pass"),
         "never calls per_token_cast_to_fp8(...)"),
        (_inline(cast="# q = dg.utils.per_token_cast_to_fp8(x)"),
         "never calls per_token_cast_to_fp8(...)"),
        (_inline(kernel="'dg.fp8_fp4_mega_moe(x, q)'"), "never calls fp8_fp4_mega_moe(...)"),
        (_inline(kernel="def fp8_fp4_mega_moe(y): pass"), "never calls fp8_fp4_mega_moe(...)"),
        (_inline(imp="dg = None  # import deep_gemm"),
         "does not reach DeepGEMM through import deep_gemm"),
        (_inline(imp="dg = __import__('sys')  # 'import deep_gemm'"),
         "does not reach DeepGEMM through import deep_gemm"),
        (_inline(imp="import deep_gemm_other as dg"),
         "does not reach DeepGEMM through import deep_gemm"),
    ],
    ids=["import-submodule", "import-module", "cast-called-bare", "cast-defined",
         "cast-in-comment", "kernel-in-string", "kernel-defined", "import-in-comment",
         "import-in-string", "import-of-another-module"],
)
def test_inline_site_needs_real_calls_and_import(load, source, why):
    cls = load(source)
    got = vllm_sites.recognise(cls, _inline_site(cls.__module__))
    if why is None:
        assert got is None
    else:
        assert got == f"{cls.__module__} {why}"


def test_a_module_whose_source_does_not_parse_is_not_recognised(load, monkeypatch):
    cls = load(_staging())
    monkeypatch.setattr(_host, "_module_source", lambda name: "def broken(:\n")
    assert vllm_sites.recognise(cls, _staging_site(cls.__module__)) == (
        f"the source of {cls.__module__} cannot be read"
    )
