"""The FSDP2 report's own ``Trainer`` script, with fp8func's one line in place of torchao's.

The user of the torchao report this project answers builds an HF model in bf16 from its config,
converts it in one line, wraps it in ``torch.compile`` and hands it to ``Trainer`` with FSDP2 and
these ``fsdp_config`` keys (``REPORT_FSDP_CONFIG``)::

    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    f8.convert(model, "tensorwise")          # the report: convert_to_float8_training(model, config=...)
    model = torch.compile(model)
    args = TrainingArguments(..., bf16=True, remove_unused_columns=False,
                             fsdp="full_shard auto_wrap", fsdp_config=REPORT_FSDP_CONFIG)
    Trainer(model=model, args=args, train_dataset=data, data_collator=...).train()

Nothing else: no callback, no ``precompute_scales`` call (every optimizer step precomputes the
FSDP2 fp8 weight scales by itself), no fp32 model. The flags vary what the report fixed:
``--model-dtype fp32``, ``--no-loading-keys`` (drop ``fsdp_cpu_ram_efficient_loading`` and
``fsdp_sync_module_states``), ``--compile trainer`` (``TrainingArguments(torch_compile=True)``)
or ``none``, ``--callback`` (``fp8func.hf.Fp8Callback`` instead of the convert line), the recipe
(``bf16`` trains unconverted; ``torchao`` runs the report's own torchao line). ``--fp8-all-gather
both`` trains twice, on and off, and requires bitwise the same losses, gradient norms and trained
weights; ``--repeat N`` trains each configuration N times in the same process (with ``both``:
on, off, off, on, on, off, ...: each pair in both orders, so neither mode always runs first or
later in a pair), which compares their speeds with less of the spread between processes, and
prints the on/off ratio of each pair;
``--phases`` (GPUs) prints each part of a step's host and GPU milliseconds (forward, backward,
the ``Trainer``'s read-back and clipping, optimizer step), from CUDA events: where the GPU takes
as long as the host and falls no further behind, the host bounds the step.
Each run logs the loss every ``--logging-steps`` steps (every step by default, for that
check; the report logs every 10) and reports its speed: the median step after ``--warmup``, timed
on the GPU's stream without a sync of its own, and the mean step with the full garbage collections
of Python those steps ran (a collection visits every object of the process: the GPU waits).

CPU (gloo, tiny model, about 20 s on 2 cores)::

    torchrun --nproc-per-node 2 examples/hf_trainer_report.py --device cpu --fp8-all-gather both

GPUs (the report's setup at the Qwen3-1.7B shape)::

    torchrun --nproc-per-node 2 examples/hf_trainer_report.py --device cuda --recipe tensorwise \\
        --hidden 2048 --intermediate 6144 --layers 28 --heads 16 --kv-heads 8 --vocab 151936 \\
        --seq 2048 --batch 2 --steps 30 --warmup 10 --logging-steps 10 --fp8-all-gather both

On CPU processes accelerate drops the FSDP plugin (it keeps it for GPUs only):
``fp8func.hf.keep_fsdp2_on_cpu`` keeps it there (nothing changes on GPUs). CI runs ``worker``
over the combinations (tests/test_hf_trainer_report.py).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8func as f8  # noqa: E402
import fp8func.hf  # noqa: E402,F401
from _common import add_model_args, config_kwargs, model_line  # noqa: E402
from fp8func.demo._data import load_tokens  # noqa: E402

REPORT_FSDP_CONFIG = {
    "fsdp_version": 2,
    "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
    "fsdp_transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"],
    "fsdp_backward_prefetch": "BACKWARD_PRE",
    "fsdp_forward_prefetch": False,
    "fsdp_use_orig_params": True,
    "fsdp_cpu_ram_efficient_loading": True,
    "fsdp_sync_module_states": True,
}
LOADING_KEYS = ("fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states")
RECIPES = ("tensorwise", "rowwise", "delayed", "bf16", "torchao")
CPU_DEFAULTS = dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=4, vocab=256, seq=64, batch=2,
                    steps=6, lr=1e-3)


def parse_args(argv=None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = pre.parse_known_args(argv)[0].device
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_model_args(p, seq=512, batch=4)
    p.set_defaults(lr=5e-5)
    if device == "cpu":
        p.set_defaults(**CPU_DEFAULTS)
    p.add_argument("--recipe", default="tensorwise", choices=RECIPES,
                   help="fp8func recipe; bf16: no conversion; torchao: the report's convert_to_float8_training line")
    p.add_argument("--model-dtype", default="bf16", choices=("bf16", "fp32"), help="dtype the model is built in")
    p.add_argument("--no-loading-keys", action="store_true",
                   help="drop fsdp_cpu_ram_efficient_loading and fsdp_sync_module_states from the report's fsdp_config")
    p.add_argument("--compile", default="model", choices=("model", "trainer", "none"),
                   help="model: torch.compile(model) before the Trainer (the report); trainer: "
                        "TrainingArguments(torch_compile=True); none: eager")
    p.add_argument("--callback", action="store_true", help="fp8func.hf.Fp8Callback(recipe) instead of the convert line")
    p.add_argument("--fp8-all-gather", default="on", choices=("on", "off", "both"),
                   help="both: train with the fp8 all-gather on, then off, and require bitwise the same numbers")
    p.add_argument("--repeat", type=int, default=1,
                   help="train each configuration this many times in one process; with --fp8-all-gather both, "
                        "in pairs of both orders (on, off, off, on, on, off, ...) and the on/off ratio of each pair: "
                        "runs of one process share its CPUs, so their speeds compare more closely than those of "
                        "separate processes")
    p.add_argument("--no-auto-precompute", action="store_true",
                   help="leave the weight scales to FSDP2's hooks "
                        "(fp8func.distributed.precompute_after_optimizer_step(False))")
    p.add_argument("--warmup", type=int, default=2,
                   help="the speed is the median of the steps after step warmup + 1")
    p.add_argument("--logging-steps", type=int, default=1,
                   help="TrainingArguments(logging_steps=...): 1 records every step's loss for the on/off "
                        "check; the report logs every 10 (each log reads the loss back: a sync)")
    p.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    p.add_argument("--phases", action="store_true",
                   help="host and GPU milliseconds of each part of a step (forward, backward, the Trainer's "
                        "read-back and clipping, optimizer step, the rest), from CUDA events and the host's clock "
                        "at their boundaries: no profiler, so no host time added")
    p.add_argument("--profile", action="store_true",
                   help="over two steps after warm-up: GPU time by kernel class, and where each rank's GPU waited "
                        "(for its host's launches or for a collective)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat} must be at least 1")
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    if args.profile and args.device != "cuda":
        p.error("--profile reads CUDA kernels: it needs --device cuda")
    if args.phases and args.device != "cuda":
        p.error("--phases reads CUDA events: it needs --device cuda")
    if args.recipe in ("bf16", "torchao") and (args.callback or args.fp8_all_gather == "both"):
        p.error(f"--recipe {args.recipe}: --callback and --fp8-all-gather both are fp8func's")
    return args


def text_dataset(n: int, seq: int) -> list[dict[str, torch.Tensor]]:
    """``n`` consecutive ``seq``-byte windows of the demo's book (token = byte; labels = inputs),
    from its start again where the book is shorter than ``n * seq`` bytes."""
    tokens = load_tokens()
    tokens = tokens.repeat(-(-n * seq // len(tokens)))[:n * seq]
    return [{"input_ids": w} for w in tokens.view(n, seq)]


def collate(rows):
    """The report's data_collator: inputs and labels, the same ids."""
    ids = torch.stack([r["input_ids"] for r in rows])
    return {"input_ids": ids, "labels": ids.clone()}


def build_model(args):
    """The report's model: ``AutoModelForCausalLM.from_config`` in the given dtype, then its one
    conversion line (fp8func's, or torchao's for ``--recipe torchao``)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.model_dtype == "bf16" else torch.float32
    # Built on the GPU it trains on (the report builds it on the CPU: a slower random init of the
    # same tensors, which accelerate then moves or broadcasts the same way).
    with torch.device("cuda" if args.device == "cuda" else "cpu"):
        return AutoModelForCausalLM.from_config(Qwen3Config(**config_kwargs(args)), dtype=dtype)


def convert(model, args, fp8_all_gather: bool):
    if args.recipe == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=fp8_all_gather))
    elif args.recipe != "bf16" and not args.callback:
        f8.convert(model, args.recipe, fsdp_fp8_all_gather=fp8_all_gather)
    return model


def train(args, fp8_all_gather: bool, output_dir: str) -> dict:
    """One run of the report's script; returns its losses, gradient norms, speed, memory, the
    fp8 all-gather count and a checksum of this rank's trained weights."""
    from transformers import Trainer, TrainingArguments

    world = dist.get_world_size()
    model = convert(build_model(args), args, fp8_all_gather)
    if args.compile == "model":
        model = torch.compile(model)
    fsdp_config = {k: v for k, v in REPORT_FSDP_CONFIG.items() if not (args.no_loading_keys and k in LOADING_KEYS)}
    targs = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch, learning_rate=args.lr,
        weight_decay=0.01, logging_steps=args.logging_steps, save_strategy="no", report_to="none", disable_tqdm=True,
        log_level="error", remove_unused_columns=False, bf16=True, use_cpu=args.device == "cpu", seed=0,
        dataloader_num_workers=0, torch_compile=args.compile == "trainer",
        fsdp="full_shard auto_wrap", fsdp_config=fsdp_config)
    logged: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    marks: list = []  # the end of each step: a CUDA event on GPUs (no sync), the host's clock on CPUs
    profiled: dict = {}

    class Record(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            for k in logged:
                if logs and k in logs:
                    logged[k].append(float(logs[k]))

        def on_step_end(self, a, state, control, **kw):
            if args.device == "cuda":
                marks.append(torch.cuda.Event(enable_timing=True))
                marks[-1].record()
            else:
                marks.append(time.perf_counter())

    callbacks = [Record()]
    if args.callback:
        callbacks.insert(0, f8.hf.Fp8Callback(args.recipe, fsdp_fp8_all_gather=fp8_all_gather))
    if args.profile:
        callbacks.append(_Profiler(args.warmup, profiled))
    data = text_dataset(args.steps * args.batch * world, args.seq)
    phases = _Phases() if args.phases else None
    if phases is not None:
        callbacks.append(phases)
    trainer = (Trainer if phases is None else phases.trainer(Trainer))(
        model=model, args=targs, train_dataset=data, data_collator=collate, callbacks=callbacks)
    f8.hf.keep_fsdp2_on_cpu(trainer)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    gathers = []
    with f8.nn.observe_all_gathers(lambda *a: gathers.append(1)), _full_collections(marks, args.warmup) as collections:
        trainer.train()
    if args.device == "cuda":
        torch.cuda.synchronize()
        steps = [a.elapsed_time(b) / 1e3 for a, b in zip(marks[args.warmup:-1], marks[args.warmup + 1:])]
    else:
        steps = [b - a for a, b in zip(marks[args.warmup:-1], marks[args.warmup + 1:])]
    step_s = statistics.median(steps) if steps else float("nan")
    mean_s = statistics.fmean(steps) if steps else float("nan")
    checksum = sum(float((p.to_local() if isinstance(p, DTensor) else p).detach().double().sum())
                   for p in trainer.model.parameters())
    return {**logged, "fp8_gathers": len(gathers), "param_checksum": checksum, "step_ms": step_s * 1e3,
            "mean_step_ms": mean_s * 1e3, "steps_ms": [t * 1e3 for t in steps],
            "full_collections": collections[0], "full_collection_ms": collections[1] * 1e3,
            "tokens_per_s": args.batch * args.seq * world / step_s,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else float("nan"),
            "profile": profiled, "phases": phases.summary(args.warmup) if phases is not None else {}}


SPEED_KEYS = ("step_ms", "mean_step_ms", "tokens_per_s", "full_collections", "full_collection_ms", "peak_gib")
"""What ``run`` lists for every run of a mode (``repeats``)."""


@contextlib.contextmanager
def _full_collections(marks: list, warmup: int):
    """Counts Python's full garbage collections (generation 2: every tracked object of the process
    is visited, the GPU waits for the host meanwhile) and their time, after ``warmup`` steps
    (``marks`` holds one entry per finished step); yields ``[count, seconds]``, filled in as they run."""
    out, started = [0, 0.0], [0.0]

    def callback(phase, info):
        if info["generation"] != 2 or len(marks) < warmup:
            return
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            out[0] += 1
            out[1] += time.perf_counter() - started[0]

    gc.callbacks.append(callback)
    try:
        yield out
    finally:
        gc.callbacks.remove(callback)


class _Phases(TrainerCallback):
    """Marks every step's parts with a CUDA event and the host's clock (``fp8func.bench._timeline``'s
    marks): the step's start, the forward's start and end (the loss), the end of the backward's
    launches, the optimizer step's start (after the ``Trainer`` reads the loss back and clips the
    gradients) and end, the step's end. Per part, the host's and the GPU's milliseconds between its
    marks, and how much further the GPU is behind the host at its end than at the step's start
    (work queued in it); a part whose GPU time matches its host time, the GPU no further behind,
    waited for the host. With ``--repeat``, of the first run of each configuration."""

    PARTS = ("data", "forward", "backward", "read-back + clip", "optimizer", "rest")

    def __init__(self):
        from fp8func.bench._timeline import _Marks

        self.steps: list = []
        self._new = _Marks

    def trainer(self, base):
        """``base`` (``transformers.Trainer``) with marks around the forward and the backward."""
        phases = self

        class Marked(base):
            def compute_loss(self, *a, **kw):
                phases.add("forward")
                out = super().compute_loss(*a, **kw)
                phases.add("loss")
                return out

            def training_step(self, *a, **kw):
                out = super().training_step(*a, **kw)
                phases.add("backward")
                return out

        return Marked

    def add(self, name: str) -> None:
        if self.steps:
            self.steps[-1].add(name)

    def on_step_begin(self, args, state, control, **kw):
        self.steps.append(self._new())
        self.add("step")

    def on_pre_optimizer_step(self, args, state, control, **kw):
        self.add("optimizer")

    def on_optimizer_step(self, args, state, control, **kw):
        self.add("optimized")

    def on_step_end(self, args, state, control, **kw):
        self.add("end")

    def summary(self, warmup: int) -> dict:
        """Per part: host ms, GPU ms and ``lag_ms`` (how much further the GPU is behind the host at
        the part's end than at the step's start), medians over the steps after ``warmup``; call
        after synchronizing."""
        names = ("step", "forward", "loss", "backward", "optimizer", "optimized", "end")
        timed = [marks.read() for marks in self.steps[warmup:]]
        rows = [read for read in timed if [n for n, _, _ in read] == list(names)]
        if len(rows) < len(timed):  # a step whose marks are not all there (none expected): said, left out
            print(f"--phases: {len(timed) - len(rows)} of {len(timed)} timed steps lack a mark of "
                  f"{list(names)}; left out of the parts' medians", file=sys.stderr)
        if not rows:
            return {}
        out = {}
        for i, part in enumerate(self.PARTS):
            host = [r[i + 1][1] - r[i][1] for r in rows]
            gpu = [r[i + 1][2] - r[i][2] for r in rows]
            lag = [r[i + 1][2] - r[i + 1][1] for r in rows]  # the first mark is (0, 0)
            out[part] = {k: statistics.median(v) for k, v in (("host_ms", host), ("gpu_ms", gpu), ("lag_ms", lag))}
        return out


class _Profiler(TrainerCallback):
    """Over the two steps after ``warmup`` (a ``TrainerCallback``): GPU time per step by kernel
    class (``fp8func.bench``'s classes, NCCL collectives by kind), and where this rank's GPU
    stood idle, waiting for its host's launches or for a collective
    (``fp8func.bench._timeline.gpu_waits``). Records CPU activity too, which adds host time."""

    def __init__(self, warmup: int, out: dict):
        self.warmup, self.out, self.prof, self.steps = warmup, out, None, 2

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.warmup:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()

    def on_step_end(self, args, state, control, **kw):
        if self.prof is None or state.global_step != self.warmup + self.steps:
            return
        torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        from fp8func.bench._timeline import step_profile

        self.out.update(step_profile(self.prof, self.steps))
        self.prof = None


def check(result: dict, args, fp8_all_gather: bool) -> None:
    if len(result["loss"]) != args.steps // args.logging_steps or not all(math.isfinite(x) for x in result["loss"]):
        raise RuntimeError(f"expected {args.steps // args.logging_steps} finite losses, got {result['loss']}")
    fp8 = args.recipe not in ("bf16", "torchao") and fp8_all_gather and args.recipe != "delayed"
    if fp8 != (result["fp8_gathers"] > 0):
        raise RuntimeError(f"fp8 all-gather {'on' if fp8_all_gather else 'off'} ({args.recipe}), yet "
                           f"{result['fp8_gathers']} fp8 all-gathers ran.")


def run(args, output_dir: str) -> dict[str, dict]:
    """The runs ``--fp8-all-gather`` asks for (``--repeat`` times each; with ``both``, in pairs of
    both orders: ``run_order``), checked; with ``both``, on == off bitwise. The first run of each
    mode is its result; its ``repeats`` list the speed of every run of that mode, in order."""
    if args.deterministic:  # cuBLAS reads its workspace setting when its handle is made, at the first GEMM
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    previous = f8.distributed.precompute_after_optimizer_step(not args.no_auto_precompute)
    try:
        modes = [on for i in range(args.repeat) for on in run_order(args.fp8_all_gather, i)]
        results = {}
        for on in modes:
            r = train(args, on, output_dir)
            check(r, args, on)
            first = results.setdefault("on" if on else "off", r)
            first.setdefault("repeats", []).append({k: r[k] for k in SPEED_KEYS})
            differ = [k for k in ("loss", "grad_norm", "param_checksum") if r[k] != first[k]]
            if differ and (args.device == "cpu" or args.deterministic):  # nothing may carry over from run to run
                raise RuntimeError(f"fp8 all-gather {'on' if on else 'off'}: run {len(first['repeats'])} of this "
                                   f"process differs from its first in {differ}: losses {r['loss']} vs {first['loss']}")
    finally:
        f8.distributed.precompute_after_optimizer_step(previous)
    if len(results) == 2:
        on, off = results["on"], results["off"]
        differ = [k for k in ("loss", "grad_norm", "param_checksum") if on[k] != off[k]]
        on["bitwise_off"] = not differ
        # Bitwise where every kernel is: on CPU, and on GPUs in deterministic mode (elsewhere cuBLAS /
        # attention kernels may sum in another order from one run to the next, on or off alike).
        if differ and (args.device == "cpu" or args.deterministic):
            raise RuntimeError(f"fp8 all-gather on/off differ in {differ}: losses {on['loss']} vs {off['loss']}")
    return results


def run_order(fp8_all_gather: str, i: int) -> tuple[bool, ...]:
    """The fp8 all-gather settings of round ``i`` of ``--repeat``: with ``both``, on then off in
    even rounds and off then on in odd ones (a drift of the machine's speed through the process,
    or a cost of following the other mode, falls on both modes alike over every two rounds)."""
    if fp8_all_gather != "both":
        return (fp8_all_gather == "on",)
    return (True, False) if i % 2 == 0 else (False, True)


def pair_ratios(results: dict) -> list[float]:
    """The on/off ratio of the median steps of each round of ``--fp8-all-gather both --repeat``
    (on's speed over off's: above 1, on is faster), in round order."""
    on, off = results["on"]["repeats"], results["off"]["repeats"]
    return [b["step_ms"] / a["step_ms"] for a, b in zip(on, off)]


def worker(rank: int, world_size: int, argv: list[str]) -> dict[str, dict]:
    """For ``tests.dist_harness.run_workers``: the checked runs in an initialised process group."""
    for k, v in (("RANK", rank), ("WORLD_SIZE", world_size), ("LOCAL_RANK", rank), ("LOCAL_WORLD_SIZE", world_size)):
        os.environ[k] = str(v)  # accelerate reads the rank layout from the environment (torchrun sets it)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    out = [None]
    if rank == 0:
        import tempfile

        out = [tempfile.mkdtemp()]
    dist.broadcast_object_list(out, src=0)
    return run(parse_args(argv), out[0])


def main(argv=None) -> None:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    say(model_line(args) + f", recipe {args.recipe}, model built in {args.model_dtype}, "
        f"{'without' if args.no_loading_keys else 'with'} the loading keys, compile {args.compile}"
        + (", Fp8Callback" if args.callback else "") + f", {args.device}")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        results = run(args, tmp)
    for mode, r in results.items():
        say(f"fp8 all-gather {mode}: losses {' '.join(f'{x:.4f}' for x in r['loss'])}")
        say(f"fp8 all-gather {mode}: {r['step_ms']:.1f} ms/step, {r['tokens_per_s']:.0f} tokens/s, peak "
            f"{r['peak_gib']:.1f} GiB, {r['fp8_gathers']} fp8 all-gathers; mean step {r['mean_step_ms']:.1f} ms, "
            f"{r['full_collections']} full garbage collections ({r['full_collection_ms']:.0f} ms)")
        if len(r["repeats"]) > 1:
            say(f"fp8 all-gather {mode}, every run in order: ms/step (median) "
                + ", ".join(f"{x['step_ms']:.1f}" for x in r["repeats"]) + "; mean "
                + ", ".join(f"{x['mean_step_ms']:.1f}" for x in r["repeats"]) + "; full garbage collections "
                + ", ".join(str(x["full_collections"]) for x in r["repeats"]) + "; peak GiB "
                + ", ".join(f"{x['peak_gib']:.1f}" for x in r["repeats"]))
        for part, v in r["phases"].items():
            say(f"    {part:18s} host {v['host_ms']:7.1f} ms  GPU {v['gpu_ms']:7.1f} ms  GPU behind the host at "
                f"its end by {v['lag_ms']:+7.1f} ms more than at the step's start")
        for kind, (ms, calls) in sorted(r["profile"].get("classes", {}).items(), key=lambda kv: -kv[1][0]):
            say(f"    {kind:24s} {ms:8.2f} ms/step  {calls:6.0f} kernels/step")
        waits = [None] * dist.get_world_size()
        dist.all_gather_object(waits, r["profile"].get("waits"))
        for rk, w in enumerate(waits):
            if w:
                say(f"    rank {rk}: {w['compute_kernels']:.0f} compute kernels/step, "
                    f"GPU busy {w['compute_busy_ms']:.1f} ms/step, "
                    f"idle waiting for the host {w['idle_host_ms']:.1f}, for a collective "
                    f"{w['idle_dependency_ms']:.1f}; host waiting for the GPU {w['host_sync_ms']:.1f}, NCCL exposed "
                    f"{w['nccl_exposed_ms']:.1f} (profiled step {w['span_ms']:.1f} ms)")
    if len(results) == 2 and len(results["on"]["repeats"]) > 1:
        ratios = pair_ratios(results)
        say("fp8 all-gather on / off speed, each round (on's pace over off's): "
            + ", ".join(f"{x:.3f}" for x in ratios) + f"; median {statistics.median(ratios):.3f}, "
            f"on faster in {sum(x > 1 for x in ratios)} of {len(ratios)}")
    if len(results) == 2:
        same = results["on"]["bitwise_off"]
        say(f"fp8 all-gather on vs off: losses, gradient norms and trained weights {'' if same else 'not '}bitwise "
            f"identical{'' if same else ' (non-deterministic kernels: run with --deterministic)'}")
    if args.json and rank == 0:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "torch": torch.__version__,
                       "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                       "results": results}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
