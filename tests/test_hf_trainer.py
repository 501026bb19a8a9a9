"""HF Trainer + FSDP2 (accelerate) on an fp8func-converted Qwen3, CPU/gloo, 2 processes:
examples/hf_trainer_fsdp2.py run CI-sized. FSDP2 really shards the Fp8Linear weights as
Fp8AllGatherWeight DTensors, the fp8 all-gather runs, and turning it off changes nothing, bitwise."""

import importlib.util
import math
import pathlib

import pytest

from .dist_harness import run_workers

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install -e '.[dev]')")

ARGV = ["--device", "cpu", "--steps", "4", "--hidden", "128", "--intermediate", "256", "--layers", "2",
        "--heads", "4", "--kv-heads", "4", "--vocab", "256", "--seq", "64", "--batch", "2"]
STEPS = 4


def _example():
    path = pathlib.Path(__file__).parents[1] / "examples" / "hf_trainer_fsdp2.py"
    spec = importlib.util.spec_from_file_location("hf_trainer_fsdp2", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    return ex


def _run(rank, world_size, fp8_all_gather, zero_data_ptrs=False):
    ex = _example()
    try:
        return ex.worker(rank, world_size, ARGV, fp8_all_gather, zero_data_ptrs)
    except RuntimeError as e:
        if not zero_data_ptrs:
            raise
        return str(e)


def test_hf_trainer_fsdp2_fp8_all_gather_on_off_bitwise():
    on = run_workers(_run, 2, True)
    off = run_workers(_run, 2, False)
    r0 = on[0]
    # Every rank logs the loss averaged over ranks: identical, finite, one per step.
    assert len(r0["losses"]) == STEPS and all(math.isfinite(x) for x in r0["losses"]), r0["losses"]
    for res in (on, off):
        assert res[0]["losses"] == res[1]["losses"], (res[0]["losses"], res[1]["losses"])
        assert res[0]["grad_norms"] == res[1]["grad_norms"]
    assert r0["conversion"] == "fp8func: converted 15/15 linear layers (recipe=tensorwise, fsdp_fp8_all_gather=True)"
    assert off[0]["conversion"].endswith("fsdp_fp8_all_gather=False)")
    assert r0["fsdp_plugin_args"]["fsdp_version"] == 2
    # FSDP2 sharded every Fp8Linear weight, and (on) as a DTensor over an Fp8AllGatherWeight.
    for r in on:
        assert len(r["layout"]) == 15 and set(r["layout"].values()) == {"fsdp2-fp8"}, r["layout"]
    for r in off:
        assert len(r["layout"]) == 15 and set(r["layout"].values()) == {"fsdp2"}, r["layout"]
    # 14 decoder-layer weights gathered in the forward and again in the backward
    # (reshard_after_forward=True); lm_head once a step where accelerate (1.15) gives [norm, lm_head]
    # a group that keeps it, twice where it sits in the root (accelerate 1.10).
    assert on[0]["fp8_gathers"] == on[1]["fp8_gathers"] in (STEPS * (14 * 2 + 1), STEPS * 15 * 2), on[0]["fp8_gathers"]
    assert [r["fp8_gathers"] for r in off] == [0, 0]
    # The point: the fp8 all-gather changes nothing, with Trainer's defaults (AdamW, seeded
    # shuffling, grad clipping at 1.0): losses, gradient norms and the trained weights, bitwise.
    for r_on, r_off in zip(on, off):
        assert r_on["losses"] == r_off["losses"], (r_on["losses"], r_off["losses"])
        assert r_on["grad_norms"] == r_off["grad_norms"], (r_on["grad_norms"], r_off["grad_norms"])
        assert r_on["param_checksum"] == r_off["param_checksum"]


def test_accelerate_optimizer_remap_trap_is_detected():
    # With weights whose data_ptr() is 0 (torchao's fp8 weights, for one), accelerate maps all of
    # them to one sharded weight in the optimizer; the example's check must refuse to train.
    msgs = run_workers(_run, 2, True, True)
    for msg in msgs:
        assert isinstance(msg, str), msg
        assert "does not hold the model's parameters once each" in msg and "14 missing" in msg, msg
