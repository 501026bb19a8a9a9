"""``python -m fp8func.demo``: a small Llama trained on a public-domain book, bf16 and FP8 side by side."""

from __future__ import annotations

import argparse
import copy
import datetime
import logging
import math
import os
import platform
import sys
import time

import torch

from .._scaling import Recipe
from ..nn import convert, report
from ..nn._verify import verify
from . import _report
from ._data import CORPUS, VOCAB, Batches, load_tokens

__all__ = ["main", "build_model"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fp8func.demo", description=__doc__)
    p.add_argument("--recipe", default="tensorwise", help="fp8func recipe name (tensorwise, rowwise, ...)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--device", default="auto", help="auto (cuda when present, else cpu), cpu or cuda")
    p.add_argument("--out", default="fp8_demo_loss.png", help="where to write the loss-curve PNG")
    p.add_argument("--seq", type=int, default=128, help="tokens (bytes) per sequence")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    return p


def build_model(seq: int, seed: int = 0, device: str = "cpu"):
    """A 4-layer Llama (hidden 128, MLP 384, 2 heads of 64) over bytes, in bf16; no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=seq, tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)


class _Run:
    """One model, its optimizer and schedule (warmup 10%, cosine to 10%), its losses and time."""

    def __init__(self, name: str, model, lr: float, steps: int):
        self.name, self.model, self.losses, self.seconds = name, model, [], 0.0
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
        warmup = max(1, steps // 10)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(
            (s + 1) / warmup, 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / steps)))))

    def loss(self, ids):
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    def step(self, ids, through=None):
        """One training step; ``through(step_fn)`` runs the forward + backward (``verify``)."""
        t = time.perf_counter()
        loss = through(lambda: self.loss(ids)) if through else self.loss(ids)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        self.losses.append(loss.item())  # syncs the device: the time below is the step's
        self.seconds += time.perf_counter() - t

    @torch.no_grad()
    def held_out(self, windows) -> float:
        return sum(self.model(input_ids=w, labels=w).loss.item() for w in windows) / len(windows)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA device is visible; use --device cpu (or auto).")
    return device


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _header(args, device: torch.device, data: Batches, n_params: int) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return (f"fp8func demo | {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} | torch "
            f"{torch.__version__} | device {device} ({where}; {torch.get_num_threads()} CPU threads)\n"
            f"model: Llama, 4 layers, hidden 128, MLP 384, {n_params / 1e6:.2f}M params, bf16 weights, byte-level "
            f"tokens (vocab {VOCAB})\n"
            f"data: {CORPUS} ({len(data.train) + len(data.val):,} bytes; {len(data.val):,} held out), {args.steps} "
            f"steps x {args.batch} x {args.seq} tokens, same init and batch order for bf16 and fp8")


def _path_line(v, device: torch.device) -> str:
    if not v.ok:
        return f"FP8 path: NOT VERIFIED on {device} -- {v.summary}"
    if device.type == "cpu":
        return ("FP8 path: emulated on cpu (gemm_path -> 'emulated': FP8 casts and numerics, fp32 GEMMs; "
                "no FP8 speedup on a CPU)")
    return f"FP8 path: hardware on {device} (aten::_scaled_mm ran {sum(r.scaled_mm for r in v.rows)} times in one step)"


def _train(args, device: torch.device, data: Batches):
    bf16 = build_model(args.seq, args.seed, device)
    print(_header(args, device, data, sum(p.numel() for p in bf16.parameters())), flush=True)
    fp8 = convert(copy.deepcopy(bf16), Recipe.from_name(args.recipe), fsdp_fp8_all_gather=False)
    report(fp8)
    runs = [_Run("bf16", bf16, args.lr, args.steps), _Run("fp8", fp8, args.lr, args.steps)]
    checks = []

    def verified(step_fn):  # the first fp8 step runs under the profiler: which layers ran FP8 GEMMs
        checks.append(verify(fp8, step_fn, print_table=False))
        return checks[0].output

    ids = data[0].to(device)
    runs[0].step(ids)
    runs[1].step(ids, through=verified)
    print(f"{checks[0]}\n{_path_line(checks[0], device)}", flush=True)
    for r in runs:
        r.seconds = 0.0  # step 1 (warm-up, profiler) is not timed
    bar = _report.progress(range(1, args.steps), args.steps - 1, f"training bf16 + fp8 ({args.recipe})")
    for i in bar:
        ids = data[i].to(device)
        for r in runs:
            r.step(ids)
        bar.set_postfix_str(f"bf16 {runs[0].losses[-1]:.3f}  fp8 {runs[1].losses[-1]:.3f}")
    return runs, checks[0]


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns 0, or 1 when the FP8 check failed (see the verify table)."""
    args = _parser().parse_args(argv)
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: expected at least 1.")
    device = _device(args.device)
    log = logging.getLogger("fp8func")
    handler, level = logging.StreamHandler(sys.stdout), log.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        data = Batches(load_tokens(), steps=args.steps, batch=args.batch, seq=args.seq, seed=args.seed)
        start = time.perf_counter()
        runs, checked = _train(args, device, data)
        windows = [w.to(device) for w in data.held_out(args.batch)]
        held = tuple(r.held_out(windows) for r in runs)
        print(_report.loss_table(runs[0].losses, runs[1].losses, held, sum(w.numel() for w in windows)))
        timed, tokens = args.steps - 1, args.batch * args.seq
        for r in runs[:timed and 2]:
            print(f"{r.name}: {1000 * r.seconds / timed:.1f} ms/step, {tokens * timed / r.seconds:,.0f} tokens/s "
                  f"(steps 2-{args.steps}, {device})")
        title = (f"fp8func demo: {args.recipe} vs bf16, Llama 4x128 on {CORPUS}, {args.steps} steps x "
                 f"{args.batch}x{args.seq}, {device}")
        _report.plot(args.out, runs[0].losses, runs[1].losses, title)
        print(f"loss curves: {os.path.abspath(args.out)}")
        print(f"total {time.perf_counter() - start:.1f} s; {_path_line(checked, device)}")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return 0 if checked.ok else 1
