"""``verify(model, step_fn)`` (profiler proof that FP8 GEMMs ran, per layer) and ``python -m fp8func.demo``."""

import logging
import sys

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8func as f8
from fp8func.nn._verify import verify

from .dist_harness import run_workers
from .models import batch, tiny_qwen3


def _step(model, rank=0):
    ids, labels = (t.to(model.device) for t in batch(0, rank, seq=16))

    def step():
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        return loss

    return step


def _small(recipe="tensorwise", device="cpu", **kwargs):
    model = tiny_qwen3(hidden=64, intermediate=128, layers=1, heads=4).to(device)
    return f8.convert(model, recipe, filter=lambda m, fqn: fqn != "lm_head", **kwargs)


def test_verify_cpu_says_emulated_fp8_ran_for_every_converted_layer(capsys):
    model = _small()
    v = verify(model, _step(model))
    printed = capsys.readouterr().out
    rows = {r.fqn: r for r in v.rows}
    fp8 = [r for r in v.rows if r.fp8]
    assert v.ok and len(fp8) == 7 and v.device == "cpu" and v.output.item() > 0
    for r in fp8:  # forward, grad_input and grad_weight GEMMs, all emulated; no aten::_scaled_mm
        assert (r.ok, r.gemms, r.scaled_mm, r.note) == (True, "emulated x3", 0, "FP8 emulated on cpu"), r
    head = rows["lm_head"]
    assert (head.fp8, head.ok, head.gemms) == (False, True, "high precision x3")
    assert head.note == "not converted: excluded by filter"
    assert ("FP8 verified: 7/7 FP8 layers ran FP8 GEMMs (emulated on cpu: gemm_path -> 'emulated'; "
            "aten::_scaled_mm ran 0 times).") in printed
    assert "lm_head" in printed and "not converted: excluded by filter" in printed


def test_verify_counts_scaled_mm_when_it_runs():
    model = _small(f8.Recipe.from_name("tensorwise", path="hardware"))  # the CPU build's _scaled_mm
    v = verify(model, _step(model), print_table=False)
    assert v.ok and all((r.gemms, r.scaled_mm) == ("scaled_mm_tensorwise x3", 3) for r in v.rows if r.fp8)
    assert "aten::_scaled_mm ran 21 times" in v.summary


def test_verify_leaves_no_hooks_or_patches_behind():
    from fp8func import _gemm
    from fp8func.distributed import Fp8AllGatherWeight

    model = _small()
    before = (_gemm.gemm_path, Fp8AllGatherWeight.fsdp_pre_all_gather)
    with pytest.raises(ZeroDivisionError):
        verify(model, lambda: 1 / 0)
    assert (_gemm.gemm_path, Fp8AllGatherWeight.fsdp_pre_all_gather) == before
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_layer_swapped_back_after_convert_is_reported_loudly(caplog):
    model = _small()
    model.model.layers[0].mlp.up_proj = nn.Linear(64, 128, bias=False)
    with caplog.at_level(logging.ERROR, logger="fp8func"):
        v = verify(model, _step(model), print_table=False)
    bad = {r.fqn: r for r in v.failures}
    assert not v.ok and list(bad) == ["model.layers.0.mlp.up_proj"]
    assert bad["model.layers.0.mlp.up_proj"].gemms == "high precision x3"
    assert "now a Linear and runs in high precision" in bad["model.layers.0.mlp.up_proj"].note
    msg = "FP8 CHECK FAILED: FP8 did not run for 1/7 FP8 layers: model.layers.0.mlp.up_proj."
    assert msg in v.summary and msg in str(v) and msg in caplog.text
    with pytest.raises(RuntimeError, match=r"FP8 did not run for 1/7 FP8 layers: model\.layers\.0\.mlp\.up_proj"):
        verify(model, _step(model), strict=True, print_table=False)


class _Tied(nn.Module):
    """Reasons convert() keeps or notes: N=24 (no multiple of 16), a filter, a tied weight."""

    def __init__(self):
        super().__init__()
        self.emb, self.up, self.odd = nn.Embedding(32, 64), nn.Linear(64, 128), nn.Linear(128, 24)
        self.down, self.head = nn.Linear(24, 64), nn.Linear(64, 32, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.down(self.odd(torch.relu(self.up(self.emb(ids))))))


def test_verify_reads_convert_decisions():
    torch.manual_seed(0)
    model = f8.convert(_Tied(), "tensorwise", filter=lambda m, fqn: fqn != "down")
    ids = torch.randint(0, 32, (4, 8))
    v = verify(model, lambda: model(ids).square().mean().backward(), print_table=False)
    rows = {r.fqn: r for r in v.rows}
    assert v.ok and [r.fqn for r in v.rows if r.fp8] == ["up", "head"]  # head: converted, noted as tied
    assert rows["odd"].note.startswith("not converted: K=128, N=24") and rows["down"].gemms == "high precision x3"
    model.head = nn.Linear(64, 32, bias=False)  # a converted layer replaced after convert()
    v = verify(model, lambda: model(ids).square().mean().backward(), print_table=False)
    assert [r.fqn for r in v.failures] == ["head"]


def test_unused_layer_and_unconverted_model_fail():
    model = _small()
    model.model.layers[0].mlp.forward = lambda x: x * 0  # gate/up/down never run
    v = verify(model, _step(model), print_table=False)
    assert sorted(r.fqn for r in v.failures) == [f"model.layers.0.mlp.{n}_proj" for n in ("down", "gate", "up")]
    assert all("did not run in this step" in r.note for r in v.failures)
    plain = tiny_qwen3(hidden=64, intermediate=128, layers=1, heads=4)
    with pytest.raises(RuntimeError, match="the model has no FP8 layers"):
        verify(plain, _step(plain), strict=True, print_table=False)


def test_emulated_path_on_a_gpu_fails(monkeypatch):
    """The GPU rule on the CPU: weights on a 'cuda' device whose GEMMs chose the emulated path."""
    import fp8func.nn._verify as mod

    model = _small(f8.Recipe.from_name("tensorwise", path="emulated"))
    monkeypatch.setattr(mod, "_device_of", lambda m: torch.device("cuda", 0))
    v = verify(model, _step(model), print_table=False)
    assert not v.ok and len(v.failures) == 7
    assert all("3 GEMM(s) emulated on cuda (gemm_path -> 'emulated', recipe 'tensorwise' path='emulated')"
               in r.note for r in v.failures)


def _fsdp_verify(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    out = {}
    for gather in (True, False, "fp8_weights"):
        model = tiny_qwen3(hidden=64, intermediate=128, layers=1, heads=4)
        f8.convert(model, "tensorwise", fsdp_fp8_all_gather=gather is not False, fp8_weights=gather == "fp8_weights")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fully_shard(model.model.layers[0], mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        v = verify(model, _step(model, rank), print_table=False)
        out[gather] = (v.ok, v.fp8_all_gathers, v.summary, [(r.fqn, r.ok, r.gemms, r.all_gather) for r in v.rows])
    return out


def test_verify_under_fsdp2_reports_fp8_all_gathers():
    for out in run_workers(_fsdp_verify, 2):
        for fp8 in (True, "fp8_weights"):  # fp8 all-gather of hp weights, and fp8 weights
            ok, gathers, summary, rows = out[fp8]
            assert ok and gathers == 15 and summary.endswith("FSDP2 fp8 all-gathers: 15.")  # 7 x 2 + 1
            for fqn, row_ok, gemms, all_gather in rows:
                # forward all-gather, and the backward's re-gather after reshard_after_forward
                n = 1 if fqn == "lm_head" else 2
                assert row_ok and gemms == "emulated x3" and all_gather.startswith(f"fp8 x{n}, "), (fqn, all_gather)
            q = dict((r[0], r[3]) for r in rows)["model.layers.0.self_attn.q_proj"]
            assert q == "fp8 x2, 4.0 KiB (hp 8.0 KiB)"  # 64x64 weight: 32 rows/rank, 1 byte vs 2 (bf16)
        ok, gathers, summary, rows = out[False]
        assert ok and gathers == 0 and "all-gathers" not in summary
        assert all(all_gather == "high precision" for *_, all_gather in rows)


def test_demo_main_trains_both_and_writes_the_png(tmp_path, capsys):
    from fp8func.demo import main

    out = tmp_path / "loss.png"
    assert main(["--steps", "3", "--seq", "64", "--batch", "4", "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    for line in ("fp8func: converted 29/29 linear layers (recipe=tensorwise, fsdp_fp8_all_gather=False)",
                 "29/29 linear layers in FP8",  # report(model)
                 "FP8 verified: 29/29 FP8 layers ran FP8 GEMMs (emulated on cpu: gemm_path -> 'emulated'; "
                 "aten::_scaled_mm ran 0 times).",
                 "FP8 path: emulated on cpu", "| | bf16 loss | fp8 loss | fp8 vs bf16 |", "| step 3 | ",
                 "| final (mean of last 3) | ", "| held-out, 2,048 tokens (after training) | ", f"loss curves: {out}"):
        assert line in printed, line
    step1 = next(line for line in printed.splitlines() if line.startswith("| step 1 |"))
    bf16, fp8 = (float(v) for v in step1.split("|")[2:4])
    assert abs(fp8 - bf16) < 0.05 and 5.0 < bf16 < 6.0  # same init and batch: ~ln(256) before any update


def test_demo_data_order_is_fixed_and_progress_falls_back(monkeypatch, capsys):
    from fp8func.demo import _report
    from fp8func.demo._data import Batches, load_tokens

    tokens = load_tokens()
    assert len(tokens) == 144_430 and bytes(tokens[:32].tolist()) == b"ALICE'S ADVENTURES IN WONDERLAND"
    a, b = Batches(tokens, steps=4, batch=2, seq=32), Batches(tokens, steps=4, batch=2, seq=32)
    assert all(torch.equal(a[i], b[i]) for i in range(4)) and not torch.equal(a[0], a[1])
    with pytest.raises(ValueError, match=r"seq=20000 does not fit the corpus .* use --seq below 14443"):
        Batches(tokens, steps=1, batch=1, seq=20000)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # no tqdm: plain lines on stderr
    bar = _report.progress(range(20), 20, "train")
    for i in bar:
        bar.set_postfix_str(f"loss {i}")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 10 and err[0] == "train [##                  ] 2/20 loss 1"
    assert err[-1] == "train [####################] 20/20 loss 19"


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_verify_on_gpu_sees_scaled_mm_and_its_kernels(recipe):
    model = _small(recipe, device="cuda")
    v = verify(model, _step(model))
    assert v.ok and v.device == "cuda:0" and v.kernels
    assert all(r.scaled_mm == 3 and r.gemms == f"scaled_mm_{recipe} x3" for r in v.rows if r.fp8)
    assert "hardware path on cuda:0: aten::_scaled_mm ran 21 times" in v.summary


@pytest.mark.gpu
def test_verify_on_gpu_fails_a_recipe_forced_to_emulation():
    model = _small(f8.Recipe.from_name("tensorwise", path="emulated"), device="cuda")
    with pytest.raises(RuntimeError, match="FP8 did not run for 7/7 FP8 layers"):
        verify(model, _step(model), strict=True)


@pytest.mark.gpu
def test_demo_main_on_gpu_takes_the_hardware_path(tmp_path, capsys):
    from fp8func.demo import main

    assert main(["--steps", "3", "--seq", "64", "--out", str(tmp_path / "l.png")]) == 0
    assert "FP8 path: hardware on cuda" in capsys.readouterr().out
