"""HF ``Trainer`` + FSDP2 (accelerate) on a Qwen3 trained in FP8 through ``fp8func.hf.Fp8Callback``.

The setup of the torchao report this project answers: an HF model built from a config (no
download), ``transformers.Trainer`` with FSDP2 (``fsdp_version: 2``), bf16 mixed precision and
optionally ``torch.compile``, trained here on real text (the bytes of the demo's public-domain
book, vocab 256). fp8func adds one callback and the FSDP2 plan::

    args = TrainingArguments(..., bf16=True, fsdp=True, fsdp_config=f8.hf.fsdp2_config(model))
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[f8.hf.Fp8Callback(recipe)])

Checks, each raising if it fails: the fp8 all-gather ran (counted with
``fp8func.nn.observe_all_gathers``); with ``--resume-at K`` the run saves a checkpoint at step K
(``save_strategy="steps"``) and a second ``Trainer`` resumed from it
(``trainer.train(resume_from_checkpoint=...)``) logs bitwise the losses of the uninterrupted run;
with ``--compare`` a run with ``fsdp_fp8_all_gather=False`` gives bitwise the same losses,
gradient norms and weights: turning the fp8 all-gather on changes no number.

CPU (gloo, tiny model; about 15 s on 2 cores)::

    torchrun --nproc-per-node 2 examples/hf_trainer_fsdp2.py --device cpu --steps 8 --resume-at 4 --compare

GPUs (NCCL; a Qwen3-1.7B-sized model; FP8 GEMMs need sm89+)::

    torchrun --nproc-per-node 8 examples/hf_trainer_fsdp2.py --device cuda --steps 200 \\
        --hidden 2048 --intermediate 6144 --layers 28 --heads 16 --kv-heads 8 \\
        --seq 2048 --batch 2 --recipe tensorwise --compile --resume-at 100 --compare

On CPU processes accelerate drops the FSDP plugin (it keeps it for GPUs only):
``fp8func.hf.keep_fsdp2_on_cpu(trainer)`` keeps it there (a no-op on GPUs). Only the CPU command
runs in CI (tests/test_hf_trainer.py runs ``worker`` CI-sized).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8func as f8  # noqa: E402
import fp8func.hf  # noqa: E402,F401
from _common import add_model_args, build_qwen3, model_line  # noqa: E402
from fp8func.demo._data import load_tokens  # noqa: E402

CPU_DEFAULTS = dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=4, seq=64, batch=2, steps=8, lr=3e-3)


def parse_args(argv=None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = pre.parse_known_args(argv)[0].device
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p, seq=2048, batch=4)
    if device == "cpu":
        p.set_defaults(**CPU_DEFAULTS)
    p.set_defaults(vocab=256)  # byte-level text: token = byte value
    p.add_argument("--recipe", default="tensorwise", help="fp8func recipe (tensorwise, rowwise, blockwise, delayed)")
    p.add_argument("--compile", action="store_true", help="TrainingArguments(torch_compile=True)")
    p.add_argument("--resume-at", type=int, help="save at this step, resume from it, require bitwise the same losses")
    p.add_argument("--compare", action="store_true", help="train with fsdp_fp8_all_gather=False too; require bitwise")
    p.add_argument("--output-dir", help="Trainer output_dir (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device!r}: expected 'cpu' or 'cuda'.")
    return args


def text_dataset(n: int, seq: int) -> list[dict[str, torch.Tensor]]:
    """``n`` consecutive ``seq``-byte windows of the demo's book (labels = inputs; the model shifts them)."""
    tokens = load_tokens()
    if n * seq > len(tokens):
        raise ValueError(f"{n} windows of {seq} bytes exceed the corpus ({len(tokens)} bytes); fewer steps or --seq.")
    return [{"input_ids": w, "labels": w.clone()} for w in tokens[:n * seq].view(n, seq)]


def train(args, fp8_all_gather: bool, output_dir: str, *, save_at: int | None = None, resume: str | None = None):
    """One Trainer run; returns the logged losses and gradient norms, the fp8 all-gather count and a
    checksum of this rank's trained weights."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    model = build_qwen3(args, "cpu", torch.float32)  # fp32 masters; bf16 compute through FSDP2's policy
    targs = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch, learning_rate=args.lr,
        weight_decay=0.01, lr_scheduler_type="constant", logging_steps=1, report_to=[], disable_tqdm=True,
        bf16=True, use_cpu=args.device == "cpu", seed=0, dataloader_num_workers=0, torch_compile=args.compile,
        save_strategy="steps" if save_at else "no", save_steps=save_at or 500,
        fsdp=True, fsdp_config=f8.hf.fsdp2_config(model))
    logged: dict[str, list[float]] = {"loss": [], "grad_norm": []}

    class Log(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            for k in logged:
                if logs and k in logs:
                    logged[k].append(float(logs[k]))

    data = text_dataset(args.steps * args.batch * world, args.seq)
    trainer = Trainer(model=model, args=targs, train_dataset=data,
                      callbacks=[f8.hf.Fp8Callback(args.recipe, fsdp_fp8_all_gather=fp8_all_gather), Log()])
    if args.device == "cpu":
        f8.hf.keep_fsdp2_on_cpu(trainer)
    gathers = []
    with f8.nn.observe_all_gathers(lambda *a: gathers.append(1)):
        trainer.train(resume_from_checkpoint=resume)
    checksum = sum(float((p.to_local() if isinstance(p, DTensor) else p).detach().double().sum())
                   for p in trainer.model.parameters())
    return {**logged, "fp8_gathers": len(gathers), "param_checksum": checksum}


def check(result: dict, fp8_all_gather: bool, steps: int) -> None:
    if len(result["loss"]) != steps or not all(math.isfinite(x) for x in result["loss"]):
        raise RuntimeError(f"expected {steps} finite losses, got {result['loss']}")
    if fp8_all_gather != (result["fp8_gathers"] > 0):
        raise RuntimeError(f"fsdp_fp8_all_gather={fp8_all_gather}, yet {result['fp8_gathers']} fp8 all-gathers ran.")


def run(args, fp8_all_gather: bool, output_dir: str) -> dict:
    """The run (saving at ``--resume-at``), and the run resumed from that checkpoint; checked."""
    result = train(args, fp8_all_gather, output_dir, save_at=args.resume_at)
    check(result, fp8_all_gather, args.steps)
    if args.resume_at:
        ckpt = os.path.join(output_dir, f"checkpoint-{args.resume_at}")
        resumed = train(args, fp8_all_gather, output_dir, save_at=args.resume_at, resume=ckpt)
        check(resumed, fp8_all_gather, args.steps - args.resume_at)
        if resumed["loss"] != result["loss"][args.resume_at:]:
            raise RuntimeError(f"resumed from {ckpt}: losses {resumed['loss']} != {result['loss'][args.resume_at:]}")
        result["resumed"] = resumed
    return result


def worker(rank: int, world_size: int, argv: list[str], fp8_all_gather: bool) -> dict:
    """For ``tests.dist_harness.run_workers``: one checked run in an initialised process group."""
    _launch_env()
    args = parse_args(argv)
    with _shared_tmpdir() as tmp:
        return run(args, fp8_all_gather, tmp)


def _launch_env() -> None:
    """accelerate reads the rank layout from the environment (torchrun sets it); fill it in for a
    process group started otherwise (the test harness: gloo, file rendezvous)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for k, v in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank), ("LOCAL_WORLD_SIZE", world)):
        os.environ.setdefault(k, str(v))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")


@contextlib.contextmanager
def _shared_tmpdir():
    """A temporary directory of rank 0 that every rank uses (checkpoints are written by rank 0 and
    read by all), removed after every rank is done with it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = [tmp]
        dist.broadcast_object_list(out, src=0)
        try:
            yield out[0]
        finally:
            dist.barrier()


def main(argv=None) -> None:
    args = parse_args(argv)
    say = print if int(os.environ.get("RANK", "0")) == 0 else (lambda *a, **k: None)
    say(model_line(args) + f", recipe {args.recipe}, {args.device}, text: the demo's book")
    if not dist.is_initialized():  # torchrun: one process group, which accelerate then uses
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    results = {}
    for fp8_all_gather in [True] + ([False] if args.compare else []):
        with _shared_tmpdir() as tmp:
            results[fp8_all_gather] = r = run(args, fp8_all_gather, args.output_dir or tmp)
        for i, (loss, norm) in enumerate(zip(r["loss"], r["grad_norm"])):
            say(f"step {i + 1:4d}  loss {loss:.6f}  grad_norm {norm:.6f}  "
                f"(fp8 all-gather {'on' if fp8_all_gather else 'off'})")
        say(f"{r['fp8_gathers']} fp8 all-gathers" + (f"; resumed at step {args.resume_at}: losses bitwise the "
                                                     "uninterrupted run's" if args.resume_at else ""))
    if args.compare:
        on, off = results[True], results[False]
        if any(on[k] != off[k] for k in ("loss", "grad_norm", "param_checksum")):
            raise RuntimeError(f"fp8 all-gather on/off differ: {on['loss']} vs {off['loss']}")
        say("fp8 all-gather on vs off: losses, gradient norms and trained weights bitwise identical")


if __name__ == "__main__":
    main()
