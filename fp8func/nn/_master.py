"""``MasterWeights``: the high-precision master copy that trains a model's FP8 weights.

An FP8 weight cannot take an optimizer update itself: most updates are far below half an fp8
ulp and would round away. ``MasterWeights`` keeps an fp32 copy of every ``Fp8WeightParam``
(sharded exactly like it) and hands the optimizer those, plus the model's other trainable
parameters as they are, so one optimizer over ``masters.parameters()`` covers the model. After
each optimizer step the FP8 weights are re-quantized from their masters with one scale per
tensor shared by all shards: the amax is reduced over the mesh the weight is sharded on, the
mesh FSDP2 used, with one all-reduce per mesh for the whole model.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._casts import weight_casts
from .._ops import quantize_with_scale
from .._scaling import compute_amax, compute_scale
from .._sharding import reduce_amax
from ._weights import FP8_WEIGHTS, local_of, weight_kind

__all__ = ["MasterWeights", "master_name"]


def master_name(fqn: str) -> str:
    """The name ``MasterWeights`` gives the model parameter ``fqn``: dots become ``__``
    (``model.layers.0.mlp.up_proj.weight`` -> ``model__layers__0__mlp__up_proj__weight``)."""
    return fqn.replace(".", "__")


_local = local_of


class _MoveGrad:
    """Post-accumulate-grad hook of a trained fp8 weight: its gradient goes to its master at once
    (converted to the master's dtype, added to what the master already holds), so that the
    optimizer's parameters carry every gradient the next step uses: ``clip_grad_norm_``,
    ``zero_grad`` and NaN checks over ``masters.parameters()`` see them. FSDP2 calls the hook on
    the sharded parameter after its reduce-scatter. Holds the master weakly."""

    def __init__(self, master: torch.Tensor):
        self.master = weakref.ref(master)

    def __call__(self, p: torch.Tensor) -> None:
        master = self.master()
        if master is None or p.grad is None:
            return
        with torch.no_grad():
            grad = p.grad.to(master.dtype)
            if master.grad is None:
                master.grad = grad
            else:
                master.grad.add_(grad)
        p.grad = None


def _hook(p: torch.Tensor, master: torch.Tensor) -> None:
    """Registers ``_MoveGrad(master)`` on ``p`` unless it has it."""
    hooks = (p._post_accumulate_grad_hooks or {}).values()
    if not any(isinstance(h, _MoveGrad) and h.master() is master for h in hooks):
        p.register_post_accumulate_grad_hook(_MoveGrad(master))


class MasterWeights(nn.Module):
    """High-precision masters of a model's FP8 weights, and its other trainable parameters.

    For every trainable ``Fp8WeightParam`` of ``model``, an ``nn.Parameter`` of ``dtype`` with the
    same values and the same sharding (a DTensor on the same mesh and placements under FSDP2);
    for every other trainable parameter (biases, norms, embeddings, high-precision layers), that
    very ``Parameter``. Names are the model's FQNs with ``.`` replaced by ``__`` (``master_name``),
    so ``state_dict`` / ``torch.distributed.checkpoint.state_dict.get_state_dict(masters, opt)``
    work: every parameter of the optimizer belongs to ``masters``.

    Build it after ``fully_shard``, ``to_empty`` and initialisation, as you would an optimizer.
    Each fp8 weight's gradient moves to its master as soon as it is accumulated, so clipping,
    NaN checks and ``zero_grad`` over ``masters.parameters()`` cover the whole model. After
    loading a state dict into it (``load_state_dict``, or DCP's ``set_state_dict``, which calls
    it) the FP8 weights are re-quantized from the loaded masters; loading one into the model
    writes the values into the masters as well, and the model's ``state_dict`` holds the masters'
    values. Every rank must call ``step``, ``requantize`` and ``load_state_dict`` together (they
    all-reduce amaxes). One ``MasterWeights`` per model.

    Args:
        model: a model converted with ``convert(..., fp8_weights=True)``.
        dtype: the masters' dtype (fp32 by default).

    Example:
        >>> f8.convert(model, "tensorwise", fp8_weights=True)
        >>> for block in model.model.layers:
        ...     fully_shard(block, mesh=mesh, mp_policy=mp)
        >>> fully_shard(model, mesh=mesh, mp_policy=mp)
        >>> masters = f8.nn.MasterWeights(model)
        >>> opt = torch.optim.AdamW(masters.parameters(), lr=3e-4)
        >>> model(**batch).loss.backward()
        >>> torch.nn.utils.clip_grad_norm_(masters.parameters(), 1.0)   # every gradient is on the masters
        >>> masters.step(opt)   # opt.step(), re-quantize, opt.zero_grad()
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.float32):
        super().__init__()
        fp8 = []
        for fqn, p in model.named_parameters():
            name = master_name(fqn)
            if name in self._parameters:
                raise ValueError(f"MasterWeights: parameters {fqn!r} and another both map to {name!r}; rename one.")
            if not p.requires_grad:
                continue
            if weight_kind(p) == FP8_WEIGHTS:
                parent, _, attr = fqn.rpartition(".")
                if model.get_submodule(parent).master_weight() is not None:
                    raise ValueError(f"MasterWeights: {fqn} already has a master (another MasterWeights trains it); "
                                     "build one MasterWeights per model and train through it.")
                self.register_parameter(name, _master_of(p, _local(p), dtype))
                fp8.append((model.get_submodule(parent), attr, name))
            else:
                self.register_parameter(name, p)
        if not fp8:
            raise ValueError("MasterWeights: the model has no trainable fp8 weights; convert it with "
                             "fp8func.convert(model, recipe, fp8_weights=True) first.")
        self._fp8 = fp8  # (module, attribute, master name): the weight is read afresh at each use
        self._attach()

    def _attach(self) -> None:
        """Each fp8 layer learns its master (checkpoints, copies and loads go through it), and each
        fp8 weight gets the hook that moves its gradients there."""
        for module, attr, name in self._fp8:
            master = getattr(self, name)
            module.attach_master(master)
            _hook(getattr(module, attr), master)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._attach()  # a copy (copy.deepcopy, pickle) of the model and its masters together

    def _weights(self):
        for module, attr, name in self._fp8:
            p = getattr(module, attr)
            if weight_kind(p) != FP8_WEIGHTS:
                raise RuntimeError(
                    f"MasterWeights: {type(module).__name__}.{attr} is no longer an Fp8WeightParam (a "
                    f"{type(_local(p)).__name__}): the model's parameter was replaced after MasterWeights was "
                    "built, or FSDP2 holds it unsharded (call step/requantize outside forward and backward)."
                )
            master = getattr(self, name)
            _hook(p, master)  # a parameter replaced since (load_state_dict(assign=True)) gets the hook too
            yield p, master

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Runs ``optimizer.step()``, re-quantizes the fp8 weights and ``optimizer.zero_grad()``.

        The fp8 weights' gradients are on their masters already (moved as each is accumulated);
        one set on a weight by other means (``p.grad = ...``) is moved first."""
        for p, master in self._weights():
            _MoveGrad(master)(p)
        optimizer.step()
        self.requantize()
        optimizer.zero_grad()

    @torch.no_grad()
    def requantize(self) -> None:
        """Re-quantizes every fp8 weight from its master: cast to the param dtype FSDP2 used, one
        scale per tensor (per row, per block) shared by all shards, the amaxes of the whole
        model reduced with one all-reduce per mesh. A weight never quantized yet (its param dtype
        is learnt at its first all-gather) stages the master's values instead.
        """
        pending, groups = [], {}
        for p, master in self._weights():
            w, values = _local(p), _local(master)
            if w.param_dtype is None:
                w.stage(values)
                continue
            values = values.to(w.param_dtype)
            for cast, spec in weight_casts(w.recipe):
                key = tuple((sh.mesh, sh.amax_mesh_dims(spec.granularity, tuple(values.shape))) for sh in w.sharding)
                item = [w, values, cast, spec, compute_amax(values, spec.granularity)]
                pending.append(item)
                groups.setdefault(tuple(k for k in key if k[1]), []).append(item)
        for key, items in groups.items():
            if not key:
                continue  # nothing split a scale group: the local amax is the logical one
            flat = torch.cat([item[4].reshape(-1) for item in items])
            for mesh, dims in key:
                flat = reduce_amax(flat, mesh, dims)
            for item, amax in zip(items, flat.split([item[4].numel() for item in items])):
                item[4] = amax.view_as(item[4])
        casts: dict[int, tuple[torch.Tensor, dict]] = {}
        for w, values, cast, spec, amax in pending:
            scale = compute_scale(amax, spec.dtype, spec.pow2_scales)
            casts.setdefault(id(w), (w, {}))[1][cast] = quantize_with_scale(values, scale, spec)
        for w, new in casts.values():
            w.set_casts(new, w.param_dtype, w.sharding)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` into the masters (in place), then ``requantize()``."""
        if assign:
            raise ValueError("MasterWeights.load_state_dict(assign=True) would replace parameters the model "
                             "and the optimizer hold; load in place (assign=False).")
        out = super().load_state_dict(state_dict, strict=strict)
        self.requantize()
        return out


def _master_of(p: torch.Tensor, local: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    """A ``dtype`` copy of the fp8 weight ``p`` (its staged values, or its forward cast
    dequantized), sharded like it."""
    with torch.no_grad():
        values = local._values().to(dtype, copy=True)
        if isinstance(p, DTensor):
            values = DTensor.from_local(values, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                        run_check=False)
    return nn.Parameter(values)
