"""HF ``Trainer`` + FSDP2 (through accelerate) on an fp8func-converted Qwen3: the seed's setup.

The seed report trains a Qwen3 with ``transformers.Trainer`` and FSDP2 (``fsdp_version: 2``) after
converting it to FP8, and sees the loss change when the FSDP2 fp8 all-gather is switched on. Here
the same pipeline runs with fp8func: the model is built from a config (no download), converted
with ``fp8func.convert(model, recipe)`` *before* the Trainer wraps it (``fsdp_fp8_all_gather=True``,
the default), and handed to a stock ``Trainer`` whose accelerate FSDP2 plugin calls
``fully_shard`` on every ``Qwen3DecoderLayer``, the embedding, ``[norm, lm_head]`` and the root
with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` (``bf16=True``). The data are
random token ids from a fixed seed.

How transformers 5.x spells FSDP2 (``TrainingArguments._process_fsdp_args``): ``fsdp=True`` and
``fsdp_config={"version": 2, ...}``; keys may carry the ``fsdp_`` prefix (``"fsdp_version": 2`` is
the same key), and ``version`` already defaults to 2. Needs ``pip install accelerate``.

Two things in accelerate (1.10 to 1.15) need a hand, both done here and both checked:

* On CPU processes (``use_cpu=True``, gloo) accelerate drops the FSDP plugin silently and the
  Trainer wraps the model in DDP; ``Fsdp2Trainer`` switches the accelerator state to FSDP2 the way
  accelerate does for GPUs (a no-op on GPUs).
* accelerate re-points the optimizer (built before ``fully_shard``) at the sharded parameters
  through a map keyed on ``data_ptr()``. A wrapper tensor subclass without its own ``data_ptr``
  returns 0, so every such weight maps to one optimizer slot: 14 of 15 would never train and the
  losses drift from step 2. This example found that for fp8func (``Fp8AllGatherWeight.data_ptr``
  now returns the wrapped tensor's address); torchao's ``WeightWithDynamicFloat8CastTensor`` still
  returns 0 (accelerate handles it only when its own fp8 backend converted the model, not in the
  seed report's setup). ``OptimizerCoversModel`` refuses to train if the optimizer does not hold
  every parameter exactly once (tested by simulating the zero pointers, ``_zero_data_ptrs``).

At the end every rank checks that FSDP2 really sharded the ``Fp8Linear`` weights (``.weight`` is a
``DTensor`` whose ``_local_tensor`` is an ``fp8func.distributed.Fp8AllGatherWeight``) and that the
fp8 all-gather ran (calls of ``Fp8AllGatherWeight.fsdp_pre_all_gather`` are counted), and raises if
not. ``--compare`` trains a second time with ``fsdp_fp8_all_gather=False`` and checks that the
losses are bitwise the same (the seed's question).

CPU (gloo, tiny model; about 10 s in all on 2 cores)::

    torchrun --nproc-per-node 2 examples/hf_trainer_fsdp2.py --device cpu --steps 8 --compare

GPUs (NCCL; 8 x H100, a Qwen3-1.7B-sized model; FP8 GEMMs need sm89+)::

    torchrun --nproc-per-node 8 examples/hf_trainer_fsdp2.py --device cuda --steps 200 \\
        --hidden 2048 --intermediate 6144 --layers 28 --heads 16 --kv-heads 8 --vocab 151936 \\
        --seq 4096 --batch 2 --recipe tensorwise --compare

Only the CPU command has been run (tests/test_hf_trainer.py runs the same function CI-sized); the
GPU command is untested. The loss comes out in bf16 under accelerate's ``bf16=True`` (output_dtype and
autocast), so the example also compares the fp32 gradient norms and a checksum of the trained weights.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fp8func as f8  # noqa: E402
from fp8func.distributed import Fp8AllGatherWeight  # noqa: E402
from _common import add_model_args, build_qwen3, model_line  # noqa: E402

# --device cpu without explicit sizes: the CI-sized model.
CPU_DEFAULTS = dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=4, vocab=256, seq=64, batch=2,
                    steps=8, lr=3e-3)


def parse_args(argv=None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    device = pre.parse_known_args(argv)[0].device
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p, seq=2048, batch=4)
    if device == "cpu":
        p.set_defaults(**CPU_DEFAULTS)
    p.add_argument("--recipe", default="tensorwise", help="fp8func recipe (tensorwise, rowwise, blockwise)")
    p.add_argument("--no-fp8-all-gather", action="store_true", help="convert with fsdp_fp8_all_gather=False")
    p.add_argument("--compare", action="store_true",
                   help="train again with fsdp_fp8_all_gather=False and require bitwise-equal losses")
    p.add_argument("--output-dir", help="Trainer output_dir (default: a temporary directory; nothing is saved)")
    args = p.parse_args(argv)
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device {args.device!r}: expected 'cpu' or 'cuda'.")
    return args


def synthetic_dataset(n: int, seq: int, vocab: int, seed: int = 1234) -> list[dict[str, torch.Tensor]]:
    """``n`` samples of random token ids (labels = inputs, the model shifts them), fixed seed."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


class _Records(logging.Handler):
    """Keeps the messages of the ``fp8func`` logger (the conversion line)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _ensure_launch_env() -> None:
    """accelerate reads the rank layout from the environment (torchrun sets it). A process group
    started by other means (the test harness: gloo, file rendezvous) lacks it: fill it in; accelerate
    then uses the existing group instead of starting one."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        for k, v in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank), ("LOCAL_WORLD_SIZE", world)):
            os.environ.setdefault(k, str(v))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


def _trainer_class():
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
    from transformers import Trainer

    class Fsdp2Trainer(Trainer):
        """``Trainer`` that keeps FSDP2 on CPU processes too.

        accelerate (1.15) turns ``fsdp_plugin`` into ``DistributedType.FSDP`` only for accelerator
        process types (``AcceleratorState.__init__``: MULTI_GPU, MULTI_XPU, MULTI_NPU, ...); under
        ``use_cpu=True`` (MULTI_CPU, gloo) it drops the plugin without a word and the Trainer wraps
        the model in DDP. This applies the same two assignments accelerate makes for a GPU (plugin
        with the run's mixed precision, distributed type FSDP) on the shared accelerator state;
        on GPUs it changes nothing.
        """

        def create_accelerator_and_postprocess(self):
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            if (self.args.fsdp_plugin_args is not None and getattr(state, "fsdp_plugin", None) is None
                    and state.distributed_type == DistributedType.MULTI_CPU):
                plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                if state.mixed_precision != "no":
                    plugin.set_mixed_precision(state.mixed_precision)
                state.fsdp_plugin = plugin
                state.distributed_type = DistributedType.FSDP
                self.is_fsdp_enabled = True
            if self.args.fsdp_plugin_args is not None and not self.accelerator.is_fsdp2:
                raise RuntimeError(f"fsdp_config asked for FSDP2, but accelerate runs {state.distributed_type} "
                                   f"(fsdp_plugin={getattr(state, 'fsdp_plugin', None)!r}).")

    return Fsdp2Trainer


def fp8_weight_layout(model: torch.nn.Module) -> dict[str, str]:
    """Every Fp8Linear weight: 'fsdp2-fp8' (DTensor over an Fp8AllGatherWeight), 'fsdp2' (DTensor
    over a plain tensor), or the type it has otherwise."""
    out = {}
    for fqn, m in model.named_modules():
        if isinstance(m, f8.nn.Fp8Linear):
            w = m.weight
            if isinstance(w, DTensor):
                out[fqn] = "fsdp2-fp8" if isinstance(w._local_tensor, Fp8AllGatherWeight) else "fsdp2"
            else:
                out[fqn] = type(w).__name__
    return out


@contextlib.contextmanager
def _zero_data_ptrs(enabled: bool = False):
    """Makes ``Fp8AllGatherWeight.data_ptr()`` return 0 for the duration, as a wrapper subclass
    without its own ``data_ptr`` does (torchao's fp8 weight): accelerate's optimizer remapping
    (``Accelerator._prepare_fsdp2``, keyed on ``p.data_ptr()``) then sends every such weight's
    optimizer entry to one sharded weight. For the test that ``OptimizerCoversModel`` catches it."""
    if not enabled:
        yield
        return
    own = Fp8AllGatherWeight.__dict__["data_ptr"]
    Fp8AllGatherWeight.data_ptr = lambda self: 0
    try:
        yield
    finally:
        Fp8AllGatherWeight.data_ptr = own


def _optimizer_check_callback():
    from transformers import TrainerCallback

    class OptimizerCoversModel(TrainerCallback):
        """Raises at the start of training unless the optimizer holds every trainable parameter of
        the (FSDP2-wrapped) model exactly once, by identity."""

        def on_train_begin(self, a, state, control, model=None, optimizer=None, **kw):
            params = [p for p in model.parameters() if p.requires_grad]
            held = [p for g in optimizer.param_groups for p in g["params"]]
            ids = {id(p) for p in params}
            counts = collections.Counter(id(p) for p in held)
            names = {id(p): n for n, p in model.named_parameters()}
            missing = [names[i] for i in ids if i not in counts]
            repeated = {names.get(i, "?"): c for i, c in counts.items() if c > 1}
            foreign = sum(1 for i in counts if i not in ids)
            if missing or repeated or foreign:
                raise RuntimeError(
                    f"the optimizer does not hold the model's parameters once each after accelerate's FSDP2 "
                    f"prepare: {len(missing)} missing (e.g. {sorted(missing)[:3]}), repeated {repeated}, "
                    f"{foreign} foreign. accelerate remaps optimizer parameters by data_ptr(), which is 0 for "
                    "wrapper tensor subclasses such as fp8func's Fp8AllGatherWeight; run the Trainer inside "
                    "a wrapper subclass without data_ptr(): give it one, or convert with fsdp_fp8_all_gather=False.")

    return OptimizerCoversModel


def train(args: argparse.Namespace, fp8_all_gather: bool, output_dir: str, zero_data_ptrs: bool = False) -> dict:
    """One Trainer run; returns the losses (mean over ranks, as Trainer logs them), the conversion
    line, the Fp8Linear weight layout after training and the count of fp8 all-gathers.
    ``zero_data_ptrs=True`` simulates weights whose ``data_ptr()`` is 0 (see ``_zero_data_ptrs``):
    accelerate's optimizer remapping trips over them and the check at the start of training raises."""
    OptimizerCoversModel = _optimizer_check_callback()
    from transformers import TrainerCallback, TrainingArguments

    _ensure_launch_env()
    records = _Records()
    flog = logging.getLogger("fp8func")
    old_level = flog.level
    flog.addHandler(records)
    flog.setLevel(logging.INFO)
    try:
        model = build_qwen3(args, "cpu", torch.float32)  # fp32 master weights; Trainer/accelerate moves it
        f8.convert(model, args.recipe, fsdp_fp8_all_gather=fp8_all_gather)
    finally:
        flog.removeHandler(records)
        flog.setLevel(old_level)
    conversion = [line for line in records.lines if line.startswith("fp8func: converted")]
    if len(conversion) != 1:
        raise RuntimeError(f"fp8func.convert logged {records.lines!r}; expected one 'fp8func: converted ...' line.")

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    targs = TrainingArguments(
        output_dir=output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        learning_rate=args.lr,
        weight_decay=0.01,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        bf16=True,
        use_cpu=args.device == "cpu",
        seed=0,
        dataloader_num_workers=0,
        fsdp=True,
        fsdp_config={
            "fsdp_version": 2,
            "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"],
            "reshard_after_forward": True,
        },
    )
    if targs.fsdp_plugin_args is None or targs.fsdp_plugin_args.get("fsdp_version") != 2:
        raise RuntimeError(f"TrainingArguments did not set up FSDP2: fsdp_plugin_args={targs.fsdp_plugin_args!r}")

    losses: list[float] = []
    grad_norms: list[float] = []  # the pre-clipping global gradient norm (fp32), a finer fingerprint

    class LossLog(TrainerCallback):
        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))
                grad_norms.append(float(logs["grad_norm"]))

    gathers = [0]
    orig = Fp8AllGatherWeight.fsdp_pre_all_gather

    # FSDP2 inspects this method's signature (it checks for the mp_policy/module arguments), so the
    # wrapper must have exactly the original one.
    def counting_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        gathers[0] += 1
        return orig(self, mesh, outer_size, outer_stride, module, mp_policy)

    data = synthetic_dataset(args.steps * args.batch * world, args.seq, args.vocab)
    trainer = _trainer_class()(model=model, args=targs, train_dataset=data,
                               callbacks=[LossLog(), OptimizerCoversModel()])
    Fp8AllGatherWeight.fsdp_pre_all_gather = counting_pre_all_gather
    try:
        with _zero_data_ptrs(enabled=zero_data_ptrs):
            trainer.train()
    finally:
        Fp8AllGatherWeight.fsdp_pre_all_gather = orig
    if len(losses) != args.steps:
        raise RuntimeError(f"Trainer logged {len(losses)} losses for {args.steps} steps: {losses}")
    # float64 sum of this rank's shards of every parameter after training: the weights themselves.
    checksum = sum(float((p.to_local() if isinstance(p, DTensor) else p).detach().double().sum())
                   for p in trainer.model.parameters())
    return {"losses": losses, "grad_norms": grad_norms, "param_checksum": checksum,
            "conversion": conversion[0], "layout": fp8_weight_layout(trainer.model),
            "fp8_gathers": gathers[0], "fsdp_plugin_args": dict(targs.fsdp_plugin_args)}


def check(result: dict, fp8_all_gather: bool) -> None:
    """Raises unless every Fp8Linear weight is FSDP2-sharded as expected and the gathers ran."""
    layout, n = result["layout"], result["fp8_gathers"]
    if not layout:
        raise RuntimeError("no Fp8Linear layers in the trained model: fp8func.convert did not run?")
    want = "fsdp2-fp8" if fp8_all_gather else "fsdp2"
    wrong = {k: v for k, v in layout.items() if v != want}
    if wrong:
        raise RuntimeError(f"Fp8Linear weights not sharded as {want!r} (DTensor over "
                           f"{'Fp8AllGatherWeight' if fp8_all_gather else 'a plain tensor'}): {wrong}")
    if fp8_all_gather and n == 0:
        raise RuntimeError("FSDP2 never called Fp8AllGatherWeight.fsdp_pre_all_gather: no fp8 all-gather happened.")
    if not fp8_all_gather and n:
        raise RuntimeError(f"fsdp_fp8_all_gather=False, yet {n} fp8 all-gathers ran.")
    if not all(map(lambda x: x == x and abs(x) != float("inf"), result["losses"])):
        raise RuntimeError(f"non-finite loss: {result['losses']}")


def worker(rank: int, world_size: int, argv: list[str], fp8_all_gather: bool, zero_data_ptrs: bool = False) -> dict:
    """For ``tests.dist_harness.run_workers``: one checked run in an initialised process group."""
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        result = train(args, fp8_all_gather, tmp, zero_data_ptrs)
    check(result, fp8_all_gather)
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)
    say(model_line(args) + f", recipe {args.recipe}, {args.device}")
    runs = [not args.no_fp8_all_gather] + ([False] if args.compare and not args.no_fp8_all_gather else [])
    results = {}
    for fp8_all_gather in runs:
        with tempfile.TemporaryDirectory() as tmp:
            result = train(args, fp8_all_gather, args.output_dir or tmp)
        check(result, fp8_all_gather)
        results[fp8_all_gather] = result
        say(result["conversion"])
        say(f"fsdp plugin: {result['fsdp_plugin_args']}")
        for i, loss in enumerate(result["losses"]):
            say(f"step {i + 1:4d}  loss {loss:.8f}  grad_norm {result['grad_norms'][i]:.8f}  "
                f"(fp8 all-gather {'on' if fp8_all_gather else 'off'})")
        n_fp8 = sum(v == "fsdp2-fp8" for v in result["layout"].values())
        say(f"{len(result['layout'])} Fp8Linear weights are FSDP2 DTensors, {n_fp8} over Fp8AllGatherWeight; "
            f"{result['fp8_gathers']} fp8 all-gathers (fsdp_pre_all_gather calls) on rank {rank}")
    if len(results) == 2:
        on, off = results[True]["losses"], results[False]["losses"]
        same_rest = all(results[True][k] == results[False][k] for k in ("grad_norms", "param_checksum"))
        if on != off or not same_rest:
            raise RuntimeError(f"fp8 all-gather on/off runs differ: losses {on} vs {off}, grad norms "
                               f"{results[True]['grad_norms']} vs {results[False]['grad_norms']}, weight checksums "
                               f"{results[True]['param_checksum']!r} vs {results[False]['param_checksum']!r}")
        say(f"fp8 all-gather on vs off: all {len(on)} losses, grad norms and the final weights (checksum "
            f"{results[True]['param_checksum']!r} on rank {rank}) bitwise identical")


if __name__ == "__main__":
    main()
