"""Helpers of the study tests: a small DeepSeek-named checkpoint."""

import torch

from moewire.study.data import WEIGHT_NAMES

HIDDEN, INTER, EXPERTS, SHARED_INTER, LAYER = 512, 512, 8, 512, 3


def dense_checkpoint(layer=LAYER, experts=EXPERTS, hidden=HIDDEN, inter=INTER, seed=0,
                     shared=True, router=True):
    """{name: BF16 tensor} in DeepSeek naming, seeded."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).bfloat16()

    tensors = {}
    for e in range(experts):
        tensors[WEIGHT_NAMES["gate"].format(L=layer, e=e)] = rnd(inter, hidden)
        tensors[WEIGHT_NAMES["up"].format(L=layer, e=e)] = rnd(inter, hidden)
        tensors[WEIGHT_NAMES["down"].format(L=layer, e=e)] = rnd(hidden, inter)
    if router:
        tensors[WEIGHT_NAMES["router"].format(L=layer)] = rnd(experts, hidden).float()
        tensors[WEIGHT_NAMES["router_bias"].format(L=layer)] = torch.randn(experts, generator=g)
    if shared:
        tensors[WEIGHT_NAMES["shared_gate"].format(L=layer)] = rnd(SHARED_INTER, hidden)
        tensors[WEIGHT_NAMES["shared_up"].format(L=layer)] = rnd(SHARED_INTER, hidden)
        tensors[WEIGHT_NAMES["shared_down"].format(L=layer)] = rnd(hidden, SHARED_INTER)
    return tensors
