"""FSDP2 on one GPU: what the fp8 all-gather costs when there is nothing to gather.

``python -m fp8func.bench fsdp``: one process starts a one-rank process group itself (NCCL on a
GPU, gloo on the CPU), a one-rank device mesh, and trains the model of ``bench model`` (default:
four Llama-3-8B-shaped layers, seq 8192) under FSDP2: ``fully_shard`` on every decoder layer and
on the root, fp32 master weights, ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
AdamW; each decoder layer compiled on its own by default (FSDP2's hooks run eagerly between the
compiled layers, as in torchtitan). On one rank FSDP2 moves no bytes, so what shows is the cost
of the hooks themselves: with the fp8 all-gather on, the weight's cast runs in FSDP2's
pre-all-gather hook, outside the compiled layer; off, it runs inside it.

Configurations: bf16; torchao tensorwise with ``enable_fsdp_float8_all_gather=True`` and
``precompute_float8_dynamic_scale_for_fsdp`` after each optimizer step; fp8func tensorwise with
the fp8 all-gather on (and ``f8.precompute_scales`` after each step) and off; rowwise on and off;
delayed scaling of inputs and grad_outputs with the weight cast dynamically
(``DelayedScaling(weight=False)``, so that FSDP2 gathers it in FP8), its amaxes shared over the
mesh (``share_scaling_state``), on (``delayed-off`` runs when ``--configs`` names it). Per configuration:
tokens/s (median synchronized step), against bf16, against the same recipe with the all-gather
off, and against torchao; the host time of FSDP2's unshard per step (``torch.profiler`` CPU time
of the ``FSDP::pre_forward`` and ``FSDP::pre_backward`` regions, where the pre-all-gather hooks
run); peak memory; the loss at the last step; whether the losses equal the ``-off`` run's (on a CPU, or
with ``--deterministic`` on a GPU).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import fp8func as f8

from . import _model as m

# name -> (library, recipe, convert filter, FSDP2 fp8 all-gather)
CONFIGS = {
    "bf16": ("bf16", None, None, None),
    "torchao-tensorwise": ("torchao", "tensorwise", None, True),
    "tensorwise": ("fp8func", "tensorwise", None, True),
    "tensorwise-off": ("fp8func", "tensorwise", None, False),
    "rowwise": ("fp8func", "rowwise", None, True),
    "rowwise-off": ("fp8func", "rowwise", None, False),
    "delayed": ("fp8func", "delayed", None, True),
    "delayed-off": ("fp8func", "delayed", None, False),
}
DEFAULT_CONFIGS = [n for n in CONFIGS if n != "delayed-off"]
UNSHARD_REGIONS = ("FSDP::pre_forward", "FSDP::pre_backward")


def init_one_rank(device) -> bool:
    """A one-rank process group on a free localhost port (NCCL on CUDA, gloo on the CPU); True if
    this call made it (and should destroy it), False if one of world size 1 already exists."""
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"fp8func.bench fsdp runs on one rank; the process group has "
                               f"{dist.get_world_size()}. Run it as one plain process, not under torchrun.")
        return False
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device() if dev.index is None else dev.index)
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1, device_id=dev if dev.type == "cuda" else None)
    return True


def precompute(name: str):
    """What runs after each optimizer step: every tensorwise fp8-gathered weight's scale in one
    all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``, fp8func's
    ``precompute_scales``); None where the all-gather is off or the weight is not tensorwise."""
    lib, recipe, _, gather = CONFIGS[name]
    if not gather or not isinstance(m.fp8func_recipe(recipe, fsdp=True).weight.granularity, f8.TensorWise):
        return None
    if lib == "torchao":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        return precompute_float8_dynamic_scale_for_fsdp
    return f8.precompute_scales


def build(name: str, spec: dict, args, mesh):
    """The fp32 model of ``spec``, converted, sharded (every layer, then the root), compiled."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    lib, recipe, _, gather = CONFIGS[name]
    model = m.llama(spec, args.device, torch.float32)  # fp32 master weights
    fp8, linears = m.convert(model, name, fp8_lm_head=args.fp8_lm_head, tokens=spec["batch"] * spec["seq"],
                             fsdp_fp8_all_gather=bool(gather), configs=CONFIGS)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if lib == "fp8func" and recipe == "delayed":
        f8.distributed.share_scaling_state(model, mesh)
    m.compile_model(model, args.compile)
    return model, fp8, linears


def unshard_host_ms(step, steps: int = 3) -> float:
    """CPU ms per step inside FSDP2's pre-forward and pre-backward regions (the unshard, with the
    pre-all-gather hooks); nested regions counted once."""
    step()
    with profile(activities=[ProfilerActivity.CPU], acc_events=True) as prof:
        for _ in range(steps):
            step()
    total = 0.0
    for e in prof.events():
        if not e.name.startswith(UNSHARD_REGIONS):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith(UNSHARD_REGIONS):
            parent = parent.cpu_parent
        if parent is None:
            total += e.cpu_time_total
    return total / steps / 1e3


def run_config(name: str, spec: dict, args, data, mesh) -> dict:
    lib, recipe, filt, gather = CONFIGS[name]
    model, fp8, linears = build(name, spec, args, mesh)
    opt = m.optimizer(model, args)
    row = {"config": name, "library": lib, "recipe": recipe, "filter": filt, "fp8_all_gather": gather,
           "precompute": precompute(name) is not None, "fp8_linears": fp8, "linears": linears}
    probes = {"fsdp_unshard_host_ms": unshard_host_ms} | ({"profile_ms": m.profile_classes} if args.profile else {})
    row.update(m.measure(model, opt, data, args.device, warmup=args.warmup, iters=args.iters,
                         after_step=precompute(name), probes=probes))
    row["tokens_per_s"] = spec["batch"] * spec["seq"] / row["step_ms"] * 1e3
    del model, opt
    m.free(args.device)
    print({k: v for k, v in row.items() if k != "losses"}, flush=True)
    return row


def compare_on_off(rows: list[dict], deterministic: bool = True) -> None:
    """Adds ``vs_off`` (tokens/s against the same recipe with the all-gather off) and
    ``loss_equals_off`` (the loss sequences, bitwise: docs/fsdp.md's contract; None unless the
    kernels are ``deterministic``: a CPU, or ``--deterministic`` on a GPU)."""
    by = {r["config"]: r for r in rows}
    for r in rows:
        off = by.get(f"{r['config']}-off") if r["fp8_all_gather"] and r["library"] == "fp8func" else None
        r["vs_off"] = r["tokens_per_s"] / off["tokens_per_s"] if off else None
        same = r["losses"][:len(off["losses"])] == off["losses"][:len(r["losses"])] if off else None
        r["loss_equals_off"] = same if deterministic else None


def table(rows: list[dict], env: dict, setup: str) -> str:
    gather = {None: "-", True: "on", False: "off"}
    lines = [" | ".join(f"{k}: {v}" for k, v in env.items()), "", setup, "",
             "| config | FSDP2 fp8 all-gather | FP8 linears | ms/step | tokens/s | vs bf16 | vs off | vs torchao | "
             "FSDP2 unshard host ms/step | peak GiB | compile s: step 0 / steps 1-4 | loss at last step | "
             "bf16 loss at last step | losses == off |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        on = gather[r["fp8_all_gather"]] + (" + precomputed scales" if r["precompute"] else "")
        lines.append(f"| {r['config']} | {on} | {r['fp8_linears']}/{r['linears']} | {r['step_ms']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {m.fmt(r['vs_bf16'], '.2f', 'x')} | "
                     f"{m.fmt(r['vs_off'], '.2f', 'x')} | "
                     f"{m.fmt(r['vs_torchao'], '.2f', 'x')} | {r['fsdp_unshard_host_ms']:.2f} | "
                     f"{m.fmt(r['peak_gib'], '.1f')} | {r['compile_s'][0]:.1f} / {sum(r['compile_s'][1:]):.1f} | "
                     f"{r['loss']:.5f} (step {r['loss_step']}) | {m.fmt(r['bf16_loss'], '.5f')} | "
                     f"{'' if r['loss_equals_off'] is None else r['loss_equals_off']} |")
    return "\n".join(lines + (m.profile_table(rows) if any("profile_ms" in r for r in rows) else []))


def main(argv: list[str] | None = None) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m fp8func.bench fsdp", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    m.add_common_args(p, CONFIGS, "8b-layers", ",".join(DEFAULT_CONFIGS), compile_choices=("block", "none"))
    p.add_argument("--profile", action="store_true", help="GPU time of a step by kernel class (torch.profiler)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels (torch.use_deterministic_algorithms): the losses of the fp8 all-gather "
                        "on and off are then compared bitwise; without it the column is not filled, since "
                        "nondeterministic kernels (SDPA's backward, the embedding's) make two runs of one "
                        "configuration differ and training amplifies it")
    args, spec, names = m.parse(p, argv, CONFIGS)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    env = m.environment("fsdp", argv, args.device)
    made = init_one_rank(args.device)
    try:
        mesh = init_device_mesh(torch.device(args.device).type, (1,))
        m.prime(names, args.device, CONFIGS)
        data = m.batches(spec, args.device)
        rows = m.run_all(lambda name: run_config(name, spec, args, data, mesh), names, args.json, env)
    finally:
        if made:
            dist.destroy_process_group()
    m.compare(rows, CONFIGS)
    compare_on_off(rows, args.deterministic or torch.device(args.device).type == "cpu")
    setup = (f"{m.model_line(spec)}; FSDP2 on a one-rank mesh ({env['device']}), fully_shard per decoder layer and "
             f"the root, fp32 master weights, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); "
             f"{m.step_line(args)}, then the scale precompute where stated; compile: {m.COMPILED[args.compile]}; "
             f"lm_head {'FP8' if args.fp8_lm_head else 'bf16'}; median of "
             f"{args.iters} synchronized steps after {m.COMPILE_STEPS} compile steps and {args.warmup} warm-up steps.")
    m.emit(table(rows, env, setup), env, rows, args.json, setup=setup, model=spec)
    return rows
