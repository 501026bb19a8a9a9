"""FSDP2 x sequence-parallel TP at Llama-3-8B layer sizes: bf16, torchao and fp8func in one table.

One launch, one 2-D mesh ("dp", "tp"): FSDP2 over dp (fp32 master weights, bf16 compute through
``MixedPrecisionPolicy``), sequence-parallel TP over tp (the layout of examples/fsdp_tp_2d.py);
with ``--tp 1`` FSDP2 alone, as torchtitan runs it (no TP styles on a one-rank group).
Each configuration rebuilds the model (HF ``LlamaForCausalLM`` from a config, no download) from
the same seed and trains ``--steps`` steps on the same data (lm_head bf16 everywhere unless ``--fp8-lm-head``;
tensorwise FSDP2 fp8 weight scales precomputed after each optimizer step in both libraries
unless ``--no-precompute-scales``), AdamW fused as in torchtitan (``--optimizer``). Each decoder
layer is set up in torchtitan's order: TP, then activation checkpointing (``--ac``), then
``torch.compile`` (``--compile``), then FSDP2:

* ``bf16``: plain ``nn.Linear``, the stock TP styles;
* ``torchao``: ``convert_to_float8_training`` (tensorwise, FSDP2 float8 all-gather on) with
  torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput``;
* ``torchao-rowwise``: ``Float8LinearConfig.from_recipe_name("rowwise")`` with the stock TP styles
  (bf16 sequence gathers) and FSDP2 all-gathering bf16 weights: torchao's float8 TP styles cast
  tensorwise and its FSDP2 float8 all-gather is tensorwise only (the config refuses it), so,
  as in torchtitan, row-wise takes neither. A torchao run that cannot run (not installed, or it
  raises) is reported n/a, with the reason;
* ``fp8func-tensorwise``, ``fp8func-rowwise``: ``fp8func.convert`` + the fp8func TP styles
  (``tp_fp8_parity.sp_plans(fp8_styles=True)``), FSDP2 fp8 all-gather on; ``...-off``: the same
  with ``fsdp_fp8_all_gather=False``. docs/fsdp.md's contract: the two loss sequences are
  bitwise equal (the "on == off" column); ``...-stock`` (and ``fp8func-tensorwise-stock-off``): the stock TP
  styles (the sequence gathers in bf16, the layer casting the gathered input), not in the
  default set;
* ``fp8func-tensorwise-local`` (and ``-local-off``, not in the default set): the fp8func styles with
  TP-local scaling (``local_scales=True``, docs/tp.md): each rank scales what it holds of a
  TP-sharded activation or gradient, so the layers run no amax all-reduce over tp (the weights'
  scales are FSDP2's, precomputed after the optimizer step);
* ``fp8func-delayed`` (and ``-off``): delayed scaling of inputs and grad_outputs with the weight
  cast dynamically (``DelayedScaling(weight=False)``, so FSDP2 gathers it in FP8), the states
  shared over dp (``share_scaling_state``), the stock TP styles (the FP8 sequence gathers cast
  with dynamic scales); not in the default set (``--configs`` names it).

Activation checkpointing (``--ac``, default ``none``) wraps each decoder layer in
``checkpoint_wrapper`` (non-reentrant ``torch.utils.checkpoint``, no RNG state kept: the model has
no dropout). ``full`` recomputes the whole layer in the backward; ``selective`` is torchtitan's
op-level policy (``create_selective_checkpoint_contexts``): the outputs of the matmuls
(``aten.mm``, ``aten._scaled_mm``), of attention (the sdpa flash / efficient / cuDNN / CPU kernels),
of ``aten.max`` (torchao's amaxes) and of the functional reduce-scatters and all-reduces are saved,
everything else is recomputed (every matmul output is saved, not every second one); the fp8func
configurations pass that list through ``fp8func.nn.selective_checkpoint_policy``, which also keeps
the layers' FP8 input casts for the backward (``--no-sac-keep-casts``: the list alone). Under
``--ac``, a configuration that raises is reported n/a with the reason instead of stopping the run. With torch 2.13:

* ``fp8func-rowwise`` (fp8 all-gather on), eager: the layer refuses a forward recomputed in the
  backward, where FSDP2 re-gathered only the backward's weight cast (docs/fsdp.md); compiled,
  ``selective`` runs (AOTAutograd recomputes inside the compiled backward), on == off bitwise;
* ``fp8func-delayed`` (and ``-off``): ``full`` runs eagerly; eager ``selective`` raises
  (the recomputed layer takes the state its forward passed on, so its ops differ from the
  forward's and the selective cache misses); compiled, dynamo cannot trace the layer inside the
  checkpoint (``create_node using arg not from this SubgraphTracer``);
* ``full`` with ``--compile`` raises in every configuration, bf16 included: AOTAutograd saves the
  TP mesh (a ``DeviceMesh``) among the layer's tensors for the backward (``expected all
  tensors_saved_with_vc_check to be Tensors``); ``selective`` compiles, with no graph break.

Per configuration: global tokens/s (median step time after ``--warmup`` steps, slowest rank);
MFU: model FLOPs per token times global tokens/s, over the world size times the GPU's peak dense
bf16 FLOP/s (H100 SXM and H200: 989 TFLOP/s; another GPU, or the CPU, reads n/a unless
``--peak-tflops`` gives it), FP8 configurations measured against the same bf16 peak. FLOPs per
token are the PaLM / torchtitan count for a decoder: 6 x the matmul weights (q, k, v, o, gate, up,
down per layer and lm_head; no embedding, no norm) + 12 x layers x hidden x seq for attention's
scores and values (causal masking not discounted), forward and backward, recomputation not
counted. "vs torchao": an fp8func row's tokens/s over the torchao row of its recipe (tensorwise
rows against ``torchao``, row-wise rows against ``torchao-rowwise``), where that row ran.
Also the bytes each rank all-gathers per step over dp (FSDP2's weights) and over tp (sequence-parallel
activations and gradients), read from c10d's flight recorder, which logs every collective that
a process group runs, eager or compiled (the JSON also has the bytes FSDP2 hands to
``dist.all_gather_single``: the same as dp's, row scales of row-wise fp8 weights included; unevenly
sharded row-wise weights gather their scales in a separate small all-gather); the collectives each
rank runs per step, per group and kind (same source); with ``--compile``, the graph breaks dynamo
took and the graphs it compiled (``torch._dynamo.utils.counters``; the JSON has the reasons); peak GPU memory;
first and last loss; whether
every loss was finite (the run exits 1 otherwise). The fastest kernels run by default
(``--deterministic off``); the on == off column needs reproducible runs, so it is filled on the
CPU and, on the GPU, under ``--deterministic strict`` (deterministic kernels, flash attention's
deterministic backward included, a fixed cuBLAS workspace, inductor's deterministic mode) or
``warn``; elsewhere it reads "n/a (--deterministic)".

``--profile`` runs one more step per configuration under ``torch.profiler`` (CPU + CUDA) on every
rank and prints rank 0's GPU time by kernel class (FP8 / bf16 GEMMs, attention, fp8func's casts, inductor's
fused kernels, optimizer, other) and by collective, the NCCL time no compute kernel hides, and the
time the GPU stood idle waiting for its host or for a dependency (the JSON adds each class's
largest kernels and the host's heaviest ops). ``--async-tp`` turns on torchtitan's async TP:
inductor's micro-pipeline TP pass, with symmetric memory on the tp group, splits each matching
sequence all-gather + matmul (and matmul + reduce-scatter) into overlapping chunks; the profile's
last column counts the fused ops run per step; the step span column gives rank 0's, then the
range over the ranks.

    torchrun --nproc-per-node 8 examples/fsdp_tp_scaling.py --tp 2 --json $OUT/scaling.json
    torchrun --nproc-per-node 8 examples/fsdp_tp_scaling.py --tp 2 --ac selective   # torchtitan's op-level SAC
    torchrun --nproc-per-node 4 examples/fsdp_tp_scaling.py --device cpu --tp 2 --hidden 256 --intermediate 512 \\
        --layers 2 --heads 4 --kv-heads 4 --vocab 1024 --seq 128 --batch 2 --steps 4 --warmup 1   # CPUs (gloo)
"""

from __future__ import annotations

import argparse
import functools
import gc
import math
import os
import pickle
import re
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

import fp8func as f8
from _common import add_model_args, config_kwargs, emit, environment, local_device, shard_2d, submesh
from tp_fp8_parity import sp_plans

# name -> (library, recipe, FSDP2 fp8 all-gather)
CONFIGS = {
    "bf16": ("bf16", None, False),
    "torchao": ("torchao", "tensorwise", True),
    "torchao-rowwise": ("torchao", "rowwise", False),  # torchao's FSDP2 float8 all-gather is tensorwise only
    "fp8func-tensorwise": ("fp8func", "tensorwise", True),
    "fp8func-tensorwise-off": ("fp8func", "tensorwise", False),
    "fp8func-tensorwise-local": ("fp8func", "tensorwise", True),
    "fp8func-tensorwise-local-off": ("fp8func", "tensorwise", False),
    "fp8func-rowwise": ("fp8func", "rowwise", True),
    "fp8func-rowwise-off": ("fp8func", "rowwise", False),
    "fp8func-delayed": ("fp8func", "delayed-dynamic-weight", True),
    "fp8func-delayed-off": ("fp8func", "delayed-dynamic-weight", False),
    "fp8func-tensorwise-stock": ("fp8func", "tensorwise", True),
    "fp8func-tensorwise-stock-off": ("fp8func", "tensorwise", False),
    "fp8func-rowwise-stock": ("fp8func", "rowwise", True),
}
DEFAULT_CONFIGS = [n for n in CONFIGS
                   if "delayed" not in n and "stock" not in n and n != "fp8func-tensorwise-local-off"]
AC_MODES = ("none", "full", "selective")
AC_DESCRIPTION = {"none": "none", "full": "full (checkpoint_wrapper, the whole layer recomputed)",
                  "selective": "selective, op-level (matmul, attention, max and reduce-scatter / all-reduce outputs "
                               "saved, the rest recomputed; fp8func: its input casts saved too)"}
NO_KEEP = " (--no-sac-keep-casts: the fp8func input casts recomputed)"
# Dense bf16 tensor-core peak (no sparsity), FLOP/s, by a name torch.cuda.get_device_name() contains.
# PCIe and NVL parts have lower clocks: not matched here (--peak-tflops gives theirs).
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}


def fp8func_recipe(recipe: str) -> f8.Recipe:
    """The fp8func Recipe of a CONFIGS recipe name."""
    if recipe == "delayed-dynamic-weight":
        return f8.Recipe.from_name("delayed", delayed=f8.DelayedScaling(weight=False))
    return f8.Recipe.from_name(recipe)


def _ops(*names: str) -> list:
    """The ``.default`` overloads of ``namespace.op`` names that this torch has."""
    found = []
    for name in names:
        namespace, op = name.split(".")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.append(packet.default)
    return found


# torchtitan's op-level selective AC: these outputs are saved, every other op is recomputed
# (aten.max: the amax of torchao's float8 casts, which torchtitan keeps for low-precision training).
SAC_SAVE_OPS = _ops("aten.mm", "aten._scaled_mm", "aten._scaled_mm_v2", "aten.max",
                    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
                    "aten._scaled_dot_product_cudnn_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
                    "_c10d_functional.reduce_scatter_tensor", "_c10d_functional.all_reduce")


def _sac_context(keep_fp8_casts: bool):
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    # a list: MUST_SAVE these, PREFER_RECOMPUTE the rest; fp8func's policy also keeps its input casts
    policy = f8.nn.selective_checkpoint_policy(SAC_SAVE_OPS) if keep_fp8_casts else SAC_SAVE_OPS
    return create_selective_checkpoint_contexts(policy)


def apply_ac(layer: torch.nn.Module, mode: str, keep_fp8_casts: bool = False) -> torch.nn.Module:
    """``layer`` under activation checkpointing ``mode`` (``AC_MODES``): itself for "none", else
    wrapped in ``checkpoint_wrapper`` (non-reentrant), "selective" with the op-level policy
    (``keep_fp8_casts``: through ``fp8func.nn.selective_checkpoint_policy``)."""
    if mode == "none":
        return layer
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs = {"context_fn": functools.partial(_sac_context, keep_fp8_casts)} if mode == "selective" else {}
    return checkpoint_wrapper(layer, preserve_rng_state=False, **kwargs)


def flops_per_token(args) -> int:
    """Model FLOPs per trained token, forward and backward (PaLM's count, torchtitan's
    ``get_num_flop_per_token``): 6 x the matmul weights (q, k, v, o, gate, up, down per layer,
    and lm_head; the embedding is a lookup) + 12 x layers x (heads x head_dim) x seq (attention's
    QK^T and AV, the causal mask not discounted)."""
    head_dim = args.hidden // args.heads
    per_layer = (2 * args.hidden * args.heads * head_dim + 2 * args.hidden * args.kv_heads * head_dim
                 + 3 * args.hidden * args.intermediate)
    matmul_params = args.layers * per_layer + args.vocab * args.hidden
    return 6 * matmul_params + 12 * args.layers * args.heads * head_dim * args.seq


def peak_flops(args) -> float | None:
    """Peak dense bf16 FLOP/s of one device: ``--peak-tflops``, else ``PEAK_BF16_FLOPS`` by the GPU's
    name; None on the CPU or an unlisted GPU."""
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    if args.device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    if "PCIe" in name or "NVL" in name:
        return None
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def mfu(tokens_per_s: float, args, world: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: global tokens/s x ``flops_per_token`` over ``world`` devices' peak."""
    return None if not peak else tokens_per_s * flops_per_token(args) / (world * peak)


# c10::ScalarType names, as the flight recorder writes them -> bytes per element
ITEMSIZE = {"Byte": 1, "Char": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e8m0fnu": 1,
            "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1, "Short": 2, "Half": 2, "BFloat16": 2,
            "Int": 4, "Float": 4, "Long": 8, "Double": 8}
KINDS = (("all_gather", ("all_gather", "allgather")), ("reduce_scatter", ("reduce_scatter",)),
         ("all_reduce", ("all_reduce", "allreduce")))


class FlightRecorderBytes:
    """Bytes that this rank put into each collective, per process group, between two marks.

    Reads c10d's flight recorder (``TORCH_FR_BUFFER_SIZE`` entries, set before the process group
    is created): it logs each collective where the process group runs it, so it sees FSDP2's
    gathers, DTensor's and fp8func's functional collectives, and those inside compiled graphs."""

    def __init__(self, backend: str, groups: dict[str, dist.ProcessGroup]):
        c10d = torch._C._distributed_c10d
        self._dump = getattr(c10d, "_dump_nccl_trace" if backend == "nccl" else "_dump_fr_trace", None)
        self._labels = {pg.group_name: label for label, pg in groups.items()}

    def _entries(self) -> list[dict] | None:
        if self._dump is None:
            return None
        return pickle.loads(self._dump(True, False, False)).get("entries", [])

    def mark(self) -> int | None:
        entries = self._entries()
        return None if entries is None else max((e["record_id"] for e in entries), default=-1)

    def since(self, mark: int | None) -> dict | None:
        """{group label: {kind: bytes}} for the collectives recorded after ``mark``."""
        entries = None if mark is None else [e for e in self._entries() if e["record_id"] > mark]
        if not entries:
            return None
        if min(e["record_id"] for e in entries) != mark + 1:
            raise RuntimeError(f"the flight recorder's ring buffer (TORCH_FR_BUFFER_SIZE="
                               f"{os.environ.get('TORCH_FR_BUFFER_SIZE')}) dropped entries of the measured "
                               "steps; set a larger TORCH_FR_BUFFER_SIZE or a smaller --bytes-steps.")
        out: dict = {}
        for e in entries:
            name = e["profiling_name"].split(":")[-1]
            kind = next((k for k, keys in KINDS if any(s in name for s in keys)), name)
            per_group = out.setdefault(self._labels.get(e["process_group"][0], "other"), {})
            per_group[kind] = per_group.get(kind, 0) + sum(
                math.prod(size) * _itemsize(dtype) for size, dtype in zip(e["input_sizes"], e["input_dtypes"]))
            per_group[kind + " calls"] = per_group.get(kind + " calls", 0) + 1
        return out


def _itemsize(name: str) -> int:
    dtype = getattr(torch, name.lower(), None)  # e.g. "UInt16" -> torch.uint16
    if name not in ITEMSIZE and not isinstance(dtype, torch.dtype):
        raise ValueError(f"flight recorder dtype {name!r} has no known size; add it to ITEMSIZE.")
    return ITEMSIZE.get(name) or dtype.itemsize


class CountFsdpGathers:
    """Bytes handed to ``dist.all_gather_single`` / ``all_gather_into_tensor`` (FSDP2's weight
    all-gathers; its hooks run eagerly, compiled layers or not) while ``on`` is True."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self):
        self.bytes, self.on = 0, False
        self._orig = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def __enter__(self):
        for name, orig in self._orig.items():
            def counting(output_tensor, input_tensor, *args, _orig=orig, **kwargs):
                if self.on:
                    self.bytes += input_tensor.numel() * input_tensor.element_size()
                return _orig(output_tensor, input_tensor, *args, **kwargs)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def build_llama(args, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**config_kwargs(args))
    torch.manual_seed(0)
    with torch.device(device):  # fp32 master weights, initialised where they train
        return LlamaForCausalLM(config)


def torchao_sp_plans() -> tuple[dict, dict]:
    """``sp_plans``'s layout with torchao's float8 styles (its activations travel in float8)."""
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    col, row = Float8ColwiseParallel, Float8RowwiseParallel
    model_plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                  "model.norm": SequenceParallel(),
                  "lm_head": col(input_layouts=Shard(1), output_layouts=Replicate())}
    block_plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareFloat8ModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                              desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": col(), "self_attn.k_proj": col(), "self_attn.v_proj": col(),
        "self_attn.o_proj": row(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareFloat8ModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "mlp.gate_proj": col(), "mlp.up_proj": col(), "mlp.down_proj": row(output_layouts=Shard(1)),
    }
    return model_plan, block_plan


def convert(model, name: str, fp8_lm_head: bool = False) -> tuple[dict, dict]:
    """Converts ``model`` for configuration ``name`` in place; returns its (model, layer) TP plans.

    Without ``fp8_lm_head`` the vocabulary projection stays bf16 (stock ``ColwiseParallel``) in
    every configuration: it runs outside the per-layer compiled regions, where an FP8 linear on
    DTensors casts eagerly."""
    lib, recipe, fp8_gather = CONFIGS[name]
    keep = (lambda module, fqn: True) if fp8_lm_head else (lambda module, fqn: fqn != "lm_head")
    if lib == "fp8func":
        r = fp8func_recipe(recipe)
        f8.convert(model, r, fsdp_fp8_all_gather=fp8_gather, filter=keep)
        # delayed casts its input itself, and "-stock" asks for them: the stock styles (bf16 sequence gathers)
        plans = sp_plans(fp8_styles=r.delayed is None and "-stock" not in name, local_scales="-local" in name)
    elif lib == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        if recipe == "tensorwise":
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_gather)
            plans = torchao_sp_plans()
        else:  # torchao's float8 TP styles cast tensorwise: the stock ones (as torchtitan for row-wise)
            config = Float8LinearConfig.from_recipe_name(recipe)
            plans = sp_plans(fp8_styles=False)
        convert_to_float8_training(model, config=config, module_filter_fn=keep)
    else:
        return sp_plans(fp8_styles=False)
    if not fp8_lm_head:
        plans[0]["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    return plans


# AdamW's implementations (torchtitan's ``optimizer.implementation``): fused runs one kernel per
# parameter group and dtype, foreach one per op over all tensors, for-loop the ops per tensor.
OPTIMIZERS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}


def build(args, name: str, mesh, device):
    model = build_llama(args, device)
    plans = convert(model, name, args.fp8_lm_head)

    def per_layer(layer):  # after TP, before FSDP2: AC, then per-layer compile (torchtitan's order)
        layer = apply_ac(layer, args.ac, keep_fp8_casts=CONFIGS[name][0] == "fp8func" and args.sac_keep_casts)
        if args.compile:  # FSDP2's hooks stay eager
            layer.compile(backend=args.compile_backend)
        return layer

    _, dp_mesh = shard_2d(model, mesh, *plans, per_layer=per_layer)
    if CONFIGS[name][0] == "fp8func" and fp8func_recipe(CONFIGS[name][1]).delayed is not None:
        f8.distributed.share_scaling_state(model, dp_mesh)  # one state on every rank, FSDP2's dp mesh
        f8.nn.hook_scaling_states(model)  # parallelize_module made the state buffers DTensors: hook those
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, **OPTIMIZERS[args.optimizer])


def scale_precompute(args, name: str):
    """What ``name`` runs after each optimizer step with ``--precompute-scales``: every tensorwise
    fp8-gathered weight's scale in one all-reduce instead of one per weight in FSDP2's hook
    (fp8func ``precompute_scales``, torchao ``precompute_float8_dynamic_scale_for_fsdp``; same
    numbers either way). None where it does not apply."""
    lib, recipe, fp8_gather = CONFIGS[name]
    if not (args.precompute_scales and fp8_gather and recipe in ("tensorwise", "delayed-dynamic-weight")):
        return None
    if lib == "torchao":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        return precompute_float8_dynamic_scale_for_fsdp
    return f8.precompute_scales


def causal_mask(args, device):
    """The mask of the whole sequence: the layers see all tokens after the sequence gather, while
    HF would size its mask from the embedding's output, which holds this rank's tokens only."""
    if args.attn == "sdpa":
        return None  # no mask: sdpa takes is_causal over the whole (gathered) sequence
    lowest = torch.finfo(torch.bfloat16).min
    return torch.full((args.seq, args.seq), lowest, dtype=torch.bfloat16, device=device).triu(1)[None, None]


def prime_lazy_state(names, mesh, device) -> None:
    """Eager fp8func linears (forward and backward; plain tensors and DTensors) before any compiled run.

    State that fills on first use (einops caches its backend per tensor type at its first call,
    which fp8func's amax reaches with torch.Tensor and DTensor) makes dynamo break the graph there
    when that first call happens while compiling: the first compiled fp8func configuration of a
    process would be split (and rounded) differently from the later ones, and a bitwise on/off
    comparison would compare process order, not numerics."""
    for recipe in sorted({CONFIGS[n][1] for n in names if CONFIGS[n][0] == "fp8func"}):
        for wrap in (lambda t: t, lambda t: DTensor.from_local(t, submesh(mesh, "tp"), [Replicate()], run_check=False)):
            x, w = (wrap(torch.randn(32, 32, device=device, dtype=torch.bfloat16).requires_grad_()) for _ in "xw")
            r = fp8func_recipe(recipe)
            if r.delayed:
                state = f8.LinearScalingState.init(r.delayed.history_len, device).requires_grad_()
                y, _ = f8.linear_delayed(x, w, None, r, state)
            else:
                y = f8.linear(x, w, None, r)
            y.sum().backward()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def train(args, name, mesh, device, recorder):
    """Trains configuration ``name``; returns per-step losses (mean over dp), times and bytes."""
    model, opt = build(args, name, mesh, device)
    precompute = scale_precompute(args, name)
    # fp8func precomputes after every optimizer step by itself; --no-precompute-scales turns that off too
    f8.distributed.precompute_after_optimizer_step(args.precompute_scales)
    dp_group, dp_rank = submesh(mesh, "dp").get_group(), mesh.get_local_rank("dp")
    positions, mask = torch.arange(args.seq, device=device)[None], causal_mask(args, device)
    warmup = min(args.warmup, args.steps - 1)
    last_measured = min(warmup + args.bytes_steps, args.steps) - 1
    losses, times, gathered, mark = [], [], None, None

    def one_step(model, opt, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
        # use_cache=False: a training step keeps no KV cache (with one, each compiled layer guards
        # on its own cache slot and recompiles, and past dynamo's recompile limit layers run eagerly).
        loss = model(input_ids=ids, labels=ids, position_ids=positions, attention_mask=mask, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if precompute is not None:
            precompute(model)
        return loss

    with CountFsdpGathers() as fsdp_count:
        for step in range(args.steps):
            if step == warmup:
                mark, fsdp_count.on = recorder.mark(), True
            sync(device)
            t0 = time.perf_counter()
            loss = one_step(model, opt, step)
            sync(device)
            times.append(time.perf_counter() - t0)
            if step == last_measured:
                gathered, fsdp_count.on = recorder.since(mark), False
            mean = loss.detach().float().clone()
            dist.all_reduce(mean, group=dp_group)
            losses.append(mean.item() / submesh(mesh, "dp").size())
            if not math.isfinite(losses[-1]):
                break  # every rank sees the same mean: all stop here
    profiled = None
    if args.profile and math.isfinite(losses[-1]):
        # every rank records (a profiler on one rank only slows that rank, and the others' waits
        # for it would show as its collectives' time); rank 0 reports, with each rank's span
        profiled = profile_one_step(one_step, model, opt, args.steps)
        spans = [None] * dist.get_world_size()
        dist.all_gather_object(spans, profiled["waits"]["span_ms"])
        profiled["span_ms_by_rank"] = spans
    del model, opt
    fsdp_bytes = None if gathered is None else fsdp_count.bytes / (last_measured - warmup + 1)
    return losses, times[warmup:] or times, gathered, fsdp_bytes, profiled


def profile_one_step(one_step, *step_args) -> dict:
    """``torch.profiler`` (CPU + CUDA) over one more step, after the timed ones (the profiler adds
    host time): ``fp8func.bench``'s ``step_profile`` of this rank's step."""
    from torch.profiler import ProfilerActivity, profile

    from fp8func.bench._timeline import step_profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        dist.barrier()  # the ranks start the step together, each under its profiler
        torch.cuda.synchronize()
        one_step(*step_args)
        torch.cuda.synchronize()
    return step_profile(prof, 1)


def run_config(args, name, mesh, device, recorder) -> dict:
    lib, recipe, fp8_gather = CONFIGS[name]
    row = {"config": name, "library": lib, "recipe": recipe, "fp8_all_gather": fp8_gather if lib != "bf16" else None}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    try:
        losses, times, gathered, fsdp_bytes, profiled = train(args, name, mesh, device, recorder)
    except Exception as e:  # torchao, or any config under --ac: its row says n/a and why; the others must run
        if lib != "torchao" and "deterministic" in str(e) and args.deterministic == "strict":
            raise RuntimeError(f"{name}: an op has no deterministic implementation under --deterministic strict; "
                               "rerun with --deterministic warn (flash attention's backward then is not "
                               "deterministic: add --attn eager to keep on == off comparable)") from e
        if lib != "torchao" and args.ac == "none":
            raise
        first_line = (str(e).strip().splitlines() or [""])[0]
        # "[<class 'torch.Tensor'>, <class 'torch.Tensor'>, ...]": a repeated item once, then "..."
        first_line = re.sub(r"(<class '[^']+'>, )\1+", r"\1..., ", first_line)
        row["error"] = f"{type(e).__name__}: {first_line[:450]}"
        row["error_message"] = f"{type(e).__name__}: {str(e).strip()}"
        if dist.get_backend() == "gloo" and "Invalid scalar type" in row["error"]:
            row["error"] += " (gloo has no float8 dtypes: torchao all-gathers float8 tensors, which needs NCCL)"
        if dist.get_rank() == 0:
            print(f"{name}: cannot run under this 2-D setup{'' if args.ac == 'none' else ' with --ac ' + args.ac}, "
                  f"reported n/a ({row['error_message']})", flush=True)
        return row
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    step_s = statistics.median(slowest.tolist())
    peak = torch.tensor([torch.cuda.max_memory_allocated() if device.type == "cuda" else 0], device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    bad = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    tokens_per_s = args.batch * args.seq * submesh(mesh, "dp").size() / step_s
    row.update(losses=losses, finite=bad is None, first_nonfinite_step=bad, loss_first=losses[0],
               loss_last=losses[-1], step_s=step_s, tokens_per_s=tokens_per_s,
               mfu=mfu(tokens_per_s, args, mesh.size(), peak_flops(args)),
               peak_mem_gib=peak.item() / 2**30 if device.type == "cuda" else None, collective_bytes=gathered,
               gather_bytes_dp=_per_step(gathered, "dp", args), gather_bytes_tp=_per_step(gathered, "tp", args),
               fsdp_gather_bytes_counted=fsdp_bytes, graph_breaks=sum(counters["graph_break"].values()),
               graph_break_reasons=sorted(counters["graph_break"])[:8], graphs=counters["stats"]["unique_graphs"],
               collective_calls=_calls_per_step(gathered, args), profile=profiled)
    return row


def _calls_per_step(gathered: dict | None, args) -> dict | None:
    """{"dp all_gather": n, "tp reduce_scatter": n, ...}: the collectives one rank runs per step."""
    if gathered is None:
        return None
    steps = min(args.bytes_steps, args.steps - min(args.warmup, args.steps - 1))
    return {f"{group} {kind.removesuffix(' calls')}": n / steps for group, kinds in sorted(gathered.items())
            for kind, n in sorted(kinds.items()) if kind.endswith(" calls")}


def _per_step(gathered: dict | None, group: str, args) -> float | None:
    if gathered is None:
        return None
    steps = min(args.bytes_steps, args.steps - min(args.warmup, args.steps - 1))
    return gathered.get(group, {}).get("all_gather", 0) / steps


def compare_on_off(rows: list[dict], reproducible: bool) -> None:
    """Fills ``on_equals_off`` of each fp8func pair: its loss sequences, bitwise (only where the
    kernels are ``reproducible``: on the GPU the fastest ones are not, so equal runs can differ)."""
    by_name = {r["config"]: r for r in rows}
    for r in rows:
        if not reproducible:
            continue
        other = by_name.get(r["config"] + "-off") or by_name.get(r["config"].removesuffix("-off"))
        if r["library"] == "fp8func" and other is not None and other is not r and "losses" in r and "losses" in other:
            r["on_equals_off"] = r["losses"] == other["losses"]
            r["first_differing_step"] = next(
                (i for i, (a, b) in enumerate(zip(r["losses"], other["losses"])) if a != b), None)


def compare_torchao(rows: list[dict]) -> None:
    """Fills ``vs_torchao`` of each fp8func row whose recipe has a torchao row (tensorwise: ``torchao``,
    rowwise: ``torchao-rowwise``): the ratio of their tokens/s, None where either did not run."""
    torchao = {r["recipe"]: r for r in rows if r["library"] == "torchao"}
    for r in rows:
        ref = torchao.get(r["recipe"]) if r["library"] == "fp8func" else None
        if ref is not None:
            r["vs_torchao_config"] = ref["config"]
            r["vs_torchao"] = (r["tokens_per_s"] / ref["tokens_per_s"]
                               if "tokens_per_s" in r and "tokens_per_s" in ref else None)


def table_line(r: dict, bf16_tok: float | None, compiled: bool) -> str:
    mib = lambda b: "n/a" if b is None else f"{b / 2**20:.2f}"  # noqa: E731
    gather = {None: "-", True: "on", False: "off"}[r["fp8_all_gather"]]
    if "error" in r:
        return f"| {r['config']} | {gather} | n/a | | n/a | | n/a | n/a | n/a | n/a | n/a | n/a ({r['error']}) | |"
    ratio = f"{r['tokens_per_s'] / bf16_tok:.2f}x" if bf16_tok else ""
    util = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    if "vs_torchao_config" not in r:
        vs_ao = ""
    else:
        vs_ao = "n/a" if r["vs_torchao"] is None else f"{r['vs_torchao']:.2f}x"
        vs_ao += f" ({r['vs_torchao_config']})"
    finite = "True" if r["finite"] else f"False (step {r['first_nonfinite_step']})"
    peak = "n/a" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.1f}"
    calls = ", ".join(f"{k} {v:g}" for k, v in (r["collective_calls"] or {}).items()) or "n/a"
    breaks = f"{r['graph_breaks']} ({r['graphs']} graphs)" if compiled else "- (eager)"
    return (f"| {r['config']} | {gather} | {r['tokens_per_s']:.0f} | {ratio} | {util} | {vs_ao} | "
            f"{mib(r['gather_bytes_dp'])} / {mib(r['gather_bytes_tp'])} | {calls} | {breaks} | {peak} | {finite} | "
            f"{r['loss_first']:.5f} / {r['loss_last']:.5f} | {_on_off(r)} |")


def _on_off(r: dict) -> str:
    if r.get("on_equals_off") is False and r.get("first_differing_step") is not None:
        return f"False (from step {r['first_differing_step']})"
    if r.get("on_equals_off") is None and r.get("library") == "fp8func" and r.get("not_reproducible"):
        return "n/a (--deterministic)"
    return str(r.get("on_equals_off", ""))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, seq=8192, batch=1)
    p.set_defaults(steps=100, hidden=4096, intermediate=14336, layers=4, heads=32, kv_heads=8, vocab=128256)
    p.add_argument("--tp", type=int, default=2, help="TP degree; dp = world size / tp")
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the median step time")
    p.add_argument("--bytes-steps", type=int, default=2, help="steps after the warm-up whose collectives are counted")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile each decoder layer (default: on for cuda, off for cpu)")
    p.add_argument("--compile-backend", default="inductor", choices=("inductor", "aot_eager"),
                   help="torch.compile backend of --compile; aot_eager: dynamo's graphs (and breaks) and "
                        "AOTAutograd's, with their collectives, run without inductor's code generation")
    p.add_argument("--precompute-scales", action=argparse.BooleanOptionalAction, default=True,
                   help="tensorwise with FSDP2 fp8 all-gather: compute the weights' scales in one all-reduce "
                        "after each optimizer step (both libraries; the recommended FSDP2 setting)")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="fused",
                   help="AdamW's implementation (torchtitan's default: fused)")
    p.add_argument("--fp8-lm-head", action="store_true",
                   help="convert the vocabulary projection (lm_head) too; by default it stays bf16 in every config")
    p.add_argument("--ac", choices=AC_MODES, default="none",
                   help="activation checkpointing of each decoder layer: full (recompute the layer) or "
                        "selective (torchtitan's op-level policy: save matmul, attention and reduce-scatter / "
                        "all-reduce outputs, recompute the rest)")
    p.add_argument("--sac-keep-casts", action=argparse.BooleanOptionalAction, default=True,
                   help="--ac selective, fp8func configs: keep the layers' FP8 input casts for the backward "
                        "(fp8func.nn.selective_checkpoint_policy) instead of casting the recomputed inputs again")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak dense bf16 TFLOP/s of one device for the MFU column (default: H100 SXM / H200 "
                        "989; another GPU or the CPU: n/a)")
    p.add_argument("--deterministic", choices=("strict", "warn", "off"), default="off",
                   help="strict: deterministic kernels, erroring where none exists (flash attention's backward "
                        "is deterministic only so); warn: warn there instead; off: fastest kernels")
    p.add_argument("--async-tp", action="store_true",
                   help="async TP (torchtitan's): inductor's micro-pipeline pass splits each compiled layer's "
                        "sequence all-gather + matmul and matmul + reduce-scatter into chunks that overlap "
                        "(symmetric memory on the tp group); needs --device cuda, --compile and --tp > 1")
    p.add_argument("--profile", action="store_true",
                   help="one more step per configuration under torch.profiler: GPU ms by kernel class and "
                        "collective, exposed NCCL time and idle GPU time (rank 0's; the JSON has it)")
    args = p.parse_args()
    args.compile = args.device == "cuda" if args.compile is None else args.compile
    if args.async_tp and (args.device != "cuda" or not args.compile or args.tp < 2):
        p.error(f"--async-tp rewrites compiled CUDA graphs over a tp group: it needs --device cuda (got "
                f"{args.device}), --compile (got {args.compile}) and --tp > 1 (got {args.tp})")
    if args.profile and args.device != "cuda":
        p.error("--profile reads CUDA kernels: it needs --device cuda")
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    return args


def enable_async_tp(tp_group) -> None:
    """torchtitan's async TP: inductor's micro-pipeline TP pass over symmetric memory on ``tp_group``."""
    from torch.distributed import _symmetric_memory as symm_mem

    torch._inductor.config._micro_pipeline_tp = True
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(tp_group.group_name)


def set_determinism(mode: str) -> None:
    if mode == "off":
        return
    # Bitwise comparisons need bitwise-reproducible runs: deterministic kernels, a fixed cuBLAS
    # workspace (read when cuBLAS starts: set before any CUDA work), no benchmark-driven choices in inductor.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=mode == "warn")
    if hasattr(torch._inductor.config, "deterministic"):
        torch._inductor.config.deterministic = True


def main():
    args = parse_args()
    set_determinism(args.deterministic)
    for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):  # read when the process groups start
        os.environ.setdefault(var, "50000")
    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    world = dist.get_world_size()
    if world % args.tp or args.seq % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the {world} processes and --seq {args.seq} "
                         "(sequence parallel splits the sequence evenly)")
    device = local_device(args.device)
    mesh = init_device_mesh(args.device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    groups = {"dp": submesh(mesh, "dp").get_group(), "tp": submesh(mesh, "tp").get_group()}
    recorder = FlightRecorderBytes(backend, groups)
    if args.async_tp:
        enable_async_tp(groups["tp"])
    prime_lazy_state(args.configs.split(","), mesh, device)
    rows = []
    for name in args.configs.split(","):
        rows.append(run_config(args, name, mesh, device, recorder))
        if dist.get_rank() == 0:
            print({k: v for k, v in rows[-1].items() if k not in ("losses", "collective_bytes")}, flush=True)
    reproducible = args.device != "cuda" or args.deterministic != "off"
    compare_on_off(rows, reproducible)
    compare_torchao(rows)
    for r in rows:
        r["not_reproducible"] = not reproducible
    if dist.get_rank() == 0:
        report(args, rows, world, mesh)
    dist.destroy_process_group()
    broken = [f"{r['config']} (step {r['first_nonfinite_step']}: {r['losses'][-1]})"
              for r in rows if not r.get("finite", True)]
    if broken:
        raise SystemExit(f"non-finite loss in {', '.join(broken)}: training diverged or overflowed")


def report(args, rows, world, mesh) -> None:
    import transformers

    try:
        import torchao
        ao = torchao.__version__
    except ImportError:
        ao = "not installed"
    peak = peak_flops(args)
    peak_text = "n/a" if peak is None else f"{peak / 1e12:g}"
    env = environment(world, args.device) | {
        "world size": str(world), "mesh": f"dp={submesh(mesh, 'dp').size()} x tp={submesh(mesh, 'tp').size()}",
        "torchao": ao, "transformers": transformers.__version__,
        "compile": f"{args.compile} ({args.compile_backend})" if args.compile else "False",
        "deterministic mode": args.deterministic, "activation checkpointing": args.ac,
        "peak bf16 TFLOP/s per device": peak_text}
    bf16 = next((r["tokens_per_s"] for r in rows if r["config"] == "bf16" and "tokens_per_s" in r), None)
    description = (f"Llama {args.layers} layers, hidden {args.hidden}, MLP {args.intermediate}, heads {args.heads}/"
                   f"{args.kv_heads} kv, vocab {args.vocab}, seq {args.seq}, batch {args.batch} per dp rank, "
                   f"{args.steps} steps ({args.warmup} warm-up), {args.attn} attention, fp32 master + bf16 "
                   f"MixedPrecisionPolicy, AdamW ({args.optimizer}) lr {args.lr}, "
                   + ("FSDP2 over dp x sequence-parallel TP over tp, " if args.tp > 1
                      else "FSDP2 over dp (tp=1: no TP styles), ") +
                   f"lm_head {'FP8' if args.fp8_lm_head else 'bf16'} in the FP8 configs, tensorwise weight "
                   "scales "
                   f"{'precomputed after each optimizer step' if args.precompute_scales else 'in the FSDP2 hook'}. "
                   f"Activation checkpointing per decoder layer: {AC_DESCRIPTION[args.ac]}"
                   f"{NO_KEEP if args.ac == 'selective' and not args.sac_keep_casts else ''}. "
                   f"MFU: {flops_per_token(args) / 1e9:.3g} GFLOP per token (6 x matmul weights + 12 x layers x "
                   f"hidden x seq) x tokens/s over {world} x the peak dense bf16 FLOP/s "
                   f"({peak_text + ' TFLOP/s' if peak else 'n/a: the CPU or an unlisted GPU; --peak-tflops gives it'})"
                   ". "
                   f"vs torchao: tokens/s over the torchao row of the same recipe; torchao-rowwise runs the stock TP "
                   f"styles and all-gathers bf16 weights (torchao's float8 TP styles and FSDP2 float8 all-gather "
                   f"are tensorwise only). "
                   f"All-gathered MiB: what one rank sends per step (FSDP2 weights over dp / activations and "
                   f"gradients over tp), from the c10d flight recorder over {args.bytes_steps} step(s).")
    header = ("| config | FSDP2 fp8 all-gather | tokens/s (global) | vs bf16 | MFU | vs torchao "
              "| all-gather MiB/step/rank dp / tp "
              "| collectives per step and rank | graph breaks | peak GiB | all finite | loss first / last | "
              "on == off (bitwise) |")
    emit(args, env, description, header, [table_line(r, bf16, bool(args.compile)) for r in rows],
         {"rows": rows, "curves": {r["config"]: r.get("losses") for r in rows}})
    if args.profile:
        print("\n".join(profile_table(rows)))


PROFILE_CLASSES = ("GEMM fp8", "GEMM bf16", "attention", "fp8func casts", "inductor/triton fused", "optimizer",
                   "other")


def profile_table(rows: list[dict]) -> list[str]:
    """``--profile``: rank 0's GPU ms in one step by kernel class and collective, and the GPU's idle time."""
    nccl = sorted({k for r in rows for k in ((r.get("profile") or {}).get("classes") or {}) if k.startswith("NCCL")})
    lines = ["", "One step under torch.profiler, rank 0, GPU ms (calls) by kernel class; NCCL exposed: collective "
             "time with no compute kernel beside it; idle: the GPU waiting for its host / for a dependency:", "",
             "| config | step span ms (ranks) | " + " | ".join(PROFILE_CLASSES + tuple(nccl))
             + " | NCCL exposed | idle host / dependency | async TP fused ops |",
             "|---" * (len(PROFILE_CLASSES) + len(nccl) + 5) + "|"]
    for r in rows:
        prof = r.get("profile")
        if not prof:
            continue
        cells = [f"{prof['classes'].get(k, (0.0, 0))[0]:.1f} ({prof['classes'].get(k, (0.0, 0))[1]:g})"
                 for k in PROFILE_CLASSES + tuple(nccl)]
        w = prof["waits"]
        spans = prof.get("span_ms_by_rank") or [w["span_ms"]]
        lines.append(f"| {r['config']} | {w['span_ms']:.1f} ({min(spans):.1f}-{max(spans):.1f}) | " + " | ".join(cells)
                     + f" | {w['nccl_exposed_ms']:.1f} | {w['idle_host_ms']:.1f} / {w['idle_dependency_ms']:.1f} | "
                     f"{prof['symm_mem_ops']:g} |")
    return lines


if __name__ == "__main__":
    main()
