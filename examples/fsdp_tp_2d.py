"""FP8 on a 2-D DeviceMesh: FSDP2 over "dp" x sequence-parallel TP over "tp", FP8 gathers on both.

Qwen3 from a config; every projection an ``Fp8Linear``; the weights are all-gathered by FSDP2 as
fp8 bytes (dp), the activations and grad_outputs by the fp8func TP styles (tp). Each dp rank
trains on its own batch; the tp ranks of one dp rank share it.

    torchrun --nproc-per-node 4 examples/fsdp_tp_2d.py --tp 2 --steps 20             # 2 x 2
    torchrun --nproc-per-node 4 examples/fsdp_tp_2d.py --tp 2 --device cpu --hidden 256 --intermediate 512 \\
        --layers 2 --heads 4 --kv-heads 4 --vocab 1024 --seq 256 --steps 5           # on CPUs (gloo)
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fp8func as f8
from _common import add_model_args, build_qwen3, local_device, model_line, shard_2d
from tp_fp8_parity import sp_plans


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, seq=1024, batch=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--recipe", default="rowwise")
    args = p.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} does not divide the {world} processes")
    device = local_device(args.device)
    mesh = init_device_mesh(args.device, (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    model = build_qwen3(args, device, torch.float32)  # fp32 master weights, bf16 compute
    f8.convert(model, args.recipe)  # FSDP2 fp8 all-gather on (the default)
    tp_mesh, dp_mesh = shard_2d(model, mesh, *sp_plans(fp8_styles=True))
    head_norms = [p for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=False)
    positions = torch.arange(args.seq, device=device)[None]
    dp_rank = mesh.get_local_rank("dp")
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids, position_ids=positions, attention_mask={"full_attention": None}).loss
        loss.backward()
        for p in head_norms:  # per-head norms inside the TP region: their gradients are partial over tp
            dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=tp_mesh.get_group())
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, group=dp_mesh.get_group())
        mean = mean.item() / dp_mesh.size()
        if not math.isfinite(mean):
            raise SystemExit(f"step {step}: loss {mean}")
        if dist.get_rank() == 0:
            print(f"step {step:3d}  loss {mean:.5f}", flush=True)
    if dist.get_rank() == 0:
        print(f"{model_line(args)}, recipe {args.recipe}, mesh dp={dp_mesh.size()} x tp={args.tp}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
