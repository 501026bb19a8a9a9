"""``Fp8Linear``: an ``nn.Linear`` whose forward is one call into ``fp8func.linear``."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._autograd import linear, linear_with_casts
from .._gathered import gathered_casts
from .._scaling import Recipe
from ..distributed._fsdp import Fp8AllGatherWeight

__all__ = ["Fp8Linear"]


class Fp8Linear(nn.Linear):
    """``nn.Linear`` computed in FP8 per ``recipe``; same parameters and state_dict keys.

    With ``fsdp_fp8_all_gather=True`` the weight is an ``Fp8AllGatherWeight``: a plain
    high-precision tensor to everything except FSDP2, which then all-gathers it as fp8 bytes,
    bitwise what the bf16 all-gather followed by the cast gives.

    Example:
        >>> layer = Fp8Linear(4096, 4096, recipe=fp8func.Recipe.from_name("rowwise"))
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: Recipe | str = "tensorwise", fsdp_fp8_all_gather: bool = True):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe = Recipe.from_name(recipe) if isinstance(recipe, str) else recipe
        self.fsdp_fp8_all_gather = fsdp_fp8_all_gather
        if fsdp_fp8_all_gather:
            self.weight = nn.Parameter(Fp8AllGatherWeight(self.weight.data, self.recipe))

    @classmethod
    def from_linear(cls, linear_: nn.Linear, recipe: Recipe, fsdp_fp8_all_gather: bool = True) -> "Fp8Linear":
        """An ``Fp8Linear`` holding ``linear_``'s parameters (the same values, no re-init)."""
        with torch.device("meta"):
            new = cls(linear_.in_features, linear_.out_features, bias=False, recipe=recipe,
                      fsdp_fp8_all_gather=False)
        weight = linear_.weight
        if fsdp_fp8_all_gather:
            weight = nn.Parameter(Fp8AllGatherWeight(weight.data, recipe), requires_grad=weight.requires_grad)
        new.weight = weight
        new.bias = linear_.bias
        new.fsdp_fp8_all_gather = fsdp_fp8_all_gather
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        local = w._local_tensor if isinstance(w, DTensor) else w
        w_casts = gathered_casts(w)
        if w_casts is not None and "w" not in local.valid:
            raise RuntimeError(
                "fp8func: this layer's forward ran while FSDP2 held only its backward (grad_input) "
                "weight cast: activation checkpointing recomputes the forward inside the backward, "
                "after FSDP2 re-gathered the weight for the backward alone. Use fully_shard(..., "
                "reshard_after_forward=False) for checkpointed blocks, a tensorwise or blockwise "
                "recipe, or convert(..., fsdp_fp8_all_gather=False)."
            )
        x_casts = gathered_casts(x)
        if w_casts is None and x_casts is None:
            return linear(x, w, self.bias, self.recipe)
        return linear_with_casts(x, w, self.bias, self.recipe, w_casts, x_casts)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, fsdp_fp8_all_gather={self.fsdp_fp8_all_gather}"

