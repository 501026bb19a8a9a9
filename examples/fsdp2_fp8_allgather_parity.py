"""Does turning the FSDP2 fp8 all-gather on change the loss? (In torchao it does.)

Qwen3 built from a config (no download), fp32 master weights, FSDP2
``MixedPrecisionPolicy(param_dtype=bf16)``, tensorwise FP8. For fp8func and for torchao, train
the same model on the same data twice, fp8 all-gather on and off, eager and compiled, and print
one table: the first step whose loss differs and the largest |difference|.

    torchrun --nproc-per-node 2 examples/fsdp2_fp8_allgather_parity.py --steps 60

Runs on GPUs (NCCL) or CPUs (gloo, ``--device cpu`` with a smaller ``--hidden``).
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8func as f8
from _common import add_model_args, build_qwen3, emit, environment, local_device, model_line


def convert(model, lib, fp8_gather):
    if lib == "fp8func":
        f8.convert(model, "tensorwise", fsdp_fp8_all_gather=fp8_gather)
    else:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_gather))


def train(args, mesh, device, lib, fp8_gather, compiled):
    model = build_qwen3(args, device)
    convert(model, lib, fp8_gather)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if compiled:
        for layer in model.model.layers:
            layer.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    rank = dist.get_rank()
    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(10_000 * step + rank)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach().float().item())
    del model, opt
    return losses


def compare(on, off):
    diffs = [abs(a - b) for a, b in zip(on, off)]
    first = next((i for i, d in enumerate(diffs) if d != 0.0), None)
    return first, max(diffs)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, seq=512, batch=4)
    p.add_argument("--libs", default="fp8func,torchao")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--control", default="fp8func",
                   help="libraries whose off run is repeated: the run-to-run reproducibility floor")
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                   help="allow non-deterministic GPU kernels (atomics in attention backward, autotuning)")
    p.set_defaults(attn="eager")  # SDPA's flash backward accumulates with atomics: not reproducible
    args = p.parse_args()
    if args.deterministic:
        # Bitwise comparisons need bitwise-reproducible runs: deterministic kernels, a fixed cuBLAS
        # workspace, and no benchmark-driven kernel choices in inductor.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        if hasattr(torch._inductor.config, "deterministic"):
            torch._inductor.config.deterministic = True

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank()
    device = local_device(args.device)
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))

    rows, curves = [], {}
    for lib in args.libs.split(","):
        for mode in args.modes.split(","):
            runs = {}
            keys = (("on", True), ("off", False)) + ((("off again", False),) if lib in args.control else ())
            for key, fp8_gather in keys:
                torch._dynamo.reset()
                runs[key] = train(args, mesh, device, lib, fp8_gather, mode == "compiled")
            pairs = [("on vs off", "on", "off")]
            pairs += [("off vs off (control)", "off again", "off")] if "off again" in runs else []
            for label, x, y in pairs:
                first, worst = compare(runs[x], runs[y])
                rows.append({"lib": lib, "mode": mode, "pair": label, "first_differing_step": first,
                             "max_abs_diff": worst, "final_a": runs[x][-1], "final_b": runs[y][-1],
                             "finite": all(math.isfinite(v) for v in runs[x] + runs[y])})
                if rank == 0:
                    print(rows[-1], flush=True)
            curves[f"{lib}/{mode}"] = runs

    if rank == 0:
        lines = []
        for r in rows:
            first = "none (bitwise equal)" if r["first_differing_step"] is None else str(r["first_differing_step"])
            lines.append(f"| {r['lib']} | {r['mode']} | {r['pair']} | {first} | {r['max_abs_diff']:.3e} | "
                         f"{r['final_a']:.6f} / {r['final_b']:.6f} | {r['finite']} |")
        emit(args, environment(dist.get_world_size(), args.device),
             model_line(args) + ", fp32 master + bf16 MP, tensorwise",
             "| library | mode | runs compared | first differing step | max abs loss diff | final losses | finite |",
             lines, {"rows": rows, "curves": curves})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
