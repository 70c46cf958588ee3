"""The catalogue of kernel builds is the one table every chooser reads, and each stand-in row
is what the stand-in's kernel API and weight conversion do."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moewire.reference import catalogue, deep_gemm
from moewire.reference.dense import from_dense, kernel_kwargs

STAND_IN_ROWS = catalogue.builds(catalogue.STAND_IN)


def test_the_catalogue_imports_without_torch():
    code = ("import sys, moewire.reference.catalogue, moewire.study.settings; "
            "assert 'torch' not in sys.modules, 'torch loaded'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_row_names_a_weight_form_and_each_kernel_mma_pair_once():
    pairs = [(b.kernel, b.mma_type) for b in catalogue.BUILDS]
    assert len(pairs) == len(set(pairs))
    assert all(b.weights in catalogue.WEIGHT_FORMS for b in catalogue.BUILDS)


@pytest.mark.parametrize("row", STAND_IN_ROWS, ids=lambda b: b.mma_type)
def test_a_stand_in_row_names_a_kernel_of_the_api(row):
    assert callable(getattr(deep_gemm, row.function))
    assert deep_gemm.MMA_OF_KERNEL[row.function] == row.mma_type
    assert catalogue.real(row.kernel) is None


@pytest.mark.parametrize("row", [b for b in STAND_IN_ROWS if b.mma_type in deep_gemm.MMA_TYPES],
                         ids=lambda b: b.mma_type)
def test_the_stand_in_buffer_refuses_what_the_row_refuses(row):
    h = row.hidden_multiple
    # fp4xfp4 is DeepGEMM 2.8.0's kernel alone (reference.fp4_fp4.FLAVOUR).
    with deep_gemm.use_flavour("deepgemm-2.8" if row.mma_type == "fp4xfp4" else "vllm-0.33"):
        deep_gemm.get_symm_buffer_for_mega_moe(None, 2, 8, 1, h, h, mma_type=row.mma_type)
        with pytest.raises(ValueError, match="must be a multiple of"):
            deep_gemm.get_symm_buffer_for_mega_moe(None, 2, 8, 1, h + h // 2, h,
                                                   mma_type=row.mma_type)


@pytest.mark.parametrize("row", STAND_IN_ROWS, ids=lambda b: b.mma_type)
def test_from_dense_makes_each_stand_in_form(row):
    e, h, i = 2, row.hidden_multiple, row.intermediate_multiple
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(e, 2 * i, h, generator=gen), torch.randn(e, h, i, generator=gen)
    weights = from_dense(w1, w2, row.mma_type)
    assert weights.experts == (0, 1)
    alphas = set(kernel_kwargs(weights))
    assert alphas == ({"l1_alphas", "l2_alphas"} if row.mma_type == "fp4xfp4" else set())


def test_from_dense_refuses_a_build_the_stand_in_lacks():
    with pytest.raises(ValueError, match="kernel 'stand-in' has no MMA type 'fp8xfp8'"):
        from_dense(torch.zeros(1, 256, 512), torch.zeros(1, 512, 128), "fp8xfp8")


def test_the_choosers_read_the_catalogue():
    from moewire.integrations.sglang import sites
    from moewire.study import settings

    assert settings.MMA_TYPES == catalogue.mma_types(catalogue.STAND_IN, "study")
    assert sites.MMA_TYPES == ("fp8xfp4", "nvfp4xnvfp4", "mxf4xmxf4")
    assert catalogue.mma_types(user="transformers") == (
        "bf16xbf16", "fp8xfp4", "fp4xfp4", "fp8xfp8")


def test_from_dense_reaches_a_real_kernels_own_form():
    # The SM90 kernel's module registers its forms on import; its weight cast refuses shapes
    # off its 128-wide blocks before it needs DeepGEMM's package.
    from moewire.integrations import deepgemm_sm90  # noqa: F401

    with pytest.raises(ValueError, match=r"quantize_weights: H=192 and I=128 must be multiples"):
        from_dense(torch.zeros(1, 256, 192), torch.zeros(1, 192, 128), "fp8xfp8",
                   kernel=catalogue.SM90)
