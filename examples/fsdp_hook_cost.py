"""Host time of the FSDP2 fp8 all-gather hooks, per call, at depth.

A Qwen3 built from a config (no download), fp32 master weights, FSDP2 on every decoder layer and
on the root (``MixedPrecisionPolicy(param_dtype=bf16)``), AdamW, the fp8 all-gather on; every
optimizer step precomputes the casts (the default). Per recipe and ``reshard_after_forward``:
the median host time of one ``fsdp_pre_all_gather`` and one ``fsdp_post_all_gather`` call over
the steps after the warm-up, and of FSDP2's calls that run them (``FSDPParam.all_gather_inputs``:
reading the hook, its signature and calling it; ``FSDPParam.init_unsharded_param``), of the
optimizer step's precompute (the host's part: it returns before the GPU has cast), the
all-gathers per step, and the median step. The model is small on
purpose: what shows is the hooks' Python, which FSDP2 runs eagerly before every all-gather.

    torchrun --nproc-per-node 2 examples/fsdp_hook_cost.py --device cpu

Runs on GPUs (NCCL) or CPUs (gloo).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8func as f8
from _common import add_model_args, build_qwen3, emit, environment, local_device, model_line
from fp8func.distributed import Fp8AllGatherWeight


class HookTimer:
    """Times every call of the two FSDP2 hooks of the fp8 all-gather weights while entered, and
    FSDP2's calls around them (``FSDPParam.all_gather_inputs``: binding the pre-all-gather hook,
    reading its signature, calling it; ``FSDPParam.init_unsharded_param``: the post-all-gather
    hook's caller) for those weights."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

        from fp8func.distributed import _precompute

        self.calls: dict[str, list[list[float]]] = {
            k: [] for k in ("pre", "post", "fsdp_pre", "fsdp_post", "precompute")}
        self._precompute = (_precompute, _precompute._precompute)  # what every optimizer step calls
        self._pre = Fp8AllGatherWeight.__dict__["fsdp_pre_all_gather"]  # a signed_hook; .fn: the method
        self._post = Fp8AllGatherWeight.fsdp_post_all_gather
        self._fsdp = (FSDPParam, FSDPParam.__dict__["all_gather_inputs"], FSDPParam.init_unsharded_param)

    def _timed(self, fn, name, ours=None):
        @functools.wraps(fn)  # FSDP2 reads the pre-all-gather hook's signature
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if ours is None or ours(args[0]):
                self.calls[name][-1].append(time.perf_counter() - t0)
            return out

        return call

    def step(self) -> None:
        for v in self.calls.values():
            v.append([])

    def __enter__(self):
        cls, inputs, init = self._fsdp
        ours = lambda fsdp_param: isinstance(fsdp_param._sharded_local_tensor, Fp8AllGatherWeight)  # noqa: E731
        Fp8AllGatherWeight.fsdp_pre_all_gather = type(self._pre)(self._timed(self._pre.fn, "pre"))
        Fp8AllGatherWeight.fsdp_post_all_gather = self._timed(self._post, "post")
        cls.all_gather_inputs = property(self._timed(inputs.fget, "fsdp_pre", ours))
        cls.init_unsharded_param = self._timed(init, "fsdp_post", ours)
        module, fn = self._precompute
        module._precompute = self._timed(fn, "precompute")
        return self

    def __exit__(self, *exc):
        cls, inputs, init = self._fsdp
        Fp8AllGatherWeight.fsdp_pre_all_gather = self._pre
        del Fp8AllGatherWeight.fsdp_post_all_gather  # the inherited one again
        cls.all_gather_inputs, cls.init_unsharded_param = inputs, init
        module, fn = self._precompute
        module._precompute = fn


def run(args, mesh, device, recipe: str, reshard: bool) -> dict:
    model = f8.convert(build_qwen3(args, device), recipe)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps = []
    with HookTimer() as timer:
        for step in range(args.steps):
            timer.step()
            g = torch.Generator().manual_seed(10_000 * step + dist.get_rank())
            ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            steps.append(time.perf_counter() - t0)
    out = {"step_ms": statistics.median(steps[args.warmup:]) * 1e3}
    for name, calls in timer.calls.items():
        measured = [c for per_step in calls[args.warmup:] for c in per_step]
        out[name + "_us"] = statistics.median(measured) * 1e6 if measured else float("nan")
        out[name + "_calls"] = len(calls[-1])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p, seq=16, batch=2)
    p.set_defaults(steps=13, layers=32, hidden=64, intermediate=128, heads=2, kv_heads=2, vocab=256)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    p.add_argument("--recipes", default="rowwise,tensorwise")
    args = p.parse_args()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    device = local_device(args.device)
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    rows = []
    for recipe in args.recipes.split(","):
        for reshard in (True, False):
            r = run(args, mesh, device, recipe, reshard)
            rows.append({"recipe": recipe, "reshard_after_forward": reshard, **r})
    if dist.get_rank() == 0:
        lines = [f"| {r['recipe']} | {r['reshard_after_forward']} | {r['pre_calls']} | {r['pre_us']:.1f} | "
                 f"{r['fsdp_pre_us']:.1f} | {r['post_us']:.1f} | {r['fsdp_post_us']:.1f} | "
                 f"{r['precompute_us'] / 1e3:.2f} | {r['step_ms']:.1f} |"
                 for r in rows]
        emit(args, environment(dist.get_world_size(), args.device), model_line(args),
             "| recipe | reshard_after_forward | gathers/step | pre-all-gather hook us/call | FSDP2 all_gather_inputs "
             "us/call | post-all-gather hook us/call | FSDP2 init_unsharded_param us/call | precompute ms/step "
             "| step ms |",
             lines, {"rows": rows})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
