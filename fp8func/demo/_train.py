"""``python -m fp8func.demo``: a small Llama trained on a public-domain book, bf16 and FP8 side by side,
and bf16 again with another seed to show how much two runs differ anyway."""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib.util
import logging
import math
import os
import platform
import sys
import time

import torch
from torch import nn

from .._autograd import linear
from .._scaling import NAMED_RECIPES, Recipe
from ..nn import Fp8Linear, convert, report, verify
from . import _plot, _report
from ._data import CORPUS, VOCAB, Batches, load_tokens

__all__ = ["main", "build_model"]


DEMO_PACKAGES = ("transformers", "matplotlib")  # the "demo" extra of pyproject.toml
_DESCRIPTION = """A small Llama trained on a public-domain book (bytes as tokens), bf16 and FP8 side by
side from the same init and batches, and bf16 again from other seeds to show how much two runs
differ anyway. Prints which layers ran FP8, a loss table and a verdict; writes a loss-curve PNG.
Needs transformers and matplotlib: pip install 'fp8func[demo]'."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fp8func.demo", description=_DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--recipe", default="tensorwise", type=_recipe_name, choices=tuple(NAMED_RECIPES),
                   help="fp8func recipe of the FP8 run")
    p.add_argument("--steps", type=_at_least(1), default=150, help="training steps of each run")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when a GPU is visible, else cpu")
    p.add_argument("--out", default="fp8_demo_loss.png", help="where to write the loss-curve PNG")
    p.add_argument("--seq", type=_at_least(2), default=64, help="tokens (bytes) per sequence")
    p.add_argument("--batch", type=_at_least(1), default=8, help="sequences per step")
    p.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate of AdamW")
    p.add_argument("--seed", type=int, default=0, help="init seed of the bf16 and fp8 runs, and the batch order")
    p.add_argument("--noise-seeds", type=_at_least(0), default=1,
                   help="extra bf16 runs with the init seeds after --seed: the run-to-run noise band")
    p.add_argument("--threads", type=_at_least(0), default=0, help="CPU threads for torch (0: the idle cores, 1 to 4)")
    p.add_argument("--verbose", action="store_true", help="also print report(model), the full verify table and "
                                                          "the fp8func log")
    return p


def _recipe_name(name: str) -> str:
    if name not in NAMED_RECIPES:
        close = difflib.get_close_matches(name, NAMED_RECIPES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise argparse.ArgumentTypeError(f"unknown recipe {name!r}{hint}; choose from {', '.join(NAMED_RECIPES)}")
    return name


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}; give {low} or more")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{value} is not a positive finite number")
    return value


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, Batches]:
    """The arguments and the batches, checked before any work: a wrong flag exits 2 with its reason."""
    p = _parser()
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: cuda, but no CUDA device is visible; use --device cpu (or auto)")
    out = os.path.abspath(args.out)
    folder = os.path.dirname(out)
    if os.path.isdir(out):
        p.error(f"argument --out: {args.out} is a folder; give a file name such as "
                f"{os.path.join(args.out, 'loss.png')}")
    if not os.path.isdir(folder):
        p.error(f"argument --out: the folder {folder} does not exist; create it or write elsewhere")
    if not os.access(folder, os.W_OK):
        p.error(f"argument --out: the folder {folder} is not writable; write elsewhere")
    try:
        data = Batches(load_tokens(), steps=args.steps, batch=args.batch, seq=args.seq, seed=args.seed)
    except ValueError as e:
        p.error(f"argument --seq: {e}")
    try:  # a recipe's constraints on the tokens of a step (block-wise scales tile them in blocks of 128)
        x, w = torch.randn(args.batch * args.seq, 128, requires_grad=True), torch.randn(128, 128)
        linear(x, w, recipe=args.recipe).sum().backward()
    except ValueError as e:
        p.error(f"argument --recipe: {args.recipe} does not fit --batch {args.batch} x --seq {args.seq} = "
                f"{args.batch * args.seq} tokens per step: {e}")
    return args, data


def _missing_extra() -> str | None:
    """The line to print when the packages of the ``demo`` extra are not installed; None when they are."""
    missing = [name for name in DEMO_PACKAGES if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"python -m fp8func.demo needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not "
            "installed: pip install 'fp8func[demo]' (from a clone: pip install -e '.[demo]')")


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

    def __init__(self, name: str, kind: str, seed: int, model, lr: float, steps: int):
        self.name, self.kind, self.seed, self.model = name, kind, seed, model
        self.losses, self.seconds = [], 0.0
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
    def result(self, windows) -> _report.RunResult:
        held = sum(self.model(input_ids=w, labels=w).loss.item() for w in windows) / len(windows)
        return _report.RunResult(self.name, self.kind, self.seed, tuple(self.losses), held, self.seconds)


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _cores() -> int:
    """The cores this process may run on (its CPU affinity), which ``os.cpu_count`` overstates in a container."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def _auto_threads() -> tuple[int, str]:
    """The cores no other process keeps busy: cores minus the 1-minute load average, 1 to 4.

    The ops of this small model take microseconds, so with more threads than idle cores each op
    waits at its fork/join barrier for a descheduled thread, which on a busy machine makes a step
    10x slower or worse; and at this size more than 4 threads have little left to split."""
    cores = _cores()
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this platform: assume an idle machine
        return min(4, cores), f"of {cores} cores"
    return max(1, min(4, cores, round(cores - load))), f"of {cores} cores, load {load:.1f}"


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _header(args, device: torch.device, n_params: int, fp8, threads: str) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    linears = [m for m in fp8.modules() if isinstance(m, nn.Linear)]
    n_fp8 = sum(isinstance(m, Fp8Linear) for m in linears)
    noise = ", ".join(str(args.seed + i) for i in range(1, args.noise_seeds + 1))
    return (f"fp8func demo: bf16 vs FP8 ({args.recipe}) on {device} ({where}; {threads}), "
            f"torch {torch.__version__}\n"
            f"model: Llama, 4 layers, hidden 128, {n_params / 1e6:.2f}M params, bf16 weights; {n_fp8}/{len(linears)} "
            f"linear layers in FP8\n"
            f"data: {CORPUS} as bytes, {args.steps} steps x {args.batch} x {args.seq} tokens; runs: bf16 and fp8 from "
            f"seed {args.seed}" + (f", bf16 from seed {noise} (noise reference)" if noise else "")
            + "; same batches for all")


def _path_line(v, device: torch.device) -> str:
    if not v.ok:
        return f"FP8 path: NOT VERIFIED on {device} (see the FAILED rows above)"
    if device.type == "cpu":
        return "FP8 path: emulated on cpu (FP8 casts and numerics, fp32 GEMMs; no FP8 speedup on a CPU)"
    return f"FP8 path: hardware on {device} (aten::_scaled_mm ran {sum(r.scaled_mm for r in v.rows)} times in one step)"


def _runs(args, device: torch.device) -> list[_Run]:
    """bf16 and its FP8 copy (same init), then bf16 from other seeds: the first run is the reference."""
    bf16 = build_model(args.seq, args.seed, device)
    fp8 = convert(copy.deepcopy(bf16), Recipe.from_name(args.recipe), fsdp_fp8_all_gather=False)
    runs = [_Run("bf16", "bf16", args.seed, bf16, args.lr, args.steps),
            _Run("fp8", "fp8", args.seed, fp8, args.lr, args.steps)]
    for seed in range(args.seed + 1, args.seed + 1 + args.noise_seeds):
        model = build_model(args.seq, seed, device)
        runs.append(_Run(f"bf16 seed {seed}", "bf16", seed, model, args.lr, args.steps))
    return runs


def _train(args, runs: list[_Run], data: Batches, device: torch.device):
    """Trains every run on the same batches; the first FP8 step runs under ``verify``."""
    checks = []

    def verified(step_fn):  # which layers ran FP8 GEMMs, from the profile of a real training step
        checks.append(verify(runs[1].model, step_fn, print_table=False))
        return checks[0].output

    ids = data[0].to(device)
    for r in runs:  # step 1 warms up and runs the fp8 step under the profiler: not timed
        r.step(ids, through=verified if r.kind == "fp8" else None)
        r.seconds = 0.0
    bar = _report.progress(range(1, args.steps), args.steps, "training", initial=1)
    for i in bar:
        ids = data[i].to(device)
        for r in runs:
            r.step(ids)
        # shown with the count of steps done, when the bar moves past this step (not before it does)
        bar.set_postfix_str("  ".join(f"{r.name} {r.losses[-1]:.3f}" for r in runs), refresh=False)
    return checks[0]


def _results(args, runs: list[_Run], data: Batches, device: torch.device, check) -> list[_report.RunResult]:
    windows = [w.to(device) for w in data.held_out(args.batch)]
    results = [r.result(windows) for r in runs]
    print(check if args.verbose else _report.check_table(check))
    print(_path_line(check, device))
    print(_report.loss_table(results, sum(w.numel() for w in windows)))
    print(_report.verdict(results))
    if args.steps > 1:
        print("time per step (steps 2 on): " + ", ".join(
            f"{r.name} {1000 * r.seconds / (args.steps - 1):.1f} ms" for r in results))
    return results


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns 0, or 1 when the FP8 check failed (see the verify table).

    Wrong arguments exit 2 with the reason (argparse), and missing packages exit 1 with the extra
    that installs them, before any work."""
    args, data = _parse(argv)
    missing = _missing_extra()
    if missing:
        print(missing, file=sys.stderr)
        return 1
    device = _device(args.device)
    log, threads = logging.getLogger("fp8func"), torch.get_num_threads()
    handler, level = logging.StreamHandler(sys.stdout), log.level
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO if args.verbose else logging.WARNING)
    try:
        n, why = (args.threads, "--threads") if args.threads else _auto_threads()
        torch.set_num_threads(n)
        start = time.perf_counter()
        runs = _runs(args, device)
        print(_header(args, device, sum(p.numel() for p in runs[0].model.parameters()), runs[1].model,
                      f"{n} CPU thread{'s' if n > 1 else ''} ({why})"), flush=True)
        if args.verbose:
            report(runs[1].model)
        check = _train(args, runs, data, device)
        results = _results(args, runs, data, device, check)
        title = (f"fp8func demo: {args.recipe} vs bf16, Llama 4x128 on {CORPUS}, {args.steps} steps x "
                 f"{args.batch}x{args.seq}, {device}")
        _plot.plot(args.out, results, title)
        print(f"loss curves: {os.path.abspath(args.out)}; total {time.perf_counter() - start:.1f} s")
    finally:
        torch.set_num_threads(threads)
        log.removeHandler(handler)
        log.setLevel(level)
    return 0 if check.ok else 1
