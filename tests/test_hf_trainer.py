"""HF Trainer + FSDP2 (accelerate) with ``fp8func.hf.Fp8Callback``, CPU/gloo, 2 processes:
examples/hf_trainer_fsdp2.py run CI-sized on the demo's text. The run checkpoints at step 3
(``save_strategy="steps"``), a second Trainer resumes from it and logs bitwise the uninterrupted
run's losses, and turning the fp8 all-gather off changes nothing, bitwise."""

import math
from types import SimpleNamespace

import pytest
import torch

import fp8func as f8

from .dist_harness import run_workers
from .examples import load_example

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install -e '.[dev]')")

STEPS, RESUME_AT = 6, 3
ARGV = ["--device", "cpu", "--steps", str(STEPS), "--resume-at", str(RESUME_AT), "--hidden", "128",
        "--intermediate", "256", "--layers", "2", "--heads", "4", "--kv-heads", "4", "--seq", "64", "--batch", "2"]


def _example():
    return load_example("hf_trainer_fsdp2")


def _run(rank, world_size, fp8_all_gather, recipe="tensorwise"):
    return _example().worker(rank, world_size, ARGV + ["--recipe", recipe], fp8_all_gather)


@pytest.mark.slow
def test_hf_trainer_fsdp2_fp8_all_gather_on_off_bitwise():
    # Also: each run checkpoints at step 3, and a new Trainer resumed from it logs bitwise the same losses.
    on = run_workers(_run, 2, True)
    off = run_workers(_run, 2, False)
    for res in (on, off):
        r0, r1 = res
        # Every rank logs the loss averaged over ranks: identical, finite, one per step.
        assert r0["loss"] == r1["loss"] and len(r0["loss"]) == STEPS and all(map(math.isfinite, r0["loss"]))
        # Resumed from checkpoint-3 by a new Trainer: steps 4-6 bitwise the uninterrupted run's.
        assert r0["resumed"]["loss"] == r0["loss"][RESUME_AT:], (r0["resumed"]["loss"], r0["loss"])
        assert r0["resumed"]["grad_norm"] == r0["grad_norm"][RESUME_AT:]
        assert r0["resumed"]["param_checksum"] == r0["param_checksum"]  # the same trained weights
    # 14 decoder-layer weights gathered in the forward and again in the backward, lm_head once or
    # twice a step depending on accelerate's grouping of [norm, lm_head]; none with the gather off.
    assert on[0]["fp8_gathers"] in (STEPS * (14 * 2 + 1), STEPS * 15 * 2), on[0]["fp8_gathers"]
    assert [r["fp8_gathers"] for r in off] == [0, 0]
    # The point: the fp8 all-gather changes nothing, with Trainer's defaults (AdamW, seeded
    # shuffling, grad clipping at 1.0): losses, gradient norms and the trained weights, bitwise.
    for r_on, r_off in zip(on, off):
        assert r_on["loss"] == r_off["loss"] and r_on["grad_norm"] == r_off["grad_norm"]
        assert r_on["param_checksum"] == r_off["param_checksum"]


@pytest.mark.slow
def test_hf_trainer_delayed_scaling_resumes_bitwise():
    # Delayed scaling: the callback shares the scaling state over the FSDP2 mesh, and the state is
    # in the checkpoint (fp8_*_history / scale buffers): the resumed run continues it bitwise.
    r0, r1 = run_workers(_run, 2, False, "delayed")
    assert r0["loss"] == r1["loss"] and r0["resumed"]["loss"] == r0["loss"][RESUME_AT:]


def test_fp8_callback_converts_and_fsdp2_config_names_the_blocks():
    from .models import tiny_qwen3

    model = tiny_qwen3(layers=1)
    assert f8.hf.fsdp2_config(model) == {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"],
                                         "reshard_after_forward": True}
    callback = f8.hf.Fp8Callback("rowwise", filter=["lm_head"])
    callback.on_init_end(None, SimpleNamespace(is_world_process_zero=True), None, model=model)
    assert isinstance(model.model.layers[0].mlp.up_proj, f8.nn.Fp8Linear) and type(model.lm_head) is torch.nn.Linear
    with pytest.raises(ValueError, match="names no _no_split_modules"):
        f8.hf.fsdp2_config(torch.nn.Sequential())


def test_check_optimizer_catches_the_data_ptr_remap_trap():
    # accelerate maps the optimizer's parameters to FSDP2's sharded ones by data_ptr(): with weights
    # whose data_ptr() is 0 (a wrapper tensor without one) every weight lands in one slot.
    from .models import tiny_qwen3

    model = f8.convert(tiny_qwen3(layers=1), "tensorwise")
    params = list(model.parameters())
    f8.hf.check_optimizer(model, torch.optim.AdamW(params))
    remapped = SimpleNamespace(param_groups=[{"params": [params[0]] * 3 + params[3:]}])  # what accelerate left
    with pytest.raises(RuntimeError, match=r"2 missing .* repeated"):
        f8.hf.check_optimizer(model, remapped)
