"""FP8 with tensor parallel: Qwen3 from a config, TP=2 against TP=1, tensorwise and rowwise.

Every attention and MLP projection of each decoder layer is an ``Fp8Linear`` sharded with the
stock ``ColwiseParallel`` / ``RowwiseParallel`` styles; fp8func reads the global amax of every
sharded tensor through DTensor, so nothing overflows. Prints one table: loss at TP=1 and TP=2,
the largest relative difference over the run, and whether every loss was finite.

    torchrun --nproc-per-node 2 examples/tp_fp8_parity.py --steps 60
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fp8func as f8
from _common import add_model_args, build_qwen3, emit, environment, local_device, model_line

PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}


def train(args, device, recipe, mesh):
    model = build_qwen3(args, device, torch.bfloat16)
    f8.convert(model, recipe, fsdp_fp8_all_gather=False)
    if mesh is not None:
        for layer in model.model.layers:
            parallelize_module(layer, mesh, PLAN)
    # q_norm / k_norm act per head inside the TP region: their gradients are partial over TP.
    head_norms = [p for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n]
    # Keep DTensor (TP-sharded) and plain parameters in separate groups: the default foreach AdamW on
    # CUDA refuses a list that mixes torch.Tensor and DTensor (aten._foreach_mul_ raises).
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [g for g in ([p for p in params if isinstance(p, DTensor)],
                          [p for p in params if not isinstance(p, DTensor)]) if g]
    opt = torch.optim.AdamW([{"params": g} for g in groups], lr=args.lr)
    losses = []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if mesh is not None:
            for p in head_norms:
                dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.float().item())
    return losses


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, seq=1024, batch=4)
    p.add_argument("--recipes", default="tensorwise,rowwise")
    args = p.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = local_device(args.device)
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("tp",))
    rows, curves = [], {}
    for recipe in args.recipes.split(","):
        single = train(args, device, recipe, None)  # TP=1: each rank trains the whole model alone
        tp = train(args, device, recipe, mesh)
        rel = max(abs(a - b) / abs(b) for a, b in zip(tp, single))
        finite = all(math.isfinite(v) for v in tp + single)
        rows.append({"recipe": recipe, "tp1_first": single[0], "tp2_first": tp[0], "tp1_last": single[-1],
                     "tp2_last": tp[-1], "max_rel_diff": rel, "finite": finite})
        curves[recipe] = {"tp1": single, "tp2": tp}
        if rank == 0:
            print(rows[-1], flush=True)
    if rank == 0:
        lines = [f"| {r['recipe']} | {r['tp1_first']:.5f} / {r['tp2_first']:.5f} | {r['tp1_last']:.5f} / "
                 f"{r['tp2_last']:.5f} | {r['max_rel_diff']:.2e} | {r['finite']} |" for r in rows]
        emit(args, environment(world, args.device),
             model_line(args) + f", bf16 weights, AdamW lr {args.lr}, TP={world} vs TP=1",
             "| recipe | loss step 0 TP=1 / TP=2 | loss last step TP=1 / TP=2 | max rel diff | all finite |",
             lines, {"rows": rows, "curves": curves})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
