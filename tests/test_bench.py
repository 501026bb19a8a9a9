"""The whole-model benchmarks (``python -m fp8func.bench model`` and ``fsdp``) end to end on the CPU.

Tiny Llama (2 layers, hidden 128, seq 64, batch 2: 128 tokens, so that the block-scaled recipe
tiles every GEMM), eager unless the test is about compiling; the figures are not checked, the
logic is: configurations, converted layers, losses, the JSON the docs are built from.
"""

import dataclasses
import json
import math

import pytest
import torch

import fp8func as f8
from fp8func.bench import _fsdp, _model, _timeline
from fp8func.bench.__main__ import main as bench_main

TINY = ["--model", "tiny", "--iters", "1", "--warmup", "0"]
STEPS = _model.COMPILE_STEPS + 1  # the compile steps, no warm-up, one timed step
SMALLER = ["--hidden", "64", "--mlp", "128", "--seq", "32"]  # torch's CPU fp8 GEMM (torchao's path) is slow
LAYERS = 2 * 7  # q, k, v, o, gate, up, down per decoder layer; the lm_head stays bf16 by default
ROW_KEYS = {"config", "library", "recipe", "fp8_linears", "linears", "step_ms", "tokens_per_s", "vs_bf16", "vs_torchao",
            "compile_s", "graphs", "peak_gib", "losses", "loss", "loss_step", "bf16_loss", "finite"}


def _run(tmp_path, entry: str, *args: str) -> dict:
    path = tmp_path / f"{entry}.json"
    bench_main([entry, *TINY, *args, "--json", str(path)])
    out = json.loads(path.read_text())
    assert out["environment"]["command"].startswith(f"python -m fp8func.bench {entry} --model tiny")
    assert {"device", "torch", "torchao", "date"} <= set(out["environment"]) and out["complete"]
    return out


def _check_rows(out: dict, names: list[str]) -> dict:
    rows = {r["config"]: r for r in out["rows"]}
    assert list(rows) == names
    bf16 = rows["bf16"]
    for r in rows.values():
        assert ROW_KEYS <= set(r), ROW_KEYS - set(r)
        assert len(r["losses"]) == STEPS and r["finite"] and all(math.isfinite(v) for v in r["losses"])
        assert r["loss"] == r["losses"][-1] and r["bf16_loss"] == bf16["losses"][-1]
        assert r["losses"][-1] < r["losses"][0]  # the Zipf-distributed tokens are learnt within a few steps
        assert abs(r["losses"][-1] - bf16["losses"][-1]) < 0.05, (r["config"], r["losses"], bf16["losses"])
        assert r["step_ms"] > 0 and len(r["compile_s"]) == _model.COMPILE_STEPS and r["linears"] == LAYERS + 1
        assert r["vs_bf16"] == pytest.approx(r["tokens_per_s"] / bf16["tokens_per_s"])
    assert bf16["fp8_linears"] == 0 and bf16["vs_bf16"] == 1.0
    return rows


def _auto_count(spec: dict) -> int:
    model = _model.llama(spec, "cpu", torch.bfloat16)
    f8.convert(model.model, "tensorwise", filter="auto", tokens=spec["batch"] * spec["seq"], fsdp_fp8_all_gather=False)
    return sum(r.converted for r in f8.report(model, print_table=False))


@pytest.mark.slow
def test_model_bench_runs_every_fp8func_config_and_writes_json(tmp_path, capsys):
    names = ["bf16", "tensorwise", "rowwise", "blockwise", "delayed", "auto"]
    out = _run(tmp_path, "model", "--compile", "none", "--configs", ",".join(names))
    rows = _check_rows(out, names)
    for name in ("tensorwise", "rowwise", "blockwise", "delayed"):
        assert rows[name]["fp8_linears"] == LAYERS, rows[name]
        assert rows[name]["losses"] != rows["bf16"]["losses"]  # FP8 really ran
        assert rows[name]["vs_torchao"] is None  # no torchao configuration asked for
    assert rows["auto"]["fp8_linears"] == _auto_count(out["model"])
    assert "bf16 parameters" in out["setup"] and "lm_head bf16" in out["setup"]
    printed = capsys.readouterr().out
    assert "| config | FP8 linears | ms/step |" in printed and "| blockwise | 14/15 |" in printed


def test_fastfwd_model_configs_run_the_output_gemm_in_fast_accumulation():
    """``<recipe>+fastfwd``: the recipe with its output GEMM in fast accumulation, the GEMM
    configuration of torchao's tensorwise, compared with it; under FSDP2 a delayed weight is
    cast dynamically, as for the plain recipe."""
    for name in ("tensorwise+fastfwd", "delayed+fastfwd"):
        base = f8.Recipe.from_name(name.removesuffix("+fastfwd"))
        assert _model.fp8func_recipe(_model.CONFIGS[name][1]) == dataclasses.replace(base, fast_accum=("output",))
        assert _model.torchao_peer(name) == "torchao-tensorwise"
    assert _model.fp8func_recipe("delayed+fastfwd", fsdp=True).delayed.weight is False
    assert _model.fp8func_recipe("delayed", fsdp=True) == f8.Recipe.from_name(
        "delayed", delayed=f8.DelayedScaling(weight=False))


@pytest.mark.slow
def test_model_bench_against_torchao_with_an_fp8_lm_head(tmp_path):
    names = ["bf16", "torchao-tensorwise", "tensorwise", "delayed"]
    out = _run(tmp_path, "model", *SMALLER, "--compile", "none", "--fp8-lm-head", "--configs", ",".join(names))
    rows = _check_rows(out, names)
    assert [rows[n]["fp8_linears"] for n in names] == [0, LAYERS + 1, LAYERS + 1, LAYERS + 1]
    for name in ("tensorwise", "delayed"):  # delayed is compared with torchao's dynamic tensorwise
        assert rows[name]["torchao_peer"] == "torchao-tensorwise"
        want = rows[name]["tokens_per_s"] / rows["torchao-tensorwise"]["tokens_per_s"]
        assert rows[name]["vs_torchao"] == pytest.approx(want)
    assert "lm_head FP8" in out["setup"]


@pytest.mark.slow
# dynamo probes ``hasattr(t, "grad")`` on the layer's input (a non-leaf) inside a filter meant to
# hide this warning, which pytest's warnings-as-errors turns into an error first.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
def test_model_bench_per_block_compile(tmp_path):
    out = _run(tmp_path, "model", "--configs", "bf16,tensorwise")  # --compile block is the default
    rows = _check_rows(out, ["bf16", "tensorwise"])
    assert all(r["graphs"] >= 2 for r in rows.values())  # the decoder layers and the loss ran compiled
    assert "compile: each decoder layer and the loss compiled on their own" in out["setup"]


@pytest.mark.slow
def test_fsdp_bench_one_rank_on_and_off(tmp_path, capsys):
    names = ["bf16", "tensorwise", "tensorwise-off", "rowwise", "rowwise-off", "delayed", "delayed-off"]
    out = _run(tmp_path, "fsdp", "--compile", "none", "--configs", ",".join(names))
    rows = _check_rows(out, names)
    for name in names[1:]:
        r = rows[name]
        assert r["fp8_linears"] == LAYERS and r["fp8_all_gather"] == (not name.endswith("-off"))
        assert r["precompute"] == (name in ("tensorwise", "delayed"))  # tensorwise weights only, gather on
        assert r["fsdp_unshard_host_ms"] > 0
        if r["fp8_all_gather"]:  # docs/fsdp.md's contract: on and off train bitwise alike
            assert r["loss_equals_off"] is True and r["vs_off"] == pytest.approx(
                r["tokens_per_s"] / rows[name + "-off"]["tokens_per_s"])
        else:
            assert r["vs_off"] is None and r["loss_equals_off"] is None
    assert "fp32 master weights" in out["setup"] and "one-rank mesh" in out["setup"]
    assert "| tensorwise | on + precomputed scales | 14/15 |" in capsys.readouterr().out
    assert not torch.distributed.is_initialized()  # the entry's own process group is gone


@pytest.mark.slow
def test_fsdp_bench_against_torchao(tmp_path):
    names = ["bf16", "torchao-tensorwise", "tensorwise"]
    rows = _check_rows(_run(tmp_path, "fsdp", *SMALLER, "--compile", "none", "--configs", ",".join(names)), names)
    ao = rows["torchao-tensorwise"]
    assert ao["fp8_linears"] == LAYERS and ao["fp8_all_gather"] and ao["precompute"]
    assert rows["tensorwise"]["vs_torchao"] == pytest.approx(rows["tensorwise"]["tokens_per_s"] / ao["tokens_per_s"])


@pytest.mark.parametrize("name,cls", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "GEMM bf16"),
    ("nvjet_qqtst_128x256_128x6_2x1_2cta_v_bz_TNT", "GEMM fp8"),
    ("nvjet_sm90_qrtst_128x160_128x5_2x1_v_bz_coopA_algo2_TNT", "GEMM fp8"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", "GEMM bf16"),
    ("sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize128x128x128", "GEMM fp8"),
    ("void cutlass::device_kernel<f8f8bf16_rowwise_kernel>", "GEMM fp8"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "GEMM bf16"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "attention"),
    ("_cast_kernel", "fp8func casts"), ("_amax_flat_kernel", "fp8func casts"), ("_quant_t_kernel", "fp8func casts"),
    ("triton_red_fused__to_copy_abs_amax_0", "inductor/triton fused"),
    ("triton_poi_fused__scaled_mm__to_copy_clamp_mul_reciprocal_silu_t_view_16", "inductor/triton fused"),
    ("triton_red_fused__scaled_mm__to_copy_abs_add_clamp_max_mul_reciprocal_sum_t_view_5", "inductor/triton fused"),
    ("triton_tem_fused__scaled_mm_0", "GEMM fp8"), ("triton_tem_fused_mm_1", "GEMM bf16"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("void at::native::elementwise_kernel<128, 2>", "other"),
])
def test_profile_kernel_classes(name, cls):
    assert _model.kernel_class(name) == cls


def test_timeline_summary_finds_where_the_gpu_waited_for_the_host():
    """Two layers: the host makes the forward's marks as the GPU reaches them (host-bound), and
    runs ahead through the backward (GPU-bound)."""
    marks = [("start", 0.0, 0.0), ("f0", 1.0, 1.0), ("f1", 3.0, 3.05), ("norm", 5.0, 5.0),
             ("b1", 6.0, 9.0), ("b0", 6.5, 14.0), ("end", 7.0, 16.0)]
    t = _timeline.summarize(marks)
    assert t["forward"] == {"host_ms": 4.0, "gpu_ms": 4.0, "lag_ms": 0.0}
    assert t["backward"] == {"host_ms": 0.5, "gpu_ms": 5.0, "lag_ms": 7.5}
    assert t["first_layer_gpu_ms"] == 1.0 and t["step_gpu_ms"] == 16.0
    assert _timeline._median([t, dict(t, step_gpu_ms=20.0), dict(t, step_gpu_ms=18.0)])["step_gpu_ms"] == 18.0
    lines = _timeline.table([{"config": "bf16"}, {"config": "tensorwise", "timeline": t}])
    assert lines[-1] == "| tensorwise | 4.0 / 4.0 | 0.0 | 0.5 / 5.0 | 7.5 | 1.0 | 16.0 |"


def test_gpu_waits_splits_idle_gpu_time_into_host_and_dependency():
    def kernel(name, ts, dur, corr):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def launch(ts, dur, corr):
        return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": dur,
                "args": {"correlation": corr}}

    events = [kernel("gemm", 0, 10, 1), launch(-5, 2, 1),
              kernel("cast", 30, 10, 2), launch(20, 5, 2),      # idle 10-30: launched at 25 (15 host, 5 other)
              kernel("gemm", 100, 20, 3), launch(11, 1, 3),     # idle 40-100: launched long before (60 other)
              kernel("ncclDevKernel_AllGather", 35, 60, 4), {"ph": "i", "name": "marker", "ts": 0},
              dict(launch(50, 8, 5), name="cudaStreamSynchronize"), dict(launch(60, 4, 6), name="cudaMemcpy"),
              dict(launch(70, 3, 7), name="cudaMemcpyAsync")]  # the host waits 8 + 4 us (an async copy: no)
    w = _timeline.gpu_waits(events, steps=2)
    # NCCL 35-95 beside compute 30-40 only: 55 us of it exposed over the two steps
    assert w == {"compute_kernels": 1.5, "compute_busy_ms": 0.02, "nccl_busy_ms": 0.03, "nccl_exposed_ms": 0.0275,
                 "idle_host_ms": 0.0075, "idle_dependency_ms": 0.0325, "host_sync_ms": 0.006, "span_ms": 0.06}
    with pytest.raises(ValueError, match="no CUDA kernel"):
        _timeline.gpu_waits([launch(0, 1, 1)], steps=1)


def test_step_profile_classes_kernels_and_collectives():
    """``step_profile`` over a finished profiler: GPU ms and calls per step by class (NCCL by
    collective), the largest kernels of each class, the host's heaviest ops, async TP's fused ops."""
    import json
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    kernels = [("nvjet_sm90_qqtst_128x256", 0, 400.0), ("nvjet_sm90_tst_128x256", 500, 300.0),
               ("ncclDevKernel_AllGather_RING_LL", 450, 600.0), ("ncclDevKernel_ReduceScatter_Sum_f32", 1100, 100.0),
               ("triton_red_fused_abs_amax_0", 1300, 50.0), ("nvjet_sm90_qqtst_128x256", 1400, 400.0)]

    class Prof:
        def events(self):
            return [SimpleNamespace(device_type=cuda, name=n, device_time=d) for n, _, d in kernels] + [
                SimpleNamespace(device_type=cpu, name="symm_mem::fused_all_gather_scaled_matmul", device_time=0)]

        def key_averages(self):
            return [SimpleNamespace(key="aten::_scaled_mm", self_cpu_time_total=300.0, count=4),
                    SimpleNamespace(key="FSDP::pre_forward", self_cpu_time_total=900.0, count=2)]

        def export_chrome_trace(self, path):
            with open(path, "w") as fh:
                json.dump({"traceEvents": [{"ph": "X", "cat": "kernel", "name": n, "ts": ts, "dur": d, "args": {}}
                                           for n, ts, d in kernels]}, fh)

    p = _timeline.step_profile(Prof(), steps=2)
    assert p["classes"] == {"GEMM fp8": (0.4, 1.0), "GEMM bf16": (0.15, 0.5), "NCCL allgather": (0.3, 0.5),
                            "NCCL reducescatter": (0.05, 0.5), "inductor/triton fused": (0.025, 0.5)}
    assert p["top_kernels"]["GEMM fp8"] == [("nvjet_sm90_qqtst_128x256", 0.4, 1.0)]
    assert p["host_ops"] == [("FSDP::pre_forward", 0.45, 1.0), ("aten::_scaled_mm", 0.15, 2.0)]
    assert p["symm_mem_ops"] == 0.5
    # compute 0-400, 500-800, 1300-1350, 1400-1800; NCCL 450-1050 and 1100-1200: exposed 450-500,
    # 800-1050 and 1100-1200, 400 us over the two steps
    assert p["waits"]["nccl_exposed_ms"] == pytest.approx(0.2)


def test_timeline_marks_leave_a_layer_unchanged():
    """The wrapper marks the forward and, through a hook on the output, the backward, and changes
    neither the output nor any gradient."""

    class Names(list):
        add = list.append

    torch.manual_seed(0)
    layer, x, names = torch.nn.Linear(8, 8), torch.randn(4, 8, requires_grad=True), Names()
    y = _timeline._Marked(layer, 3, names)(x)
    assert torch.equal(y, layer(x)) and names == ["f3"]
    y.square().sum().backward()
    grads = [x.grad.clone(), layer.weight.grad.clone()]
    x.grad = layer.weight.grad = layer.bias.grad = None
    layer(x).square().sum().backward()
    assert names == ["f3", "b3"] and torch.equal(grads[0], x.grad) and torch.equal(grads[1], layer.weight.grad)


def test_bench_entries_refuse_unknown_configs_and_cpu_profiles(capsys):
    with pytest.raises(SystemExit):
        _model.main([*TINY, "--configs", "bf16,fp4"])
    assert "unknown ['fp4']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _fsdp.main([*TINY, "--device", "cpu", "--profile"])
    assert "--profile reads GPU kernel times" in capsys.readouterr().err
    for args in (["--device", "cpu", "--timeline"], ["--device", "cuda", "--compile", "model", "--timeline"]):
        with pytest.raises(SystemExit):
            _model.main([*TINY, *args])
        assert "--timeline marks each decoder layer" in capsys.readouterr().err
