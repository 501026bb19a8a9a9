"""``verify(model, step_fn)`` (profiler proof that FP8 GEMMs ran, per layer) and ``python -m fp8func.demo``."""

import logging
import os
import re
import subprocess
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

    def hooks():  # the model's own (convert's shared-input-cast hooks on attention and MLP blocks)
        return [(name, list(m._forward_hooks.values()), list(m._forward_pre_hooks.values()))
                for name, m in model.named_modules()]

    own = hooks()
    with pytest.raises(ZeroDivisionError):
        verify(model, lambda: 1 / 0)
    assert (_gemm.gemm_path, Fp8AllGatherWeight.fsdp_pre_all_gather) == before
    assert hooks() == own


def test_verify_starts_the_profiler_with_kineto_quiet_and_leaves_the_environment_as_it_was(monkeypatch):
    from fp8func.nn import _verify

    seen = []

    class Spy(_verify.profile):
        def __enter__(self):
            seen.append(os.environ.get("KINETO_LOG_LEVEL"))
            return super().__enter__()

    monkeypatch.setattr(_verify, "profile", Spy)
    monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    model = _small()
    assert verify(model, _step(model), print_table=False).ok
    assert seen == ["6"] and "KINETO_LOG_LEVEL" not in os.environ  # above kineto's USDT level, then unset
    monkeypatch.setenv("KINETO_LOG_LEVEL", "2")  # the user's own level is kept
    assert verify(model, _step(model), print_table=False).ok
    assert seen == ["6", "2"] and os.environ["KINETO_LOG_LEVEL"] == "2"


_VERIFY_IN_A_FRESH_PROCESS = """
import torch, fp8func as f8
model = f8.convert(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)), "rowwise")
x = torch.randn(32, 64)
def step():
    loss = model(x).square().mean()
    loss.backward()
    return loss
assert f8.verify(model, step, strict=True, print_table=False).ok
"""


@pytest.mark.slow
def test_verify_in_a_fresh_process_writes_nothing_to_stderr():
    # libkineto starts with the first profiler of a process, and writes to stderr from C++ (which
    # capsys does not see): hence a process of its own.
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", _VERIFY_IN_A_FRESH_PROCESS], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-4000:]


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


@pytest.mark.slow
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


def _demo(tmp_path, capsys, *extra, err=None):
    from fp8func.demo import main

    out = tmp_path / "loss.png"
    threads = torch.get_num_threads()
    rc = main(["--steps", "3", "--seq", "64", "--batch", "4", "--device", "cpu", "--threads", "1", "--out", str(out),
               *extra])
    assert torch.get_num_threads() == threads  # main() sets its threads and puts them back
    printed = capsys.readouterr()
    assert rc == 0 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    if err is not None:
        err.append(printed.err)
    return printed.out.splitlines()


def _row(lines, name):
    return [c.strip() for c in next(line for line in lines if line.startswith(f"| {name} |")).split("|")[2:-1]]


def test_demo_prints_a_short_header_the_fp8_check_and_the_loss_table(tmp_path, capsys):
    err = []
    lines = _demo(tmp_path, capsys, err=err)
    assert lines[0].startswith("fp8func demo: bf16 vs FP8 (tensorwise) on cpu (")
    assert "1 CPU thread (--threads)" in lines[0]
    assert lines[1].startswith("model: Llama, 4 layers") and lines[1].endswith("29/29 linear layers in FP8")
    assert lines[2].startswith("data: alice.txt as bytes, 3 steps x 4 x 64 tokens; runs: bf16 and fp8 from seed 0, "
                               "bf16 from seed 1 (noise reference)")
    assert lines[3] == "| linear layers | count | FP8 | GEMMs per step (fwd + bwd) | status |"  # then the results
    assert _row(lines, "model.layers.*.self_attn.q_proj") == ["4", "yes", "emulated x3", "ok: FP8 emulated on cpu"]
    assert _row(lines, "lm_head") == ["1", "yes", "emulated x3", "ok: FP8 emulated on cpu"]
    assert sum(line.startswith("| model.layers.*.") for line in lines) == 7  # one row per kind of layer
    assert ("FP8 verified: 29/29 FP8 layers ran FP8 GEMMs (emulated on cpu: gemm_path -> 'emulated'; "
            "aten::_scaled_mm ran 0 times).") in lines
    assert any(line.startswith("FP8 path: emulated on cpu") for line in lines)
    assert "| loss (nats/byte) | bf16 | fp8 | bf16 seed 1 | fp8 vs bf16 | bf16 seed 1 vs bf16 |" in lines
    bf16, fp8, seed1 = (float(v) for v in _row(lines, "step 1")[:3])
    assert abs(fp8 - bf16) < 0.05 and 5.0 < bf16 < 6.0  # same init and batch: ~ln(256) before any update
    assert seed1 != bf16 and 5.0 < seed1 < 6.0  # another init, the same batch
    assert len(_row(lines, "final (mean of last 3 steps)")) == 5 and len(_row(lines, "held-out, 2,048 tokens")) == 5
    assert any(line.startswith("last 1 steps (mean of 3): fp8 vs bf16 ") and "bf16 seed 1 vs bf16 at most" in line
               for line in lines)
    assert lines[-1].startswith(f"loss curves: {tmp_path / 'loss.png'}; total ")
    assert len(lines) < 30
    # the progress bar shows each step's loss next to that step's number (the table's losses, rounded)
    bf16 = {int(s): float(v) for s in ("1", "2", "3") for v in _row(lines, f"step {s}")[:1]}
    shown = [(int(n), float(v)) for n, v in re.findall(r" (\d)/3 \[[^]]*, bf16 ([\d.]+) ", err[0])]
    assert shown and all(f"{v:.3f}" == f"{bf16[n]:.3f}" for n, v in shown), (shown, bf16)


@pytest.mark.parametrize("argv, message", [
    (["--recipe", "tensorwize"], "argument --recipe: unknown recipe 'tensorwize' (did you mean 'tensorwise'?)"),
    (["--steps", "0"], "argument --steps: 0 is below 1; give 1 or more"),
    (["--noise-seeds", "-1"], "argument --noise-seeds: -1 is below 0"),
    (["--lr", "0"], "argument --lr: 0.0 is not a positive finite number"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--device", "cuda"], "argument --device: cuda, but no CUDA device is visible; use --device cpu (or auto)"),
    (["--out", "{tmp}/missing/loss.png"], "argument --out: the folder {tmp}/missing does not exist"),
    (["--out", "{tmp}"], "argument --out: {tmp} is a folder; give a file name such as {tmp}/loss.png"),
    (["--seq", "20000"], "argument --seq: Batches: seq=20000 does not fit the corpus"),
    (["--recipe", "blockwise", "--batch", "2", "--seq", "32"],
     "argument --recipe: blockwise does not fit --batch 2 x --seq 32 = 64 tokens per step: "),
])
def test_demo_refuses_wrong_flags_before_any_work(argv, message, tmp_path, capsys, monkeypatch):
    from fp8func.demo import _train, main

    def no_work(*args, **kwargs):
        raise AssertionError("the demo built a model before checking its flags")

    monkeypatch.setattr(_train, "build_model", no_work)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = [a.format(tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(["--out", str(tmp_path / "loss.png"), *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: python -m fp8func.demo"), err
    assert f"python -m fp8func.demo: error: {message.format(tmp=tmp_path)}" in err, err


def test_demo_refuses_an_unwritable_out_folder(tmp_path, capsys, monkeypatch):
    from fp8func.demo import main

    monkeypatch.setattr(os, "access", lambda path, mode: path != str(tmp_path))  # root may write anywhere
    with pytest.raises(SystemExit, match="2"):
        main(["--out", str(tmp_path / "loss.png")])
    assert f"argument --out: the folder {tmp_path} is not writable; write elsewhere" in capsys.readouterr().err


def test_demo_help_shows_defaults_in_plain_text(capsys, monkeypatch):
    from fp8func.demo import main

    monkeypatch.setenv("COLUMNS", "200")  # argparse wraps at the terminal's width: one line per option here
    with pytest.raises(SystemExit, match="0"):
        main(["--help"])
    out = capsys.readouterr().out
    assert "{tensorwise,rowwise,rowwise_with_gw_hp,blockwise,mxfp8,delayed}" in out
    for default in ("(default: tensorwise)", "(default: 150)", "(default: fp8_demo_loss.png)", "(default: 1)"):
        assert default in out, default
    assert "``" not in out and "pip install 'fp8func[demo]'" in out


def test_demo_without_its_extra_says_which_one_before_any_work(tmp_path, capsys, monkeypatch):
    import importlib.util

    from fp8func.demo import _train, main

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(_train, "build_model", lambda *a, **k: pytest.fail("built a model without matplotlib"))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    assert main(["--out", str(tmp_path / "loss.png")]) == 1
    printed = capsys.readouterr()
    assert printed.out == "" and printed.err == (
        "python -m fp8func.demo needs matplotlib, which is not installed: pip install 'fp8func[demo]' "
        "(from a clone: pip install -e '.[demo]')\n")


def test_demo_runs_one_bf16_run_per_noise_seed(tmp_path, capsys):
    lines = _demo(tmp_path, capsys, "--noise-seeds", "2", "--seed", "3")
    assert "runs: bf16 and fp8 from seed 3, bf16 from seed 4, 5 (noise reference)" in lines[2]
    assert ("| loss (nats/byte) | bf16 | fp8 | bf16 seed 4 | bf16 seed 5 | fp8 vs bf16 | bf16 seed 4 vs bf16 "
            "| bf16 seed 5 vs bf16 |") in lines
    step1 = [float(v) for v in _row(lines, "step 1")[:4]]
    assert len(set(step1[2:] + step1[:1])) == 3  # three inits: three losses
    assert any("bf16 seed 4, bf16 seed 5 vs bf16 at most" in line for line in lines)
    lines = _demo(tmp_path, capsys, "--noise-seeds", "0")
    assert "| loss (nats/byte) | bf16 | fp8 | fp8 vs bf16 |" in lines
    assert any(line.endswith("no bf16 run with another seed: no noise estimate (--noise-seeds 1 or more).")
               for line in lines)


def _result(name, kind, seed, losses, held=2.0):
    from fp8func.demo._report import RunResult

    return RunResult(name, kind, seed, tuple(losses), held, 1.0)


def test_noise_band_and_verdict():
    from fp8func.demo import _report

    assert _report.noise_envelope([[0.0, 1.0, -2.0, 0.0, 0.0, 0.0]], 1) == [1.0, 2.0, 2.0, 2.0, 0.0, 0.0]
    assert _report.noise_envelope([[0.5, 0.0, 0.0], [0.0, 0.0, -0.7]], 0) == [0.5, 0.0, 0.7]
    ref = [3.0 - 0.01 * i for i in range(40)]
    noisy = [v * (1.02 if i % 2 else 0.98) for i, v in enumerate(ref)]  # +-2% around the reference
    close = [v * 1.005 for v in ref]
    runs = [_result("bf16", "bf16", 0, ref), _result("fp8", "fp8", 0, close), _result("bf16 seed 1", "bf16", 1, noisy)]
    line = _report.verdict(runs)
    assert line.startswith("last 10 steps (mean of 3): fp8 vs bf16 +0.50% on average, at most 0.50%")
    assert "the FP8 gap is within the noise." in line
    far = [v * 1.05 for v in ref]
    runs[1] = _result("fp8", "fp8", 0, far)
    assert "the FP8 gap is larger than the noise." in _report.verdict(runs)


def test_png_draws_bf16_fp8_and_the_seed_band(tmp_path):
    from matplotlib.collections import PolyCollection

    from fp8func.demo import _plot, _report

    ref = [3.0 - 0.01 * i for i in range(80)]
    seed1 = [v * (1.0 + 0.01 * ((i // 10) % 2)) for i, v in enumerate(ref)]  # 0% and 1% in turns of 10 steps
    runs = [_result("bf16", "bf16", 0, ref), _result("fp8", "fp8", 0, [v * 1.002 for v in ref]),
            _result("bf16 seed 1", "bf16", 1, seed1)]
    fig = _plot.figure(runs, "title")
    top, bottom = fig.axes[:2]
    labels = [t.get_text() for t in top.get_legend().get_texts()]
    assert labels == ["bf16 seed spread (seeds 0, 1)", "bf16 (seed 0)", "fp8 (seed 0, same init and batches as bf16)"]
    labels = [t.get_text() for t in bottom.get_legend().get_texts()]
    assert labels[1:] == ["bf16 seed 1 gap", "fp8 gap"] and labels[0].startswith("noise: largest gap")
    dashed = [line for line in top.get_lines() if line.get_label().startswith("fp8")]
    assert dashed[0].get_linestyle() == "--" and dashed[0].get_zorder() > 2  # drawn over bf16, which shows through
    band = next(c for c in bottom.collections if isinstance(c, PolyCollection))
    top_edge = max(band.get_paths()[0].vertices[:, 1])
    half = _report.smoothing(80)
    assert top_edge == pytest.approx(max(_report.noise_envelope([_report.gap_pct(runs[0], runs[2], half)], half)))
    assert top_edge > 0.9  # the 1% turns of seed 1
    _plot.plot(str(tmp_path / "p.png"), runs, "title")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "the blue band is how much two bf16 runs differ" in fig.get_supxlabel()


def test_png_without_noise_runs_draws_no_band_and_says_so():
    from matplotlib.collections import PolyCollection

    from fp8func.demo import _plot

    ref = [3.0 - 0.01 * i for i in range(80)]
    fig = _plot.figure([_result("bf16", "bf16", 0, ref), _result("fp8", "fp8", 0, [v * 1.002 for v in ref])], "t")
    assert not any(isinstance(c, PolyCollection) for ax in fig.axes for c in ax.collections)
    caption = fig.get_supxlabel()
    assert "band" in caption and "blue band is" not in caption
    assert "No bf16 run with another seed (--noise-seeds 0), so no noise band" in caption


def test_check_table_groups_ok_layers_and_names_failures():
    from fp8func.demo._report import check_table
    from fp8func.nn import LayerCheck, Verification

    ok = "FP8 emulated on cpu"
    rows = [LayerCheck(f"model.layers.{i}.mlp.up_proj", True, True, "emulated x3", 0, "-", ok) for i in range(3)]
    rows.append(LayerCheck("model.layers.3.mlp.up_proj", True, False, "high precision x3", 0, "-", "replaced"))
    rows.append(LayerCheck("lm_head", False, True, "high precision x3", 0, "-", "not converted: excluded by filter"))
    table = check_table(Verification(False, tuple(rows), "cpu", "FP8 CHECK FAILED: 1/4")).splitlines()
    assert table[2:] == ["| model.layers.*.mlp.up_proj | 3 | yes | emulated x3 | ok: FP8 emulated on cpu |",
                         "| model.layers.3.mlp.up_proj | 1 | yes | high precision x3 | FAILED: replaced |",
                         "| lm_head | 1 | no | high precision x3 | ok: not converted: excluded by filter |",
                         "FP8 CHECK FAILED: 1/4"]


def test_auto_threads_leave_busy_cores_alone(monkeypatch):
    from fp8func.demo import _train

    monkeypatch.setattr(_train, "_cores", lambda: 2)
    for load, threads in ((0.1, 2), (0.7, 1), (3.5, 1)):
        monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
        assert _train._auto_threads() == (threads, f"of 2 cores, load {load:.1f}")
    monkeypatch.setattr(_train, "_cores", lambda: 64)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert _train._auto_threads()[0] == 4


def test_demo_data_order_is_fixed_and_progress_falls_back(monkeypatch, capsys):
    from fp8func.demo import _report
    from fp8func.demo._data import Batches, load_tokens

    tokens = load_tokens()
    assert len(tokens) == 144_430 and bytes(tokens[:32].tolist()) == b"ALICE'S ADVENTURES IN WONDERLAND"
    a, b = Batches(tokens, steps=4, batch=2, seq=32), Batches(tokens, steps=4, batch=2, seq=32)
    assert all(torch.equal(a[i], b[i]) for i in range(4)) and not torch.equal(a[0], a[1])
    with pytest.raises(ValueError, match=r"seq=20000 does not fit the corpus .* use --seq 14443 or less"):
        Batches(tokens, steps=1, batch=1, seq=20000)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # no tqdm: one line on stderr, rewritten with \r
    bar = _report.progress(range(1, 200), 200, "train", initial=1)
    for i in bar:
        bar.set_postfix_str("loss " + "9" * (i % 3))
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith("\n") and err.count("\r") == 100  # one update per percent
    frames = err[1:-1].split("\r")
    assert frames[0] == "train [                    ] 2/200 loss 9"  # the first item is 1: step 2 of 200
    assert frames[-3:] == ["train [################### ] 196/200 loss  ",
                           "train [################### ] 198/200 loss 99",
                           "train [####################] 200/200 loss 9 "]  # padded over the longer frame before


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
