"""HF ``transformers.Trainer`` (and accelerate) integration: FP8 training in one callback.

Example (FSDP2, bf16 mixed precision, torch.compile; launched with ``torchrun``)::

    from transformers import Trainer, TrainingArguments
    import fp8func as f8

    model = Qwen3ForCausalLM(config)
    args = TrainingArguments(output_dir, bf16=True, torch_compile=True, save_strategy="steps",
                             fsdp=True, fsdp_config=f8.hf.fsdp2_config(model))
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[f8.hf.Fp8Callback("tensorwise")])
    trainer.train()                                   # resume_from_checkpoint=... works as usual

``Fp8Callback`` converts the model when the ``Trainer`` is built (before accelerate wraps it in
FSDP2 and builds the optimizer) and checks, when training starts, what would otherwise go wrong
without a word: that the optimizer holds every parameter once (accelerate re-points it at the
FSDP2-sharded parameters by ``data_ptr()``), and that FSDP2 sharded the FP8 layers' weights with
the fp8 all-gather. For delayed scaling it makes every rank record the same amaxes
(``fp8func.distributed.share_scaling_state`` over the FSDP2 mesh). Checkpoints hold plain
high-precision weights (and the delayed-scaling state), so ``save_strategy="steps"``,
``resume_from_checkpoint`` and ``save_pretrained`` work as for any model.

Needs ``transformers`` (and ``accelerate`` for FSDP2); import it as ``fp8func.hf``.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

try:
    from transformers import TrainerCallback
except ImportError as e:  # the one line a user without the extra needs
    raise ImportError("fp8func.hf needs transformers (and accelerate for FSDP2): pip install 'fp8func[hf]' "
                      "(from a clone: pip install -e '.[hf]')") from e

from ._plan import LinearPlan, plan
from ._scaling import Recipe
from .distributed import share_scaling_state
from .nn import Fp8Linear, convert, report
from .nn._weights import FP8_ALL_GATHER, weight_kind

__all__ = ["Fp8Callback", "check_optimizer", "fsdp2_config", "keep_fsdp2_on_cpu"]

log = logging.getLogger("fp8func")


def fsdp2_config(model: nn.Module, *, reshard_after_forward: bool = True) -> dict:
    """``TrainingArguments(fsdp=True, fsdp_config=...)`` for FSDP2 over ``model``'s decoder layers
    (its ``_no_split_modules``, e.g. ``Qwen3DecoderLayer``)."""
    layers = sorted(getattr(model, "_no_split_modules", None) or [])
    if not layers:
        raise ValueError(f"fsdp2_config: {type(model).__name__} names no _no_split_modules; pass "
                         "fsdp_config={'version': 2, 'transformer_layer_cls_to_wrap': [<your block class name>]}.")
    return {"version": 2, "transformer_layer_cls_to_wrap": layers, "reshard_after_forward": reshard_after_forward}


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raises unless ``optimizer`` holds every trainable parameter of ``model`` exactly once, by identity."""
    params = [p for p in model.parameters() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    counts = collections.Counter(id(p) for g in optimizer.param_groups for p in g["params"])
    missing = [names[id(p)] for p in params if id(p) not in counts]
    repeated = {names.get(i, "?"): c for i, c in counts.items() if c > 1}
    foreign = sum(1 for i in counts if i not in names)
    if missing or repeated or foreign:
        raise RuntimeError(
            f"fp8func: the optimizer does not hold the model's parameters once each: {len(missing)} missing "
            f"(e.g. {sorted(missing)[:3]}), repeated {repeated}, {foreign} foreign. accelerate re-points the "
            "optimizer at FSDP2's sharded parameters by data_ptr(); a tensor type whose data_ptr() is 0 (or "
            "shared) sends several parameters to one slot. Build the optimizer after fully_shard, or convert "
            "with fsdp_fp8_all_gather=False.")


def keep_fsdp2_on_cpu(trainer) -> None:
    """Keeps FSDP2 for a ``Trainer`` whose processes run on the CPU (gloo): accelerate (1.10 to 1.15)
    turns an FSDP plugin into ``DistributedType.FSDP`` only for accelerator process types and drops
    it under ``use_cpu=True``, so the ``Trainer`` would wrap the model in DDP. This makes the
    assignments accelerate makes for GPUs (the plugin with the run's mixed precision, the FSDP
    distributed type, also in the process state that later ``AcceleratorState()`` calls copy).
    Nothing changes on GPUs, or when the plugin was kept. Call it right after building the Trainer."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if trainer.args.fsdp_plugin_args is None or getattr(state, "fsdp_plugin", None) is not None:
        return
    if state.distributed_type != DistributedType.MULTI_CPU:
        return
    plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin, state.distributed_type = plugin, DistributedType.FSDP
    # As AcceleratorState.__init__ does: every later AcceleratorState() copies PartialState's fields.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


class Fp8Callback(TrainerCallback):
    """Converts the ``Trainer``'s model to FP8 and checks the run when training starts (module docstring).

    Args: as ``fp8func.convert`` (``recipe``, ``filter``, ``fsdp_fp8_all_gather``, ``tokens``).
    FP8 primary weights (``fp8_weights=True``) need ``MasterWeights`` and its own optimizer, which
    the ``Trainer`` does not build: train them with a loop of your own (docs/fp8_weights.md).
    """

    def __init__(self, recipe: Recipe | LinearPlan | str = "tensorwise", *,
                 filter: Callable[[nn.Module, str], bool] | str | Sequence[str] | None = None,
                 fsdp_fp8_all_gather: bool = True, tokens: int = 8192):
        self.plan = plan(recipe, "Fp8Callback")
        self.filter, self.fsdp_fp8_all_gather, self.tokens = filter, fsdp_fp8_all_gather, tokens

    @property
    def recipe(self) -> Recipe | LinearPlan:
        """The ``Recipe`` given (a name resolved), or the ``LinearPlan`` where one was given."""
        return self.plan.given

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("Fp8Callback: the Trainer has no model to convert (Trainer(model=...)).")
        convert(model, self.plan, filter=self.filter, fsdp_fp8_all_gather=self.fsdp_fp8_all_gather,
                tokens=self.tokens)
        if state.is_world_process_zero:
            log.info("Fp8Callback: %s", str(report(model, print_table=False)).splitlines()[-1])

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
        if not layers:
            raise RuntimeError("Fp8Callback: the model reaching training has no Fp8Linear layer: it was "
                               "replaced after the Trainer was built.")
        if optimizer is not None:
            check_optimizer(model, optimizer)
        sharded = [m for m in layers if isinstance(m.weight, DTensor)]
        wrong = [m for m in sharded if m.fsdp_fp8_all_gather and weight_kind(m.weight) != FP8_ALL_GATHER]
        if wrong:
            raise RuntimeError(f"Fp8Callback: FSDP2 sharded {len(wrong)} FP8 weights as plain tensors: their "
                               "fp8 all-gather is lost (the weights were replaced while accelerate prepared the "
                               "model). Please report it, with your accelerate version.")
        if self.recipe.delayed is not None and sharded:
            share_scaling_state(model, sharded[0].weight.device_mesh)
