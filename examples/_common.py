"""Shared by the examples: a Qwen3 built from command-line sizes (no download), run metadata."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch


def add_model_args(p: argparse.ArgumentParser, *, seq: int, batch: int) -> None:
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--attn", default="sdpa", help="HF attention implementation (sdpa, eager)")
    p.add_argument("--json", help="write the table and the loss curves here (rank 0)")


def config_kwargs(args) -> dict:
    """HF decoder config fields from the command-line sizes (Qwen3Config and LlamaConfig alike)."""
    return dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                head_dim=args.hidden // args.heads, max_position_embeddings=args.seq, tie_word_embeddings=False,
                attn_implementation=args.attn)


def build_qwen3(args, device="cpu", dtype=torch.float32):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**config_kwargs(args))).to(device=device, dtype=dtype)


_SUBMESHES: dict = {}


def submesh(mesh, name: str):
    """``mesh[name]``, sliced once per process and reused.

    torch 2.13's ``mesh["tp"]`` builds a new DeviceMesh on every call. DTensors that carry equal
    but distinct meshes (a second model built in the same process, whose DTensor ops may also hit
    sharding-propagation cache entries made with the first model's mesh) make a compiled layer
    fail in inductor: ``device_mesh._get_submesh is not an OpOverload`` (docs/tp.md)."""
    root, sub = _SUBMESHES.get((id(mesh), name), (None, None))
    if root is not mesh:
        sub = mesh[name]
        _SUBMESHES[(id(mesh), name)] = (mesh, sub)
    return sub


def shard_2d(model, mesh, model_plan: dict, block_plan: dict, per_layer=None):
    """Sequence-parallel TP over ``mesh["tp"]`` (``model_plan`` on the model, ``block_plan`` on each
    decoder layer), then FSDP2 over ``mesh["dp"]`` per layer and at the root, fp32 masters with bf16
    compute. ``per_layer`` (optional) runs on each TP-sharded decoder layer before FSDP2 and returns
    the module that takes its place (activation checkpointing, compile: torchtitan's order).
    With one TP rank the plans are not applied (FSDP2 alone, as torchtitan runs ``tp=1``): a
    one-rank TP mesh moves nothing and would make every weight and activation a DTensor.
    Returns the (tp, dp) submeshes used (``submesh``: one object each per process)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    tp_mesh, dp_mesh = submesh(mesh, "tp"), submesh(mesh, "dp")
    if tp_mesh.size() > 1:
        parallelize_module(model, tp_mesh, model_plan)
        for layer in model.model.layers:
            parallelize_module(layer, tp_mesh, block_plan)
    if per_layer is not None:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = per_layer(layer)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    return tp_mesh, dp_mesh


def model_line(args) -> str:
    return (f"Qwen3 {args.layers} layers, hidden {args.hidden}, MLP {args.intermediate}, heads {args.heads}/"
            f"{args.kv_heads} kv, vocab {args.vocab}, seq {args.seq}, batch {args.batch}/rank, {args.steps} steps, "
            f"{args.attn} attention")


def environment(world: int, device: str) -> dict[str, str]:
    return {"command": f"torchrun --nproc-per-node {world} " + " ".join(sys.argv),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "cuda": str(torch.version.cuda),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "deterministic": str(torch.are_deterministic_algorithms_enabled())}


def local_device(device: str) -> torch.device:
    if device != "cuda":
        return torch.device("cpu")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cuda", torch.cuda.current_device())


def emit(args, env: dict, description: str, header: str, lines: list[str], payload: dict) -> None:
    """Print the run's metadata and markdown table (rank 0), and write the JSON if asked."""
    print(" | ".join(f"{k}: {v}" for k, v in env.items()))
    print(description)
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for line in lines:
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"environment": env, "args": vars(args), **payload}, fh)
