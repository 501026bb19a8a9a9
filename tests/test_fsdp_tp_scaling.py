"""examples/fsdp_tp_scaling.py run CI-sized: 4 gloo processes (dp2 x tp2), a tiny Llama, 3 steps.

The script's JSON says, per configuration: finite losses, fp8func's FSDP2 fp8 all-gather on ==
off bitwise (tensorwise, rowwise, and delayed scaling with a dynamic weight), and the all-gathered
bytes the c10d flight recorder saw.
torchao is left out: its TP styles and its FSDP2 all-gather move float8 tensors, which gloo cannot
(the script reports such a run n/a; on NCCL it runs). Activation checkpointing (``--ac``) runs on
2 processes; the MFU formula is checked in one process (the only test here not marked slow)."""

import argparse
import json
import os
import pathlib
import subprocess
import sys

import pytest

from .examples import load_example

ROOT = pathlib.Path(__file__).parents[1]
CONFIGS = ["bf16", "fp8func-tensorwise", "fp8func-tensorwise-off", "fp8func-rowwise", "fp8func-rowwise-off",
           "fp8func-delayed", "fp8func-delayed-off", "fp8func-tensorwise-local", "fp8func-tensorwise-local-off"]
STEPS = 3
ARGV = ["--device", "cpu", "--tp", "2", "--hidden", "128", "--intermediate", "256", "--layers", "2", "--heads", "4",
        "--kv-heads", "4", "--vocab", "256", "--seq", "128", "--batch", "2", "--steps", str(STEPS), "--warmup", "1",
        "--bytes-steps", "2", "--configs", ",".join(CONFIGS)]


def _run_script(tmp_path, argv=ARGV, first="bf16", nproc=4) -> dict:
    out = tmp_path / "scaling.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1", TORCHINDUCTOR_COMPILE_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "examples" / "fsdp_tp_scaling.py"), *argv, "--json", str(out)]
    # Compiled configurations on four processes take minutes on 2 cores: a hang, not a slow
    # machine, is what the limit is for.
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert f"| {first} | " in proc.stdout, proc.stdout[-3000:]  # the markdown table
    return json.loads(out.read_text())


@pytest.mark.slow  # spawns processes (torchrun), as every test here but the MFU one
def test_fsdp_tp_scaling_script_on_cpu(tmp_path):
    result = _run_script(tmp_path)
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == CONFIGS
    assert result["environment"]["mesh"] == "dp=2 x tp=2"
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["finite"] and len(r["losses"]) == STEPS, (name, r["losses"])
        assert r["tokens_per_s"] > 0 and r["gather_bytes_dp"] > 0 and r["gather_bytes_tp"] > 0, r
    for recipe in ("tensorwise", "rowwise", "delayed", "tensorwise-local"):
        on, off = rows[f"fp8func-{recipe}"], rows[f"fp8func-{recipe}-off"]
        # docs/fsdp.md's contract under 2-D: the fp8 all-gather changes no loss, bitwise.
        assert on["on_equals_off"] is True and off["on_equals_off"] is True, (on["losses"], off["losses"])
        assert on["losses"] == off["losses"]
        # FSDP2 moves fp8 weights over dp (1 byte per element, + row scales for rowwise); off moves
        # bf16 weights, exactly what the bf16 model gathers.
        assert on["gather_bytes_dp"] < 0.6 * rows["bf16"]["gather_bytes_dp"], (on["gather_bytes_dp"], rows["bf16"])
        assert off["gather_bytes_dp"] == rows["bf16"]["gather_bytes_dp"]
        # The sequence-parallel gathers over tp do not depend on FSDP2's setting.
        assert on["gather_bytes_tp"] == off["gather_bytes_tp"]
    # Tensorwise activations and grad_outputs travel over tp as fp8 (row-wise sends two casts);
    # delayed layers take the stock styles (they cast their own input): bf16 over tp.
    assert rows["fp8func-tensorwise"]["gather_bytes_tp"] < rows["bf16"]["gather_bytes_tp"]
    assert rows["fp8func-delayed"]["gather_bytes_tp"] == rows["bf16"]["gather_bytes_tp"]
    # The flight recorder's dp bytes are FSDP2's all-gathers, counted a second way at the call (row-wise
    # fp8 weights' row scales travel in the same all-gather as their payloads).
    for name in CONFIGS:
        assert rows[name]["gather_bytes_dp"] == rows[name]["fsdp_gather_bytes_counted"], rows[name]
    # Amax all-reduces over tp per step and rank, beyond bf16's: the precomputed weight scales' one;
    # global tensorwise scales add 11 per layer (the 4 sequence gathers and o_proj's and down's
    # inputs, forward; the 5 column-parallel grad_outputs, backward), TP-local scales none.
    bf16_reduces = rows["bf16"]["collective_calls"]["tp all_reduce"]
    tp_reduces = {name: rows[name]["collective_calls"]["tp all_reduce"] - bf16_reduces
                  for name in ("fp8func-tensorwise", "fp8func-tensorwise-local")}
    assert tp_reduces == {"fp8func-tensorwise": 1 + 2 * 11, "fp8func-tensorwise-local": 1}, tp_reduces
    # TP-local scales move the same bytes over tp, and a 4-byte scale per rank's chunk of each
    # sequence: 2 layers x 4 sequence gathers x batch 2
    local, glob = rows["fp8func-tensorwise-local"], rows["fp8func-tensorwise"]
    assert local["gather_bytes_tp"] - glob["gather_bytes_tp"] == 2 * 4 * 2 * 4, (local, glob)


COMPILED = ["bf16", "fp8func-tensorwise-stock", "fp8func-tensorwise-stock-off", "fp8func-rowwise-stock",
            "fp8func-delayed", "fp8func-tensorwise", "fp8func-rowwise", "fp8func-tensorwise-local"]
COMPILED_ARGV = [*ARGV[:ARGV.index("--steps")], "--steps", "2", "--warmup", "1", "--bytes-steps", "1", "--compile"]


@pytest.mark.slow
def test_compiled_layers_graph_breaks_and_collectives(tmp_path):
    """The example compiled per decoder layer on 4 gloo processes (dp2 x tp2, 2 layers): graph
    breaks from torch._dynamo's counters and collectives per step and rank from c10d's flight
    recorder, each configuration against bf16's. Dynamo makes the graphs (and their breaks) and
    AOTAutograd puts the collectives in them, so the aot_eager backend gives inductor's counts
    and bytes, without inductor's code generation (a third of the time); inductor's own run is
    the next test."""
    argv = [*COMPILED_ARGV, "--compile-backend", "aot_eager", "--configs", ",".join(COMPILED)]
    rows = {r["config"]: r for r in _run_script(tmp_path, argv)["rows"]}
    assert list(rows) == COMPILED
    bf16 = rows["bf16"]
    assert bf16["graph_breaks"] == 0 and bf16["graphs"] == 2, (bf16["graph_breaks"], bf16["graph_break_reasons"])
    for name, r in rows.items():
        assert "error" not in r and r["finite"], (name, r.get("error"), r["losses"])
        # One graph per layer, no break, as bf16: the stock TP styles on fp8func layers (FSDP2 fp8
        # all-gather on or off, delayed scaling) and the fp8func sequence-parallel styles alike.
        assert r["graph_breaks"] == 0 and r["graphs"] == bf16["graphs"], (name, r["graph_break_reasons"])
        calls, ref = r["collective_calls"], bf16["collective_calls"]
        # FSDP2: one all-gather per unshard, as bf16 (row-wise row scales ride in the payload's).
        assert calls["dp all_gather"] == ref["dp all_gather"], (name, calls)
        # Over tp, one all-gather where bf16 has one: the stock styles gather bf16 activations as the
        # bf16 model does; the fp8func sequence-parallel styles send each gather's casts and their
        # per-token scales (row-wise) in one collective.
        assert calls["tp all_gather"] == ref["tp all_gather"] or name == "fp8func-delayed", (name, calls)
    on, off = rows["fp8func-tensorwise-stock"], rows["fp8func-tensorwise-stock-off"]
    assert on["losses"] == off["losses"]  # compiled, FSDP2's fp8 all-gather changes no loss either
    assert on["gather_bytes_dp"] < 0.6 * bf16["gather_bytes_dp"] and off["gather_bytes_dp"] == bf16["gather_bytes_dp"]

    def extra(name, group_kind):
        return rows[name]["collective_calls"][group_kind] - bf16["collective_calls"][group_kind]

    # Amax all-reduces over tp, per layer, for a tensorwise scale spanning TP shards: the inputs of
    # o_proj and down (sharded along K) and the grad_outputs of q, k, v, gate and up (along N),
    # 7 per layer; plus one for the weights' precomputed scales (one over dp, one over tp).
    assert extra("fp8func-tensorwise-stock", "tp all_reduce") == 2 * 7 + 1
    assert extra("fp8func-tensorwise-stock", "dp all_reduce") == 1
    # With FSDP2's fp8 all-gather off, each TP-sharded weight's amax is reduced inside its layer
    # (7 per layer over tp), and nothing is precomputed.
    assert extra("fp8func-tensorwise-stock-off", "tp all_reduce") == 2 * (7 + 7)
    assert extra("fp8func-tensorwise-stock-off", "dp all_reduce") == 0
    # Row-wise: the same 7 activation rows per layer; the weights' scales that span shards are
    # precomputed after the optimizer step, one all-reduce per kind of reduction for all weights:
    # the column scales (w_t) of q, k, v, gate and up (rows split over dp and tp), the row scales
    # (w) of o and down (rows split over tp) and their column scales (over dp): 2 over dp, 2 over tp.
    assert extra("fp8func-rowwise-stock", "tp all_reduce") == 2 * 7 + 2
    assert extra("fp8func-rowwise-stock", "dp all_reduce") == 2
    # The fp8func sequence-parallel styles, compiled: each sequence gather of bf16 (the inputs of
    # q/k/v and gate/up, the grad_outputs of o_proj and down) becomes an FP8 one, at fewer bytes.
    # Per layer 4 gathers of [batch, seq / tp, hidden] per rank; 1 byte per element instead of 2.
    batch, seq, hidden = (int(COMPILED_ARGV[COMPILED_ARGV.index(k) + 1]) for k in ("--batch", "--seq", "--hidden"))
    saved = 2 * 4 * batch * seq // 2 * hidden
    sp = rows["fp8func-tensorwise"]
    assert bf16["gather_bytes_tp"] - sp["gather_bytes_tp"] == saved, (sp["gather_bytes_tp"], bf16["gather_bytes_tp"])
    # Row-wise sends two casts (x along K, per-token scales; x along M, for grad_weight): bf16's bytes.
    assert rows["fp8func-rowwise"]["gather_bytes_tp"] >= bf16["gather_bytes_tp"]
    # TP-local scales, compiled: no amax all-reduce over tp inside the layers; the one left is the
    # weights' scales, precomputed after the optimizer step (and its one over dp).
    assert extra("fp8func-tensorwise", "tp all_reduce") == 2 * 11 + 1
    assert extra("fp8func-tensorwise-local", "tp all_reduce") == 1
    assert extra("fp8func-tensorwise-local", "dp all_reduce") == 1


@pytest.mark.slow
def test_compiled_with_inductor_the_fp8_all_gather_changes_no_loss(tmp_path):
    """The stock TP styles on fp8func layers, each decoder layer compiled by inductor, FSDP2's fp8
    all-gather on and off: one graph per layer without a break, and bitwise the same losses."""
    names = ["fp8func-tensorwise-stock", "fp8func-tensorwise-stock-off"]
    argv = [*COMPILED_ARGV, "--compile-backend", "inductor", "--configs", ",".join(names)]
    result = _run_script(tmp_path, argv, first=names[0])
    assert result["environment"]["compile"] == "True (inductor)"
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == names
    on, off = rows[names[0]], rows[names[1]]
    for name, r in rows.items():
        assert "error" not in r and r["finite"], (name, r.get("error"), r["losses"])
        assert r["graph_breaks"] == 0 and r["graphs"] == 2, (name, r["graph_break_reasons"])
    assert on["losses"] == off["losses"] and on["on_equals_off"] is True
    assert on["gather_bytes_dp"] < 0.6 * off["gather_bytes_dp"]


AC_CONFIGS = ["bf16", "fp8func-tensorwise", "fp8func-tensorwise-off", "fp8func-rowwise", "fp8func-delayed"]


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 1])
def test_activation_checkpointing_full_and_selective(tmp_path, tp):
    """``--ac none / full / selective`` on 2 gloo processes (dp1 x tp2, dp2 x tp1), eager: each
    decoder layer checkpointed after TP and before FSDP2. Finite losses, bitwise those without
    checkpointing (recomputation changes memory, not numbers), and fp8func tensorwise's FSDP2 fp8
    all-gather still changes no loss. A row-wise layer with the fp8 all-gather on refuses the
    recomputed forward (docs/fsdp.md): its row says so, n/a, and the run goes on. Delayed scaling
    runs under full checkpointing, bitwise; under selective with TP, the recomputed layer passes the
    state its forward returned, so its ops differ from the forward's and the selective cache misses
    (with one TP rank the layers are FSDP2's alone, no TP styles, and it runs, bitwise)."""
    argv = [*ARGV[:ARGV.index("--configs")], "--tp", str(tp), "--configs", ",".join(AC_CONFIGS)]
    runs = {}
    for ac in ("none", "full", "selective"):
        result = _run_script(tmp_path, [*argv, "--ac", ac], nproc=2)
        assert result["environment"]["activation checkpointing"] == ac
        assert result["environment"]["mesh"] == f"dp={2 // tp} x tp={tp}"
        runs[ac] = {r["config"]: r for r in result["rows"]}
    for ac, rows in runs.items():
        assert list(rows) == AC_CONFIGS
        for name in AC_CONFIGS[:3]:
            r = rows[name]
            assert "error" not in r and r["finite"] and len(r["losses"]) == STEPS, (ac, name, r.get("error"))
            assert r["losses"] == runs["none"][name]["losses"], (ac, name)
        on, off = rows["fp8func-tensorwise"], rows["fp8func-tensorwise-off"]
        assert on["on_equals_off"] is True and on["losses"] == off["losses"], (ac, on["losses"], off["losses"])
        rowwise = rows["fp8func-rowwise"]
        if ac == "none":
            assert "error" not in rowwise and rowwise["finite"], rowwise.get("error")
        else:
            assert "activation checkpointing recomputes the forward" in rowwise["error"], rowwise.get("error")
        delayed = rows["fp8func-delayed"]
        if ac == "selective" and tp > 1:  # the state's buffers are DTensors of the TP mesh there
            assert "not found in storage" in delayed["error"], delayed.get("error")
        else:
            assert "error" not in delayed and delayed["losses"] == runs["none"]["fp8func-delayed"]["losses"], delayed


@pytest.mark.slow
def test_selective_activation_checkpointing_compiled(tmp_path):
    """``--ac selective --compile`` (aot_eager: dynamo's graphs and AOTAutograd's partition, the
    selective policy applied there) on dp1 x tp2: one graph per layer, no break, finite losses,
    fp8func tensorwise on == off bitwise."""
    names = AC_CONFIGS[:3]
    argv = [*COMPILED_ARGV, "--compile-backend", "aot_eager", "--ac", "selective", "--configs", ",".join(names)]
    rows = {r["config"]: r for r in _run_script(tmp_path, argv, nproc=2)["rows"]}
    assert list(rows) == names
    for name, r in rows.items():
        assert "error" not in r and r["finite"], (name, r.get("error"))
        assert r["graph_breaks"] == 0 and r["graphs"] == 2, (name, r["graph_break_reasons"])
    assert rows["fp8func-tensorwise"]["on_equals_off"] is True


def test_mfu_formula_on_llama3_8b(monkeypatch):
    """The MFU column's FLOPs per token at Llama-3-8B's sizes against its published parameter
    count, and the peak FLOP/s it divides by."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # the example imports _common, tp_fp8_parity
    ex = load_example("fsdp_tp_scaling")
    args = argparse.Namespace(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256,
                              seq=8192, device="cuda", peak_tflops=None)
    # Llama-3-8B: 8,030,261,248 parameters; no matmul in the embedding (vocab x hidden) nor in the
    # 2 x 32 + 1 RMSNorm weights.
    matmul_params = 8_030_261_248 - 128256 * 4096 - 65 * 4096
    per_token = 6 * matmul_params + 12 * 32 * 4096 * 8192
    assert ex.flops_per_token(args) == per_token == 57_912_852_480
    # 8 GPUs at 989 TFLOP/s each, running 40% of that in model FLOPs:
    tokens_per_s = 0.4 * 8 * 989e12 / per_token
    assert ex.mfu(tokens_per_s, args, 8, 989e12) == pytest.approx(0.4)
    assert ex.mfu(tokens_per_s, args, 8, None) is None
    for name, peak in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H200", 989e12), ("NVIDIA H100 PCIe", None),
                       ("NVIDIA A100-SXM4-80GB", None)):
        monkeypatch.setattr("torch.cuda.get_device_name", lambda *a, _n=name: _n)
        assert ex.peak_flops(args) == peak, name
    args.device = "cpu"
    assert ex.peak_flops(args) is None
    args.peak_tflops = 500.0
    assert ex.peak_flops(args) == 500e12


def test_profile_table_and_async_tp_arguments(monkeypatch, capsys):
    """``--profile``'s table (one row per profiled configuration, NCCL columns per collective seen)
    and ``--async-tp``'s refusal where it cannot apply, with what it needs."""
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    ex = load_example("fsdp_tp_scaling")
    waits = {"span_ms": 100.0, "nccl_exposed_ms": 5.0, "idle_host_ms": 20.0, "idle_dependency_ms": 3.0}
    rows = [{"config": "bf16", "profile": {"classes": {"GEMM bf16": (60.0, 12.0), "NCCL allgather": (9.0, 4.0)},
                                           "waits": waits, "symm_mem_ops": 0.0}},
            {"config": "torchao", "error": "n/a"},
            {"config": "fp8func-tensorwise", "profile": {"classes": {"GEMM fp8": (30.5, 12.0),
                                                                     "NCCL allreduce": (1.25, 40.0)},
                                                         "waits": waits, "symm_mem_ops": 8.0,
                                                         "span_ms_by_rank": [100.0, 98.5, 131.25]}}]
    lines = ex.profile_table(rows)
    header, rule, bf16, fp8 = lines[-4:]
    assert header.split(" | ")[-5:-3] == ["NCCL allgather", "NCCL allreduce"], header
    assert rule.count("---") == header.count("|") - 1
    assert bf16 == ("| bf16 | 100.0 (100.0-100.0) | 0.0 (0) | 60.0 (12) | 0.0 (0) | 0.0 (0) | 0.0 (0) | 0.0 (0) | "
                    "0.0 (0) | 9.0 (4) | 0.0 (0) | 5.0 | 20.0 / 3.0 | 0 |")
    assert fp8.startswith("| fp8func-tensorwise | 100.0 (98.5-131.2) | 30.5 (12) |")
    assert fp8.endswith("| 0.0 (0) | 1.2 (40) | 5.0 | 20.0 / 3.0 | 8 |")
    for argv, needs in ((["--device", "cpu", "--compile", "--async-tp"], "--device cuda"),
                        (["--device", "cuda", "--no-compile", "--async-tp"], "--compile"),
                        (["--device", "cuda", "--tp", "1", "--async-tp"], "--tp > 1"),
                        (["--device", "cpu", "--profile"], "needs --device cuda")):
        monkeypatch.setattr("sys.argv", ["fsdp_tp_scaling.py", *argv])
        with pytest.raises(SystemExit):
            ex.parse_args()
        assert needs in capsys.readouterr().err, argv
