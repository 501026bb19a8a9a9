"""Whole-model training step, tokens/s: an HF Llama in bf16, torchao and fp8func, side by side.

``python -m fp8func.bench model``: HF transformers ``LlamaForCausalLM`` built from a config (no
download), at Llama-3.2-1B shape (``--model 1b``: 16 layers, hidden 2048, MLP 8192, 32/8 heads,
vocab 128256, untied lm_head, seq 4096, batch 2) or four layers of Llama-3-8B shape (``--model
8b-layers``: hidden 4096, MLP 14336, 32/8 heads, vocab 128256, seq 8192, batch 1). bf16
parameters, AdamW (its state in bf16 too); a step is forward, loss, backward, ``optimizer.step()``
and ``zero_grad`` (``--optimizer none``: forward, loss, backward and ``zero_grad`` alone). Each
decoder layer and the loss are compiled on their own (``--compile block``, as torchtitan does), or
the whole model (``--compile model``), or nothing (``--compile none``).

Every configuration rebuilds the model from the same seed and trains on the same batches, in
one process: tokens/s from the median of ``--iters`` synchronized steps after five compile
steps and ``--warmup`` more; speedups over bf16 and over torchao's same recipe; compile time
(the first step, and the four after it, whose recompilations show there); peak GPU memory; the
loss at the last step next to bf16's; the linear layers each configuration put in FP8.
``--profile``: the GPU time of a step by kernel class (``torch.profiler``; the JSON also lists
the largest kernels by name with their class). ``--timeline``: whether the GPU waits for the host
in the layers' forward or backward (``_timeline``, CUDA events, no profiler). The lm_head stays
bf16 unless ``--fp8-lm-head``. The batches are tokens drawn from a Zipf law over the first 8192
ids, so that the loss falls within a few steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import math
import re
import statistics
import sys
import time

import torch

import fp8func as f8

from ._linear import parse_recipe
from ._timeline import table as timeline_table
from ._timeline import timeline
from ._timing import median_ms

MODELS = {
    "1b": dict(layers=16, hidden=2048, mlp=8192, heads=32, kv_heads=8, vocab=128256, seq=4096, batch=2),
    "8b-layers": dict(layers=4, hidden=4096, mlp=14336, heads=32, kv_heads=8, vocab=128256, seq=8192, batch=1),
    "tiny": dict(layers=2, hidden=128, mlp=256, heads=4, kv_heads=4, vocab=256, seq=64, batch=2),
}
# name -> (library, recipe, convert filter)
CONFIGS = {
    "bf16": ("bf16", None, None),
    "torchao-tensorwise": ("torchao", "tensorwise", None),
    "torchao-rowwise": ("torchao", "rowwise", None),
    "tensorwise": ("fp8func", "tensorwise", None),
    "rowwise": ("fp8func", "rowwise", None),
    "blockwise": ("fp8func", "blockwise", None),
    "delayed": ("fp8func", "delayed", None),
    "tensorwise+fastfwd": ("fp8func", "tensorwise+fastfwd", None),
    "delayed+fastfwd": ("fp8func", "delayed+fastfwd", None),
    "auto": ("fp8func", "tensorwise", "auto"),
}
COMPILE_STEPS = 5  # the first step compiles; the four after it show any recompilation
TOP_KERNELS = 40  # kernels listed by name in the JSON of a --profile run
COMPILED = {"block": "each decoder layer and the loss compiled on their own (as torchtitan does)",
            "model": "the whole model compiled as one graph, loss included", "none": "eager"}
KERNEL_CLASSES = ("GEMM bf16", "GEMM fp8", "attention", "fp8func casts", "inductor/triton fused", "optimizer", "other")


def llama(spec: dict, device, dtype: torch.dtype) -> torch.nn.Module:
    """``LlamaForCausalLM`` of ``spec``'s sizes (sdpa attention, untied lm_head), seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["mlp"],
                         num_hidden_layers=spec["layers"], num_attention_heads=spec["heads"],
                         num_key_value_heads=spec["kv_heads"], head_dim=spec["hidden"] // spec["heads"],
                         max_position_embeddings=spec["seq"], tie_word_embeddings=False, use_cache=False,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype)


def batches(spec: dict, device, n: int = 4, seed: int = 0) -> list[torch.Tensor]:
    """``n`` batches of token ids, the same for every configuration (Zipf over the first 8192 ids)."""
    g = torch.Generator().manual_seed(seed)
    weights = 1.0 / torch.arange(1, min(spec["vocab"], 8192) + 1, dtype=torch.float64)
    ids = torch.multinomial(weights, n * spec["batch"] * spec["seq"], replacement=True, generator=g)
    return list(ids.reshape(n, spec["batch"], spec["seq"]).to(device).unbind(0))


def fp8func_recipe(recipe: str, fsdp: bool = False) -> f8.Recipe:
    """The recipe of a configuration (``<recipe>+fastfwd``: the output GEMM in fast accumulation,
    as torchao's tensorwise configuration runs it). Under FSDP2, delayed scaling casts the weight
    dynamically, so that FSDP2 gathers it in FP8."""
    r = parse_recipe(recipe)[1]
    if r.delayed is not None and fsdp:
        return dataclasses.replace(r, delayed=dataclasses.replace(r.delayed, weight=False))
    return r


def convert(model, name: str, *, fp8_lm_head: bool, tokens: int, fsdp_fp8_all_gather: bool | None = None,
            configs: dict = CONFIGS) -> tuple[int, int]:
    """Converts ``model`` in place for configuration ``name``; returns (FP8 linears, all linears).

    Without ``fp8_lm_head`` only the decoder stack (``model.model``) is converted, so that the
    lm_head stays bf16 whatever the filter. ``fsdp_fp8_all_gather=None``: no FSDP2 (torchao's
    float8 all-gather off, fp8func's too)."""
    lib, recipe, filt = configs[name][:3]
    target = model if fp8_lm_head else model.model
    if lib == "fp8func":
        f8.convert(target, fp8func_recipe(recipe, fsdp_fp8_all_gather is not None), filter=filt, tokens=tokens,
                   fsdp_fp8_all_gather=bool(fsdp_fp8_all_gather))
    elif lib == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(recipe)
        if fsdp_fp8_all_gather:  # torchao gathers tensorwise weights only (its config says so otherwise)
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        convert_to_float8_training(target, config=config)
    return count_fp8_linears(model)


def count_fp8_linears(model) -> tuple[int, int]:
    """(linears in FP8, all linears): fp8func's from ``f8.report``, torchao's ``Float8Linear`` counted."""
    rows = f8.report(model, print_table=False)
    ao = sys.modules.get("torchao.float8.float8_linear")  # loaded only if a torchao config ran
    n_ao = sum(isinstance(mod, ao.Float8Linear) for mod in model.modules()) if ao is not None else 0
    return sum(r.converted for r in rows) + n_ao, len(rows)


def compile_model(model, how: str) -> None:
    """``block``: each decoder layer compiled on its own, and the loss (the lm_head's logits upcast
    to fp32, log-softmax and NLL over the vocabulary), as torchtitan compiles its blocks and its
    loss; ``model``: one graph, loss included (HF computes it in ``forward``); ``none``: eager."""
    if how == "block":
        for layer in model.model.layers:
            layer.compile()
        model.loss_function = torch.compile(model.loss_function)
    elif how == "model":
        model.compile()
    elif how != "none":
        raise ValueError(f"--compile {how!r}; expected block, model or none.")


def prime(names, device, configs: dict = CONFIGS) -> None:
    """One eager fp8func linear per recipe before anything compiles: state that fills on first use
    (einops caches its backend per tensor type) would otherwise break the graph of the first
    compiled fp8func configuration only, and the configurations would not compile alike."""
    for recipe in sorted({configs[n][1] for n in names if configs[n][0] == "fp8func"}):
        r = fp8func_recipe(recipe)
        x, w = (torch.randn(128, 128, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "xw")
        if r.delayed:
            state = f8.LinearScalingState.init(r.delayed.history_len, x.device).requires_grad_()
            y, _ = f8.linear_delayed(x, w, None, r, state)
        else:
            y = f8.linear(x, w, None, r)
        y.sum().backward()


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def wall_s(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def median_step_s(fn, device, warmup: int, iters: int) -> float:
    """Median synchronized step time: CUDA events on a GPU (``_timing.median_ms``), else the wall clock."""
    if torch.device(device).type == "cuda":
        return median_ms(fn, warmup=warmup, iters=iters) / 1e3
    for _ in range(warmup):
        fn()
    return statistics.median(wall_s(fn, device) for _ in range(iters))


def kernel_class(name: str) -> str:
    """The class of a GPU kernel, by its name, for the profile table."""
    n = name.lower()
    if re.match(r"_(amax|cast|quant)\w*_kernel", n):  # fp8func's Triton casts (fp8func.kernels)
        return "fp8func casts"
    if n.startswith("triton_") and not n.startswith("triton_tem_"):
        # inductor's fused kernels (norms, rope, SiLU, torchao's casts), named after the ATen ops
        # their code comes from, which include the GEMM whose operand they prepare: names such as
        # triton_poi_fused__scaled_mm__to_copy_clamp_... are casts, not GEMMs (triton_tem_: GEMMs)
        return "inductor/triton fused"
    if any(s in n for s in ("flash", "fmha", "attn", "attention", "sdpa")):
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "scaled_mm", "triton_tem_")):
        # cuBLAS's Hopper FP8 kernels: nvjet_sm90_qqtst_... / _qrtst_... (q, r: an fp8 operand)
        fp8 = (any(s in n for s in ("e4m3", "e5m2", "f8", "float8", "scaled"))
               or re.search(r"nvjet_(sm\d+_)?[qr][qr]", n) is not None)
        return "GEMM fp8" if fp8 else "GEMM bf16"
    if "multi_tensor_apply" in n or "adam" in n:
        return "optimizer"
    return "other"


def profile_classes(step) -> dict:
    """GPU ms per step by kernel class and host ms per step, from ``_profile.kernel_times``; under
    ``"kernels"`` the largest kernels (name, class, calls and ms per step), to check the classes."""
    from ._profile import kernel_times

    out = dict.fromkeys(KERNEL_CLASSES, 0.0)
    rows = kernel_times(step)
    for name, _calls, us in rows[:-1]:
        out[kernel_class(name)] += us / 1e3
    out["GPU total"] = sum(out[c] for c in KERNEL_CLASSES)
    out["host"] = rows[-1][2] / 1e3
    out["kernels"] = [{"name": name, "class": kernel_class(name), "calls": calls, "ms": us / 1e3}
                      for name, calls, us in rows[:-1][:TOP_KERNELS]]
    return out


def measure(model, opt, data, device, *, warmup: int, iters: int, after_step=None, probes: dict | None = None) -> dict:
    """Trains ``model``: ``COMPILE_STEPS`` steps timed one by one, then the median of ``iters``
    synchronized steps after ``warmup`` more; the loss of every step (a step: forward, loss,
    backward, ``opt.step()``, ``zero_grad``, then ``after_step(model)``). Then each of ``probes``
    (key -> function of the step) runs, its result under its key (after the losses are read)."""
    losses = []

    def step():
        ids = data[len(losses) % len(data)]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if opt is None:  # --optimizer none: forward and backward alone
            model.zero_grad(set_to_none=True)
        else:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(model)
        losses.append(loss.detach())

    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compile_s = [wall_s(step, device) for _ in range(COMPILE_STEPS)]
    step_s = median_step_s(step, device, warmup, iters)
    out = {"step_ms": step_s * 1e3, "compile_s": compile_s,
           "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs,
           "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.device(device).type == "cuda" else None,
           "losses": [float(v) for v in losses]}
    for key, probe in (probes or {}).items():
        out[key] = probe(step)
    return out


def optimizer(model, args):
    """AdamW over the model's parameters, or None (``--optimizer none``)."""
    return None if args.optimizer == "none" else torch.optim.AdamW(model.parameters(), lr=args.lr)


def step_line(args) -> str:
    if args.optimizer == "none":
        return "a step: forward, loss, backward, zero_grad (no optimizer)"
    return (f"AdamW (its state in the parameters' dtype), lr {args.lr}; a step: forward, loss, backward, "
            "optimizer step, zero_grad")


def free(device) -> None:
    gc.collect()
    torch.compiler.reset()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def run_config(name: str, spec: dict, args, data) -> dict:
    lib, recipe, filt = CONFIGS[name]
    model = llama(spec, args.device, torch.bfloat16)
    tokens = spec["batch"] * spec["seq"]
    fp8, linears = convert(model, name, fp8_lm_head=args.fp8_lm_head, tokens=tokens)
    compile_model(model, args.compile)
    opt = optimizer(model, args)
    row = {"config": name, "library": lib, "recipe": recipe, "filter": filt, "fp8_linears": fp8, "linears": linears}
    probes = {"profile_ms": profile_classes} if args.profile else {}
    if getattr(args, "timeline", False):
        probes["timeline"] = lambda step: timeline(model, step)
    row.update(measure(model, opt, data, args.device, warmup=args.warmup, iters=args.iters, probes=probes))
    row["tokens_per_s"] = tokens / row["step_ms"] * 1e3
    model = opt = None  # freed before the next configuration
    free(args.device)
    print({k: v for k, v in row.items() if k != "losses"}, flush=True)
    return row


def torchao_peer(name: str, configs: dict = CONFIGS) -> str | None:
    """The torchao configuration an fp8func one is compared with (its recipe's, delayed: tensorwise)."""
    lib, recipe = configs[name][:2]
    return f"torchao-{parse_recipe(recipe)[0]}" if lib == "fp8func" else None


def compare(rows: list[dict], configs: dict = CONFIGS) -> None:
    """Adds ``vs_bf16``, ``vs_torchao`` (its same recipe) and bf16's loss at the last step."""
    by = {r["config"]: r for r in rows}
    bf16 = by.get("bf16")
    for r in rows:
        r["vs_bf16"] = r["tokens_per_s"] / bf16["tokens_per_s"] if bf16 else None
        peer = by.get(torchao_peer(r["config"], configs))
        r["torchao_peer"] = peer["config"] if peer else None
        r["vs_torchao"] = r["tokens_per_s"] / peer["tokens_per_s"] if peer else None
        r["loss_step"], r["loss"] = len(r["losses"]) - 1, r["losses"][-1]
        r["bf16_loss"] = bf16["losses"][-1] if bf16 else None
        r["finite"] = all(math.isfinite(v) for v in r["losses"])


def environment(entry: str, argv: list[str], device) -> dict:
    """Device, versions, date and the command line, for the table's header and the JSON."""
    def version(pkg):
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    cuda = torch.device(device).type == "cuda"
    return {"command": " ".join(["python -m fp8func.bench", entry] + argv),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
            "cuda": str(torch.version.cuda), "torchao": version("torchao"), "transformers": version("transformers"),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def model_line(spec: dict) -> str:
    return (f"Llama {spec['layers']} layers, hidden {spec['hidden']}, MLP {spec['mlp']}, heads {spec['heads']}/"
            f"{spec['kv_heads']} kv, vocab {spec['vocab']}, seq {spec['seq']}, batch {spec['batch']} "
            f"({spec['batch'] * spec['seq']} tokens per step), sdpa attention")


def fmt(v, spec: str = ".2f", suffix: str = "") -> str:
    return "" if v is None else f"{v:{spec}}{suffix}"


def profile_table(rows: list[dict]) -> list[str]:
    cols = KERNEL_CLASSES + ("GPU total", "host")
    lines = ["", "GPU ms per step by kernel class (torch.profiler), and host ms per step:", "",
             "| config | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for r in rows:
        if "profile_ms" in r:
            lines.append(f"| {r['config']} | " + " | ".join(f"{r['profile_ms'][c]:.2f}" for c in cols) + " |")
    return lines


def table(rows: list[dict], env: dict, setup: str) -> str:
    lines = [" | ".join(f"{k}: {v}" for k, v in env.items()), "", setup, "",
             "| config | FP8 linears | ms/step | tokens/s | vs bf16 | vs torchao (same recipe) | compile s: "
             "step 0 / steps 1-4 | graphs | peak GiB | loss at last step | bf16 loss at last step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peer = f"{r['vs_torchao']:.2f}x ({r['torchao_peer']})" if r["vs_torchao"] else ""
        lines.append(f"| {r['config']} | {r['fp8_linears']}/{r['linears']} | {r['step_ms']:.2f} | "
                     f"{r['tokens_per_s']:.0f} | {fmt(r['vs_bf16'], '.2f', 'x')} | {peer} | "
                     f"{r['compile_s'][0]:.1f} / {sum(r['compile_s'][1:]):.1f} | {r['graphs']} | "
                     f"{fmt(r['peak_gib'], '.1f')} | {r['loss']:.5f} (step {r['loss_step']}) | "
                     f"{fmt(r['bf16_loss'], '.5f')} |")
    return "\n".join(lines + (profile_table(rows) if any("profile_ms" in r for r in rows) else [])
                     + (timeline_table(rows) if any("timeline" in r for r in rows) else []))


def add_common_args(p: argparse.ArgumentParser, configs: dict, default_model: str, default_configs: str,
                    compile_choices=("block", "model", "none")) -> None:
    p.add_argument("--model", choices=list(MODELS), default=default_model, help="model shape (tiny: CPU tests)")
    for key in MODELS["1b"]:
        p.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"override the model's {key}")
    p.add_argument("--configs", default=default_configs, help=f"comma list of {', '.join(configs)}")
    p.add_argument("--compile", choices=compile_choices, default="block",
                   help="; ".join(f"{c}: {COMPILED[c]}" for c in compile_choices))
    p.add_argument("--iters", type=int, default=10, help="timed steps per configuration (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the five compile steps")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--optimizer", choices=("adamw", "none"), default="adamw",
                   help="adamw: a step ends with AdamW's update; none: forward, loss, backward and zero_grad alone")
    p.add_argument("--fp8-lm-head", action="store_true", help="convert the lm_head too (default: it stays bf16)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", help="also write the environment and the rows to this JSON file")


def parse(p: argparse.ArgumentParser, argv: list[str], configs: dict) -> tuple[argparse.Namespace, dict, list[str]]:
    args = p.parse_args(argv)
    spec = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in MODELS[args.model].items()}
    names = args.configs.split(",")
    unknown = [n for n in names if n not in configs]
    if unknown:
        p.error(f"--configs: unknown {unknown}; choose from {', '.join(configs)}")
    if getattr(args, "profile", False) and torch.device(args.device).type != "cuda":
        p.error("--profile reads GPU kernel times: it needs --device cuda")
    if getattr(args, "timeline", False) and (torch.device(args.device).type != "cuda" or args.compile == "model"):
        p.error("--timeline marks each decoder layer with CUDA events from eager code: it needs --device cuda "
                "and --compile block or none")
    return args, spec, names


def write_json(path: str | None, env: dict, rows: list[dict], complete: bool, **extra) -> None:
    """The JSON of the run; written after every configuration too (``complete: false``), so that a
    run stopped by a time limit keeps the configurations it finished."""
    if path:
        with open(path, "w") as fh:
            json.dump({"environment": env, "complete": complete, **extra, "rows": rows}, fh, indent=1)


def run_all(run_one, names: list[str], path: str | None, env: dict) -> list[dict]:
    rows = []
    for name in names:
        rows.append(run_one(name))
        write_json(path, env, rows, False)
    return rows


def emit(text: str, env: dict, rows: list[dict], path: str | None, **extra) -> None:
    print(text)
    write_json(path, env, rows, True, **extra)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m fp8func.bench model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, CONFIGS, "1b", ",".join(CONFIGS))
    p.add_argument("--profile", action="store_true", help="GPU time of a step by kernel class (torch.profiler)")
    p.add_argument("--timeline", action="store_true",
                   help="host against GPU time of the layers' forward and backward, from CUDA events (no profiler)")
    args, spec, names = parse(p, argv, CONFIGS)
    env = environment("model", argv, args.device)
    prime(names, args.device)
    data = batches(spec, args.device)
    rows = run_all(lambda name: run_config(name, spec, args, data), names, args.json, env)
    compare(rows)
    setup = (f"{model_line(spec)}; bf16 parameters; {step_line(args)}; compile: {COMPILED[args.compile]}; "
             f"lm_head {'FP8' if args.fp8_lm_head else 'bf16'}; median of {args.iters} synchronized steps after "
             f"{COMPILE_STEPS} compile steps and {args.warmup} warm-up steps; "
             f"loss at step {len(rows[0]['losses']) - 1}.")
    emit(table(rows, env, setup), env, rows, args.json, setup=setup, model=spec)
    return rows
