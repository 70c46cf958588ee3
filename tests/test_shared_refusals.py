"""A refusal that two hosts give for the same kernel reads one sentence: the hosts cannot
drift apart (vLLM's and SGLang's FlyDSL refusals cite the same aiter source; the normalising
combine's reason is the same on vLLM's NVFP4 x NVFP4 build and SGLang's post_expert_norm
paths)."""

from __future__ import annotations

from moewire.integrations.sglang import paths, refusals
from moewire.integrations.vllm import sites as vllm_sites
from moewire.megamoe import builds


def test_both_hosts_refuse_aiters_megamoe_v2_with_the_read_source():
    flydsl = next(p for p in paths.OTHER_PATHS if p.name == "flydsl-megamoe")
    assert flydsl.why() == builds.AITER_MEGAMOE_V2
    assert builds.AITER_MEGAMOE_V2 in vllm_sites.AITER_REFUSAL
    assert "ROCm/aiter 03447f9" in builds.AITER_MEGAMOE_V2
    assert "not read" not in vllm_sites.AITER_REFUSAL


def test_the_normalising_combine_has_one_reason():
    assert refusals.POST_EXPERT_NORM is builds.POST_EXPERT_NORM
    assert builds._FP4_FP4_REFUSED.startswith(builds.POST_EXPERT_NORM)
