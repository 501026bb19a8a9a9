"""FSDP2 with fp32 master weights and bf16 mixed precision: fp8 all-gather on == off, bitwise."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8func as f8

from .dist_harness import run_workers
from .models import batch, tiny_qwen3


class _CountAllGather:
    """Counts the bytes FSDP2 hands to its all-gather (``dist.all_gather_single`` in torch 2.13,
    ``dist.all_gather_into_tensor`` before): the weight all-gathers, nothing else."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self):
        self.bytes = 0
        self._orig = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def __enter__(self):
        for name, orig in self._orig.items():
            def counting(output_tensor, input_tensor, *args, _orig=orig, **kwargs):
                self.bytes += input_tensor.numel() * input_tensor.element_size()
                return _orig(output_tensor, input_tensor, *args, **kwargs)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def _train(rank, world_size, recipe, fp8_gather, steps, reshard, param_dtype, precompute=False, compiled=False):
    mesh = init_device_mesh("cpu", (world_size,))
    model = tiny_qwen3(layers=1 if compiled else 2)  # compiling on 2 CPU cores is the slow part
    if param_dtype == "bf16-weights":
        model = model.bfloat16()
        mp = MixedPrecisionPolicy()
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if recipe is not None:
        f8.convert(model, recipe, fsdp_fp8_all_gather=fp8_gather)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    if compiled:  # per-block compile, FSDP2 hooks eager (the torchtitan layout)
        for layer in model.model.layers:
            layer.compile(fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, covered = [], []
    used = []
    if precompute:
        import fp8func.distributed._fsdp as fsdp_mod

        orig = fsdp_mod.quantize_with_scale

        def counting(*a, **k):
            used.append(1)
            return orig(*a, **k)

        fsdp_mod.quantize_with_scale = counting
    with _CountAllGather() as counter:
        for step in range(steps):
            ids, labels = batch(step, rank)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if precompute:
                covered.append(f8.precompute_scales(model))
            losses.append(loss.detach().float().item())
    n_fp8 = sum(p.numel() for m in model.modules() if isinstance(m, f8.nn.Fp8Linear) for p in [m.weight])
    return {"losses": losses, "bytes": counter.bytes, "fp8_weight_numel": n_fp8, "covered": covered,
            "precomputed_used": len(used)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fsdp_fp8_all_gather_on_off_bitwise_and_bytes(recipe):
    steps = 20
    on = run_workers(_train, 2, recipe, True, steps, True, "fp32-master")
    off = run_workers(_train, 2, recipe, False, steps, True, "fp32-master")
    for r_on, r_off in zip(on, off):
        assert r_on["losses"] == r_off["losses"], (r_on["losses"][:3], r_off["losses"][:3])
        assert all(torch.isfinite(torch.tensor(r_on["losses"])))
    saved = off[0]["bytes"] - on[0]["bytes"]
    # Each training step gathers every layer twice (forward, and backward after resharding);
    # the root (embeddings, final norm, lm_head) is gathered once.
    fp8_bytes_per_gather = on[0]["fp8_weight_numel"] // 2  # this rank's shard, 1 byte per element
    payloads = 1 if recipe in ("tensorwise", "blockwise") else 2
    assert saved == steps * 2 * fp8_bytes_per_gather * (2 - payloads), (saved, on[0]["bytes"], off[0]["bytes"])
    if payloads == 1:  # converted weights moved at half of bf16's bytes
        assert saved > 0


def test_fsdp_bf16_weights_and_no_reshard():
    on = run_workers(_train, 2, "tensorwise", True, 6, False, "bf16-weights")
    off = run_workers(_train, 2, "tensorwise", False, 6, False, "bf16-weights")
    assert on[0]["losses"] == off[0]["losses"]


def test_fsdp_four_ranks_rowwise():
    on = run_workers(_train, 4, "rowwise", True, 6, True, "fp32-master")
    off = run_workers(_train, 4, "rowwise", False, 6, True, "fp32-master")
    assert on[0]["losses"] == off[0]["losses"]


def test_precompute_scales_keeps_the_contract():
    on = run_workers(_train, 2, "tensorwise", True, 6, True, "fp32-master", True)
    off = run_workers(_train, 2, "tensorwise", False, 6, True, "fp32-master")
    assert on[0]["losses"] == off[0]["losses"]
    assert on[0]["covered"] == [15] * 6  # every converted layer: 2 decoder layers x 7, and lm_head
    # After each of the first 5 steps, every forward and backward gather used the precomputed scale.
    assert on[0]["precomputed_used"] == 5 * 15 * 2


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp_compiled_on_off_bitwise(recipe):
    on = run_workers(_train, 2, recipe, True, 3, True, "fp32-master", False, True)
    off = run_workers(_train, 2, recipe, False, 3, True, "fp32-master", False, True)
    assert on[0]["losses"] == off[0]["losses"]
    assert on[0]["bytes"] < off[0]["bytes"] or recipe == "rowwise"


def _misaligned_blocks(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    model = f8.convert(tiny_qwen3(layers=1), "blockwise")
    fully_shard(model, mesh=mesh)
    ids, labels = batch(0, rank)
    try:
        model(input_ids=ids, labels=labels)
    except ValueError as e:
        return str(e)
    return "no error"


def test_fsdp_blockwise_misaligned_shards_raise_with_the_fix():
    msg = run_workers(_misaligned_blocks, 4)[0]
    assert "row shards of [64, 64, 64, 64] over 4 ranks" in msg and "fsdp_fp8_all_gather=False" in msg
