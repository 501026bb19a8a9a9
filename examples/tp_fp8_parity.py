"""FP8 with tensor parallel: Qwen3 from a config, TP=2 against TP=1, tensorwise and rowwise.

Every attention and MLP projection of each decoder layer is an ``Fp8Linear`` sharded with the
stock ``ColwiseParallel`` / ``RowwiseParallel`` styles; fp8func reads the global amax of every
sharded tensor through DTensor, so nothing overflows. Prints one table: loss at TP=1 and TP=2,
the largest relative difference over the run, and whether every loss was finite.

    torchrun --nproc-per-node 2 examples/tp_fp8_parity.py --steps 60
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fp8func as f8

PLAN = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}


def build(args, device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.seq, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def train(args, device, recipe, mesh):
    model = build(args, device)
    f8.convert(model, recipe, fsdp_fp8_all_gather=False)
    if mesh is not None:
        for layer in model.model.layers:
            parallelize_module(layer, mesh, PLAN)
    # q_norm / k_norm act per head inside the TP region: their gradients are partial over TP.
    head_norms = [p for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
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
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--recipes", default="tensorwise,rowwise")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    args = p.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
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
        env = {"command": f"torchrun --nproc-per-node {world} " + " ".join(os.sys.argv),
               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
        print(" | ".join(f"{k}: {v}" for k, v in env.items()))
        print(f"Qwen3 {args.layers} layers, hidden {args.hidden}, MLP {args.intermediate}, seq {args.seq}, "
              f"batch {args.batch}, bf16 weights, AdamW lr {args.lr}, {args.steps} steps, TP={world} vs TP=1")
        print("| recipe | loss step 0 TP=1 / TP=2 | loss last step TP=1 / TP=2 | max rel diff | all finite |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['recipe']} | {r['tp1_first']:.5f} / {r['tp2_first']:.5f} | {r['tp1_last']:.5f} / "
                  f"{r['tp2_last']:.5f} | {r['max_rel_diff']:.2e} | {r['finite']} |")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"environment": env, "args": vars(args), "rows": rows, "curves": curves}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
