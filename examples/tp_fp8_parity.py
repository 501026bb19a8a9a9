"""FP8 with tensor parallel: Qwen3 from a config, TP=2 against TP=1, per recipe and TP plan.

Every attention and MLP projection of each decoder layer is an ``Fp8Linear``. Plans:

* ``stock``: the stock ``ColwiseParallel`` / ``RowwiseParallel`` styles (fp8func reads the global
  amax of every sharded tensor through DTensor, so nothing overflows);
* ``sp``: sequence parallel (torchtitan's layout: the residual stream sharded along the sequence,
  embedding, norms and lm_head included) with the fp8func styles, whose activation and
  grad_output all-gathers move FP8 bytes; ``sp-stock``: the same plan with the stock styles, whose
  gathers move bf16. ``sp`` and ``sp-stock`` compute the same casts, so with deterministic kernels
  their losses are bitwise equal.

Prints one table: loss at TP=1 and TP=2, the largest relative difference over the run, whether
every loss was finite, and the median step time as tokens/s of one model replica (steps 5 on).

    torchrun --nproc-per-node 2 examples/tp_fp8_parity.py --steps 60 --plans stock,sp,sp-stock
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import fp8func as f8
from _common import add_model_args, build_qwen3, emit, environment, local_device, model_line
from fp8func.distributed import Fp8ColwiseParallel, Fp8RowwiseParallel, PrepareFp8ModuleInput

STOCK = {
    "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}


def sp_plans(fp8_styles: bool, local_scales: bool = False) -> tuple[dict, dict]:
    """(model plan, decoder-layer plan) for sequence parallel. ``local_scales``: the fp8func styles
    with TP-local scaling (no amax all-reduce over TP; docs/tp.md)."""
    prep, col, row = ((PrepareFp8ModuleInput, Fp8ColwiseParallel, Fp8RowwiseParallel) if fp8_styles
                      else (PrepareModuleInput, ColwiseParallel, RowwiseParallel))
    if local_scales:
        if not fp8_styles:
            raise ValueError("sp_plans: local_scales=True is an option of the fp8func styles; pass fp8_styles=True.")
        prep, col, row = (functools.partial(style, local_scales=True) for style in (prep, col, row))
    model_plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                  "model.norm": SequenceParallel(),
                  "lm_head": col(input_layouts=Shard(1), output_layouts=Replicate())}
    block_plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": prep(input_kwarg_layouts={"hidden_states": Shard(1)},
                          desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": col(), "self_attn.k_proj": col(), "self_attn.v_proj": col(),
        "self_attn.o_proj": row(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": prep(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "mlp.gate_proj": col(), "mlp.up_proj": col(), "mlp.down_proj": row(output_layouts=Shard(1)),
    }
    return model_plan, block_plan


def train(args, device, recipe, mesh, plan):
    model = build_qwen3(args, device, torch.bfloat16)
    f8.convert(model, recipe, fsdp_fp8_all_gather=False)
    if plan == "stock":
        for layer in model.model.layers:
            parallelize_module(layer, mesh, STOCK)
    elif plan in ("sp", "sp-stock"):
        model_plan, block_plan = sp_plans(fp8_styles=plan == "sp")
        parallelize_module(model, mesh, model_plan)
        for layer in model.model.layers:
            parallelize_module(layer, mesh, block_plan)
    # q_norm / k_norm act per head inside the TP region: their gradients are partial over TP.
    head_norms = [p for n, p in model.named_parameters() if "q_norm" in n or "k_norm" in n]
    # Keep DTensor (TP-sharded) and plain parameters in separate groups: the default foreach AdamW on
    # CUDA refuses a list that mixes torch.Tensor and DTensor (aten._foreach_mul_ raises).
    params = list(model.parameters())
    groups = [g for g in ([p for p in params if isinstance(p, DTensor)],
                          [p for p in params if not isinstance(p, DTensor)]) if g]
    opt = torch.optim.AdamW([{"params": g} for g in groups], lr=args.lr)
    # The embedding's output holds this rank's tokens only under sequence parallel: give the
    # positions and the causal mask for the whole sequence (harmless without it).
    positions = torch.arange(args.seq, device=device)[None]
    losses, times = [], []
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids, position_ids=positions, attention_mask={"full_attention": None}).loss
        loss.backward()
        if plan is not None:
            for p in head_norms:
                dist.all_reduce(p.grad if not isinstance(p.grad, DTensor) else p.grad.to_local())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.float().item())  # .item() synchronizes
        times.append(time.perf_counter() - t0)
    return losses, statistics.median(times[5:]) if len(times) > 5 else statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, seq=1024, batch=4)
    p.add_argument("--recipes", default="tensorwise,rowwise")
    p.add_argument("--plans", default="stock", help="comma list of stock, sp, sp-stock")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels (use with --attn eager) so that sp and sp-stock compare bitwise")
    args = p.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = local_device(args.device)
    mesh = init_device_mesh(args.device, (world,), mesh_dim_names=("tp",))
    rows, curves = [], {}
    for recipe in args.recipes.split(","):
        single, single_s = train(args, device, recipe, None, None)  # TP=1: each rank trains the whole model
        curves[recipe] = {"tp1": single}
        for plan in args.plans.split(","):
            tp, tp_s = train(args, device, recipe, mesh, plan)
            curves[recipe][plan] = tp
            rel = max(abs(a - b) / abs(b) for a, b in zip(tp, single))
            row = {"recipe": recipe, "plan": plan, "tp1_first": single[0], "tp2_first": tp[0],
                   "tp1_last": single[-1], "tp2_last": tp[-1], "max_rel_diff": rel,
                   "finite": all(math.isfinite(v) for v in tp + single),
                   "tp1_tok_s": args.batch * args.seq / single_s, "tp2_tok_s": args.batch * args.seq / tp_s}
            if plan == "sp-stock" and "sp" in curves[recipe]:
                row["sp_equals_sp_stock"] = curves[recipe]["sp"] == tp
            rows.append(row)
            if rank == 0:
                print(row, flush=True)
    if rank == 0:
        lines = [f"| {r['recipe']} | {r['plan']} | {r['tp1_first']:.5f} / {r['tp2_first']:.5f} | {r['tp1_last']:.5f} / "
                 f"{r['tp2_last']:.5f} | {r['max_rel_diff']:.2e} | {r['finite']} | {r['tp1_tok_s']:.0f} / "
                 f"{r['tp2_tok_s']:.0f} | {r.get('sp_equals_sp_stock', '')} |" for r in rows]
        emit(args, environment(world, args.device),
             model_line(args) + f", bf16 weights, AdamW lr {args.lr}, TP={world} vs TP=1",
             "| recipe | TP=2 plan | loss step 0 TP=1 / TP=2 | loss last step TP=1 / TP=2 | max rel diff | all finite "
             "| tokens/s of one replica TP=1 / TP=2 | sp == sp-stock (bitwise) |",
             lines, {"rows": rows, "curves": curves})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
