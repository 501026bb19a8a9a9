"""Mixture-of-experts blocks: ``MoE`` (high precision) and ``Fp8MoE`` (experts in FP8).

Both compute, for tokens ``x [..., H]``:

    probs, ids = top_k(softmax(router(x)))           router: Linear(H, E) in x's dtype (bf16)
    tokens sorted by expert (stable), groups offs     one row per (token, choice)
    h = silu(x_g @ w_gate[g].T) * (x_g @ w_up[g].T)   SwiGLU experts: w_gate, w_up [E, F, H]
    y_g = h @ w_down[g].T                             w_down [E, H, F]
    y = sum over the k choices of probs * y           in fp32, cast to x's dtype

``Fp8MoE`` runs the three expert projections through ``fp8func.grouped_linear`` (row-wise FP8)
and keeps the router and the combine in high precision. With ``parallelize_experts`` the
experts are split over a mesh dimension and tokens are dispatched to them (``fp8func.distributed``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .._grouped import align_groups, grouped_linear, grouped_mm
from .._scaling import Recipe, as_recipe

__all__ = ["MoE", "Fp8MoE", "Fp8Experts", "Router", "route", "is_fused_experts"]


class Router(nn.Linear):
    """The gate: an ``nn.Linear(H, E, bias=False)`` computed in its input's dtype (bf16 activations
    with fp32 master weights). Its own module, so that FSDP2 gathers it like any layer, and a
    subclass, so that ``fp8func.convert`` (which swaps exact ``nn.Linear``) keeps it high precision."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing: ``(probs [T, k] fp32, renormalised over the k; ids [T, k] int64)``."""
    probs, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    return probs / probs.sum(-1, keepdim=True), ids


def _sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, counts)``: (token, choice) pairs sorted by expert (stable), tokens per expert."""
    flat = ids.flatten()
    return torch.argsort(flat, stable=True), torch.bincount(flat, minlength=num_experts)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts in high precision: the reference ``Fp8MoE`` tracks.

    Example:
        >>> moe = MoE(hidden=2048, expert_dim=768, num_experts=128, top_k=8)
        >>> y = moe(torch.randn(4, 256, 2048, dtype=torch.bfloat16))
    """

    def __init__(self, hidden: int, expert_dim: int, num_experts: int, top_k: int, *, device=None, dtype=None):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"MoE: top_k={top_k} must be in [1, num_experts={num_experts}].")
        kw = {"device": device, "dtype": dtype}
        self.num_experts, self.top_k = num_experts, top_k
        self.router = Router(hidden, num_experts, bias=False, **kw)
        self.w_gate = nn.Parameter(torch.empty(num_experts, expert_dim, hidden, **kw))
        self.w_up = nn.Parameter(torch.empty(num_experts, expert_dim, hidden, **kw))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, expert_dim, **kw))
        self.ep = None  # an ExpertParallel once parallelize_experts has split the experts
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform(±1/sqrt(fan_in)) per expert, as ``nn.Linear`` initialises its weight."""
        for w in (self.w_gate, self.w_up, self.w_down):
            bound = 1 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    def _project(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return grouped_mm(x, w, offs)

    def _dispatch_spec(self):
        return None

    def _experts(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        h = F.silu(self._project(x, self.w_gate, offs)) * self._project(x, self.w_up, offs)
        return self._project(h, self.w_down, offs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, h = x.shape[:-1], x.shape[-1]
        tokens = x.reshape(-1, h)
        probs, ids = route(self.router(tokens), self.top_k)
        order, counts = _sort_by_expert(ids, self.num_experts)
        x_sorted = tokens[order // self.top_k]
        if self.ep is None:
            y_sorted = self._experts(x_sorted, torch.cumsum(counts, 0, dtype=torch.int32))
        else:
            x_local, offs, plan = self.ep.dispatch(x_sorted, counts, self._dispatch_spec())
            y_sorted = self.ep.combine(self._experts(x_local, offs), plan)
        y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)  # back to (token, choice) order
        y = y.view(*lead, self.top_k, h).float() * probs.view(*lead, self.top_k, 1)
        return y.sum(-2).to(x.dtype)  # a new tensor, not a view (FSDP2 hooks the output)

    def extra_repr(self) -> str:
        e, f, h = self.w_gate.shape
        local = "" if self.ep is None else f" (local {e} of {self.num_experts})"
        return f"hidden={h}, expert_dim={f}, num_experts={self.num_experts}{local}, top_k={self.top_k}"


class Fp8MoE(MoE):
    """``MoE`` whose expert projections are FP8 grouped GEMMs (``fp8func.grouped_linear``).

    The router stays in high precision (it decides discrete routes; its GEMM is small). With
    expert parallel, tokens are dispatched as FP8 bytes with their row scales when
    ``fp8_dispatch`` (the default), else in the activation dtype. ``align``: each expert's
    group is padded with zero rows to a positive multiple of it before the grouped GEMMs
    (None: 16 on CUDA, which torch's FP8 grouped kernel needs for the weight gradient; 1 else).

    Example:
        >>> moe = Fp8MoE.from_float(MoE(2048, 768, 128, 8), "rowwise")
    """

    def __init__(self, hidden: int, expert_dim: int, num_experts: int, top_k: int, *, device=None, dtype=None,
                 recipe: Recipe | str = "rowwise", fp8_dispatch: bool = True, align: int | None = None):
        super().__init__(hidden, expert_dim, num_experts, top_k, device=device, dtype=dtype)
        self.recipe = as_recipe(recipe, "Fp8MoE", example="rowwise")
        self.fp8_dispatch, self.align = fp8_dispatch, align

    @classmethod
    def from_float(cls, moe: MoE, recipe: Recipe | str = "rowwise", **kwargs) -> "Fp8MoE":
        """An ``Fp8MoE`` holding ``moe``'s parameters (the same tensors, no copy) and its EP split."""
        if not isinstance(moe, MoE) or isinstance(moe, Fp8MoE):
            raise TypeError(f"Fp8MoE.from_float: expected an fp8func.nn.MoE, got {type(moe).__name__}.")
        e, f, h = moe.w_gate.shape
        with torch.device("meta"):
            new = cls(h, f, moe.num_experts, moe.top_k, recipe=recipe, **kwargs)
        new.router, new.ep = moe.router, moe.ep
        new.w_gate, new.w_up, new.w_down = moe.w_gate, moe.w_up, moe.w_down
        return new

    def _dispatch_spec(self):
        return self.recipe.input if self.fp8_dispatch else None

    def _project(self, x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return grouped_linear(x, w, offs, self.recipe)

    def _experts(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        align = self.align if self.align is not None else (16 if x.is_cuda else 1)
        if align == 1:
            return super()._experts(x, offs)
        index, offs_aligned, rows = align_groups(offs, align)
        padded = x.new_zeros((rows, x.shape[1])).index_copy(0, index, x)
        return super()._experts(padded, offs_aligned)[index]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe.name}, fp8_dispatch={self.fp8_dispatch}"


def is_fused_experts(module: nn.Module) -> bool:
    """True for HF transformers' fused MoE experts modules (Qwen3-MoE and the like): 3-D
    ``gate_up_proj [E, 2F, H]`` and ``down_proj [E, H, F]`` parameters, an ``act_fn``, and
    ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, nn.Parameter) and isinstance(down, nn.Parameter) and gu.ndim == 3 and down.ndim == 3
            and gu.shape[0] == down.shape[0] and gu.shape[1] == 2 * down.shape[2] and gu.shape[2] == down.shape[1]
            and hasattr(module, "act_fn") and not isinstance(module, Fp8Experts))


class Fp8Experts(nn.Module):
    """FP8 drop-in for an HF fused experts module (``is_fused_experts``): the same parameters (the
    same tensors), the same forward signature; the two expert projections are FP8 grouped GEMMs
    (``fp8func.grouped_linear``) over the (token, choice) pairs sorted by expert. The router is the
    model's own module and stays high precision. A routed index equal to ``num_experts`` (HF's
    "dropped" marker) contributes nothing. ``align`` as in ``Fp8MoE``.

    Example:
        >>> model = Qwen3MoeForCausalLM(config); fp8func.convert(model, "rowwise")   # swaps mlp.experts
    """

    note = ""  # convert()'s note on this module
    conversion = None  # the Report of the convert() call that made it (report(model) reads it)

    def record_conversion(self, note: str, conversion) -> None:
        """``convert``'s note on this module and the ``Report`` of that call (``report`` reads them)."""
        self.note, self.conversion = note, conversion

    def __init__(self, experts: nn.Module, recipe: Recipe | str = "rowwise", align: int | None = None):
        super().__init__()
        if not is_fused_experts(experts):
            raise TypeError(f"Fp8Experts: {type(experts).__name__} is not a fused experts module (3-D gate_up_proj "
                            "[E, 2F, H] and down_proj [E, H, F], act_fn); use Fp8MoE for fp8func.nn.MoE.")
        self.gate_up_proj, self.down_proj, self.act_fn = experts.gate_up_proj, experts.down_proj, experts.act_fn
        self.num_experts = self.gate_up_proj.shape[0]
        self.recipe = as_recipe(recipe, "Fp8Experts", example="rowwise")
        self.align = align
        # The module it replaces, outside the module tree (its parameters are these): to_experts().
        object.__setattr__(self, "_replaced", experts)

    def to_experts(self) -> nn.Module:
        """The HF experts module this one replaced, holding this module's current parameters
        (``fp8func.unconvert`` calls it)."""
        experts = self._replaced
        experts.gate_up_proj, experts.down_proj, experts.act_fn = self.gate_up_proj, self.down_proj, self.act_fn
        return experts.train(self.training)

    def _experts(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gate, up = grouped_linear(x, self.gate_up_proj, offs, self.recipe).chunk(2, dim=-1)
        return grouped_linear(self.act_fn(gate) * up, self.down_proj, offs, self.recipe)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        t, h = hidden_states.shape
        k = top_k_index.shape[-1]
        dropped = top_k_index >= self.num_experts
        ids = top_k_index.masked_fill(dropped, 0)
        weights = top_k_weights.masked_fill(dropped, 0)
        order, counts = _sort_by_expert(ids, self.num_experts)
        x = hidden_states[order // k]
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        align = self.align if self.align is not None else (16 if x.is_cuda else 1)
        if align == 1:
            y = self._experts(x, offs)
        else:
            index, offs_aligned, rows = align_groups(offs, align)
            y = self._experts(x.new_zeros((rows, h)).index_copy(0, index, x), offs_aligned)[index]
        y = torch.empty_like(y).index_copy(0, order, y).view(t, k, h)  # back to (token, choice) order
        return (y.float() * weights.unsqueeze(-1).float()).sum(1).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        e, f2, h = self.gate_up_proj.shape
        return f"num_experts={e}, hidden={h}, expert_dim={f2 // 2}, recipe={self.recipe.name}"
