"""The seed scenario: does turning the FSDP2 fp8 all-gather on change the loss?

Qwen3 built from a config (no download), fp32 master weights, FSDP2
``MixedPrecisionPolicy(param_dtype=bf16)``, tensorwise FP8. For fp8func and for torchao, train
the same model on the same data twice, fp8 all-gather on and off, eager and compiled, and print
one table: the first step whose loss differs and the largest |difference|.

    torchrun --nproc-per-node 2 examples/fsdp2_fp8_allgather_parity.py --steps 60

Runs on GPUs (NCCL) or CPUs (gloo, ``--device cpu`` with a smaller ``--hidden``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8func as f8


def build_model(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, max_position_embeddings=args.seq, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def convert(model, lib, fp8_gather):
    if lib == "fp8func":
        f8.convert(model, "tensorwise", fsdp_fp8_all_gather=fp8_gather)
    else:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_gather))


def train(args, mesh, device, lib, fp8_gather, compiled):
    model = build_model(args).to(device)
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
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--libs", default="fp8func,torchao")
    p.add_argument("--modes", default="eager,compiled")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="write the table and the loss curves here (rank 0)")
    args = p.parse_args()

    backend = "nccl" if args.device == "cuda" else "gloo"
    dist.init_process_group(backend)
    rank = dist.get_rank()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))

    rows, curves = [], {}
    for lib in args.libs.split(","):
        for mode in args.modes.split(","):
            runs = {}
            for fp8_gather in (True, False):
                torch._dynamo.reset()
                runs[fp8_gather] = train(args, mesh, device, lib, fp8_gather, mode == "compiled")
            first, worst = compare(runs[True], runs[False])
            rows.append({"lib": lib, "mode": mode, "first_differing_step": first, "max_abs_diff": worst,
                         "final_loss_on": runs[True][-1], "final_loss_off": runs[False][-1],
                         "finite": all(map(lambda v: v == v and abs(v) != float("inf"), runs[True] + runs[False]))})
            curves[f"{lib}/{mode}"] = runs
            if rank == 0:
                print(rows[-1], flush=True)

    if rank == 0:
        env = {"command": "torchrun --nproc-per-node %d %s" % (dist.get_world_size(), " ".join(os.sys.argv)),
               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "world_size": dist.get_world_size(), "torch": torch.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
        print(" | ".join(f"{k}: {v}" for k, v in env.items()))
        print(f"Qwen3 {args.layers} layers, hidden {args.hidden}, MLP {args.intermediate}, seq {args.seq}, "
              f"batch {args.batch}/rank, fp32 master + bf16 MP, tensorwise, {args.steps} steps")
        print("| library | mode | first differing step (on vs off) | max abs loss diff | final loss on / off |")
        print("|---|---|---|---|---|")
        for r in rows:
            first = "none (bitwise equal)" if r["first_differing_step"] is None else str(r["first_differing_step"])
            print(f"| {r['lib']} | {r['mode']} | {first} | {r['max_abs_diff']:.3e} | "
                  f"{r['final_loss_on']:.6f} / {r['final_loss_off']:.6f} |")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump({"environment": env, "args": vars(args), "rows": rows, "curves": curves}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
