"""``export_fp8(model, path)``: an FP8 inference checkpoint of a converted model, in safetensors.

Every ``Fp8Linear`` of the model (but the ones ``exclude`` names) is written as ``{fqn}.weight``
(``float8_e4m3fn``, ``[out, in]``) and ``{fqn}.weight_scale`` (float32), the dequantization scale
of fp8func's convention and of the loaders below (``weight ≈ weight_fp8.float() * weight_scale``):

* ``granularity="tensor"``: one scale per weight, shape ``[]``. The layout of vLLM's ``"fp8"``
  checkpoints (``quantization_config = {"quant_method": "fp8", "is_checkpoint_fp8_serialized":
  true, "activation_scheme": "dynamic"}``, as AutoFP8 and llm-compressor write them).
* ``granularity="channel"``: one scale per output row, shape ``[out, 1]``. The layout of
  compressed-tensors' ``float-quantized`` W8A8-FP8 checkpoints with ``strategy: "channel"`` weights
  and dynamic per-token activations, which vLLM reads.

Everything else (embeddings, norms, biases, layers kept in high precision) is written as it is, in
``dtype`` when given; delayed-scaling state is left out (inference casts activations dynamically).
The weights are quantized from their high-precision values (an FP8 primary weight's master where
``MasterWeights`` keeps one), with the whole weight's amax: the model must not be sharded.
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .._ops import quantize
from .._scaling import AxisWise, CastSpec, TensorWise
from ._convert import matches
from ._linear import Fp8Linear
from ._linear_weights import hp_values

__all__ = ["export_fp8", "quantization_config"]

_GRANULARITIES = {"tensor": TensorWise(), "channel": AxisWise(-1)}


def quantization_config(granularity: str, ignored: Sequence[str]) -> dict:
    """The ``quantization_config`` (HF ``config.json``) that tells vLLM how to read the checkpoint."""
    if granularity == "tensor":
        return {"quant_method": "fp8", "is_checkpoint_fp8_serialized": True, "activation_scheme": "dynamic",
                "ignored_layers": list(ignored)}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": list(ignored),
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True}}}}


@torch.no_grad()
def export_fp8(model: nn.Module, path: str | os.PathLike, *, granularity: str = "tensor",
               dtype: torch.dtype | None = None, exclude: Sequence[str] = ("lm_head",)) -> dict:
    """Writes an FP8 inference checkpoint of ``model`` to the directory ``path``; returns its
    ``quantization_config``.

    ``path/model.safetensors`` holds the tensors (see the module docstring for the layout); for an
    HF model, ``path/config.json`` is its config with the ``quantization_config`` added. ``exclude``:
    fqn patterns (as ``convert(filter=[...])``) of FP8 layers written in high precision instead
    (the output head, by default: inference engines keep it high precision). ``dtype``: the dtype
    of the high-precision tensors and of the values the weights are quantized from (default: each
    tensor's own).

    Example:
        >>> fp8func.export_fp8(model, "qwen3-fp8", granularity="channel", dtype=torch.bfloat16)
    """
    if granularity not in _GRANULARITIES:
        raise ValueError(f"export_fp8: granularity={granularity!r}; expected 'tensor' or 'channel'.")
    from safetensors.torch import save_file

    fp8 = {fqn: m for fqn, m in model.named_modules()
           if isinstance(m, Fp8Linear) and not any(matches(p, fqn) for p in exclude)}
    if not fp8:
        raise ValueError("export_fp8: the model has no Fp8Linear layer to export in FP8; convert it with "
                         "fp8func.convert first (or check exclude=...).")
    if any(isinstance(t, DTensor) for t in model.state_dict().values()):
        raise ValueError("export_fp8: the model is sharded (FSDP2 / tensor parallel); the scales need whole "
                         "weights. Load its full state_dict into an unsharded converted model and export that.")
    tensors = _tensors(model, fp8, _GRANULARITIES[granularity], dtype)
    ignored = sorted(fqn for fqn, m in model.named_modules() if isinstance(m, nn.Linear) and fqn not in fp8)
    config = quantization_config(granularity, ignored)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt", "quantization_config": json.dumps(config)})
    hf_config = getattr(model, "config", None)
    if hasattr(hf_config, "to_dict"):
        with open(os.path.join(path, "config.json"), "w") as fh:
            json.dump({**hf_config.to_dict(), "quantization_config": config}, fh, indent=2, default=str)
    return config


def _tensors(model: nn.Module, fp8: dict, granularity, dtype) -> dict[str, torch.Tensor]:
    spec = CastSpec(granularity=granularity)
    layers = {fqn for fqn, m in model.named_modules() if isinstance(m, Fp8Linear)}
    out, seen = {}, {}
    for key, value in model.state_dict().items():
        fqn, _, name = key.rpartition(".")
        if fqn in layers and name.startswith("fp8_"):
            continue  # delayed-scaling state
        if fqn in fp8 and name == "weight":
            w = hp_values(fp8[fqn].weight, fp8[fqn].master_weight())
            q = quantize(w if dtype is None else w.to(dtype), spec)
            out[key] = q.data.contiguous()
            out[f"{fqn}.weight_scale"] = q.scale.reshape(() if isinstance(granularity, TensorWise) else (-1, 1))
            continue
        if value.data_ptr() in seen and value.numel():  # a tied weight: safetensors stores it once
            continue
        seen[value.data_ptr()] = key
        value = value.detach()
        out[key] = (value.to(dtype) if dtype is not None and value.is_floating_point() else value).contiguous()
    return out
