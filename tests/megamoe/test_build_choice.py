"""Choosing a DeepGEMM build (``flavours.detect``): the builds' facts are exclusive.

A module that two builds' facts fit cannot be told apart by moewire (their combine layouts
differ), so ``detect`` refuses it rather than letting the registry's order decide. The
exclusivity is checked over every module that can be built from the facts the registered
builds name: each is recognised by one build at most, whatever the registry's order.
"""

from __future__ import annotations

import itertools
from types import ModuleType

import pytest

from moewire.megamoe import builds, flavours
from moewire.megamoe.builds import Recognition


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(flavours.ENV_FLAVOUR, raising=False)


def _fn(params: tuple[str, ...]):
    namespace: dict = {}
    exec(f"def fn({', '.join(params)}): return None", namespace)  # a real signature
    return namespace["fn"]


def _module(functions: dict[str, tuple[str, ...]]) -> ModuleType:
    module = ModuleType("deep_gemm")
    for name, params in functions.items():
        setattr(module, name, _fn(params))
    return module


def _facts() -> tuple[list[str], dict[str, list[str]]]:
    """Every function name the registered builds look at, and the parameters looked for
    per function."""
    names: set[str] = set()
    params: dict[str, set[str]] = {}
    for flav in map(flavours.get, flavours.names()):
        r = flav.recognition
        if r is None:
            continue
        names.update(r.functions, r.absent)
        for fn, p in (*r.takes, *r.lacks_parameter):
            params.setdefault(fn, set()).add(p)
    plain = sorted(names - set(params))
    return plain, {fn: sorted(ps) for fn, ps in params.items()}


def _every_module():
    """Every module over the facts: each plain function present or not; each function
    with looked-for parameters absent, or present with each subset of them."""
    plain, params = _facts()
    variants = []
    for fn, ps in params.items():
        subsets = [c for n in range(len(ps) + 1) for c in itertools.combinations(ps, n)]
        variants.append([None, *[(fn, ("group", *s)) for s in subsets]])
    for present in itertools.product([False, True], repeat=len(plain)):
        for choice in itertools.product(*variants):
            kept = [n for n, p in zip(plain, present, strict=True) if p]
            functions = {n: ("y", "l1", "l2", "sym_buffer") for n in kept}
            functions.update(dict(c for c in choice if c is not None))
            yield functions


def _recognisers(module: ModuleType) -> list[str]:
    return [n for n in flavours.names() if flavours.get(n).recognise(module)]


def test_no_module_is_two_builds():
    """Break: drop an ``absent`` or ``lacks_parameter`` fact of one build (the SM90 fork's
    functions are a superset of PR #323's): some module then fits two builds."""
    checked = 0
    for functions in _every_module():
        found = _recognisers(_module(functions))
        assert len(found) <= 1, f"{sorted(functions)} is recognised as {found}"
        checked += 1
    assert checked >= 2 ** 6  # the facts of the five builds span at least this many


@pytest.mark.parametrize("build", builds.BUILDS, ids=[b.name for b in builds.BUILDS])
def test_each_builds_own_facts_detect_that_build(build):
    r = build.recognition
    functions = {n: ("y",) for n in r.functions}
    for fn, p in r.takes:
        functions[fn] = (*functions.get(fn, ("group",)), p)
    assert flavours.detect(_module(functions)).name == build.name


def _loose() -> flavours.Flavour:
    """A build whose facts overlap vLLM 0.32's (a shared-expert buffer, no other fact)."""
    return flavours.Flavour.from_build(builds.Build(
        "loose-test-build", {"fp8_fp4_mega_moe": builds.KernelLayout("last_region", "first")},
        Recognition(("get_symm_buffer_for_mega_moe",)), "a test build", read="none"))


_BUNDLED_032 = {"get_symm_buffer_for_mega_moe": ("group", "num_shared_experts"),
                "fp8_fp4_mega_moe": ("y",)}


def test_the_registry_order_decides_nothing(monkeypatch):
    """Break: return the first flavour that recognises the module (the old rule): with the
    loose build registered, vLLM 0.32's module detects as vllm-0.32 in one order and as
    the loose build in the other."""

    def outcome(module):
        try:
            return flavours.detect(module).name
        except RuntimeError as exc:
            return "refused" if "has the facts of" in str(exc) else "unknown"

    monkeypatch.setitem(flavours._REGISTRY, "loose-test-build", _loose())
    modules = [_module(_BUNDLED_032),
               *(_module(f) for f in itertools.islice(_every_module(), 0, None, 5))]
    forward = [outcome(m) for m in modules]
    monkeypatch.setattr(flavours, "_REGISTRY", dict(reversed(flavours._REGISTRY.items())))
    assert [outcome(m) for m in modules] == forward
    assert forward[0] == "refused"


def test_a_module_two_builds_fit_is_refused(monkeypatch):
    """With a build whose facts overlap vLLM 0.32's registered, the bundled 0.32 module
    fits both, and detect names both instead of picking one."""
    monkeypatch.setitem(flavours._REGISTRY, "loose-test-build", _loose())
    module = _module(_BUNDLED_032)
    with pytest.raises(RuntimeError) as info:
        flavours.detect(module, "layers.0.experts")
    message = str(info.value)
    assert message.startswith("layers.0.experts: the DeepGEMM module 'deep_gemm' (no file) has "
                              "the facts of 2 builds: vllm-0.32 (")
    assert "loose-test-build (get_symm_buffer_for_mega_moe)" in message
    assert f"Set {flavours.ENV_FLAVOUR} to the build you run" in message
    monkeypatch.setenv(flavours.ENV_FLAVOUR, "vllm-0.32")
    assert flavours.detect(module).name == "vllm-0.32"


@pytest.mark.parametrize(
    "functions, want",
    [
        ({n: ("y",) for n in builds.SM90_FORK_FUNCTIONS}, "deepgemm-sm90-fork"),
        ({n: ("y",) for n in builds.SM90_FORK_FUNCTIONS[:2]}, None),
        ({"get_symm_buffer_for_sm90_mega_moe": ("group",), "fp8_mega_moe": ("y",),
          "get_symm_buffer_for_mega_moe": ("group", "num_shared_experts")}, None),
        ({"get_symm_buffer_for_sm90_mega_moe": ("group",), "fp8_mega_moe": ("y",),
          "get_symm_buffer_for_mega_moe": ("group",)}, "deepgemm-sm90"),
    ],
    ids=["sm90-fork", "sm90-fork-without-its-weight-transform", "sm90-with-a-shared-buffer",
         "sm90-pr323-with-upstream-buffer"],
)
def test_modules_between_builds(functions, want):
    """The SM90 fork's functions include PR #323's buffer; a fork module without all of
    them, or an SM90 module with a shared-expert buffer (no build read has both), is no
    build moewire knows: refused, not guessed."""
    module = _module(functions)
    if want is not None:
        assert flavours.detect(module).name == want
    else:
        with pytest.raises(RuntimeError, match="is no build moewire knows"):
            flavours.detect(module)
