"""NumericsStats: values against direct computations, intervals, removal, compile, unchanged numerics."""

import json
import logging
import math

import pytest
import torch
from torch import nn

import fp8func as f8
import fp8func.nn._stats as stats_mod
from fp8func import stats_plot
from fp8func.nn._stats import NumericsStats, tensor_stats
from fp8func.stats_plot import main as plot_main

from .models import batch, tiny_qwen3

E4M3_SUBNORMAL = 2.0 ** -9  # smallest positive e4m3fn value; |v| <= half of it rounds to 0 (ties to even)


def _mlp(recipe="tensorwise", seed=0):
    torch.manual_seed(seed)
    return f8.convert(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)), recipe)


def _x(i, shape=(16, 32)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(i))


def test_tensor_stats_match_direct_computations():
    x = _x(0, (64, 128)) * torch.logspace(-6, 0, 128)  # wide dynamic range: some values underflow
    x[0, :5] = 0.0  # zeros are not underflow
    spec = f8.CastSpec(f8.E4M3)
    s = tensor_stats(x, spec)
    amax = x.abs().max()
    scale = amax * (1.0 / 448.0)
    assert s["amax"] == float(amax)
    assert s["scale"] == s["scale_min"] == float(f8.quantize(x, spec).scale)
    assert s["scale"] == pytest.approx(float(scale), rel=1e-6)
    ratio = x.abs().double() / s["scale"]
    nonzero = x != 0
    expect_uf = 100.0 * int((nonzero & (ratio <= E4M3_SUBNORMAL / 2)).sum()) / int(nonzero.sum())
    assert s["underflow_pct"] == pytest.approx(expect_uf, abs=1e-9) and s["underflow_pct"] > 1.0
    assert s["saturation_pct"] == 0.0  # dynamic scaling: amax maps to fp8_max
    assert s["top_binade_pct"] == pytest.approx(100.0 * int((ratio >= 224).sum()) / x.numel())
    deq = f8.dequantize(f8.quantize(x, spec), torch.float32)
    assert s["sqnr_db"] == f8.sqnr(x, deq)
    assert tensor_stats(torch.zeros(4, 16), spec)["underflow_pct"] == 0.0


def test_rowwise_scale_range_and_given_scale_saturates():
    x = _x(1, (8, 32)) * torch.arange(1, 9).float()[:, None]
    row = f8.Recipe.from_name("rowwise").input
    s = tensor_stats(x, row)
    q = f8.quantize(x, row)
    assert (s["scale"], s["scale_min"]) == (float(q.scale.max()), float(q.scale.min()))
    scale = torch.full((1, 1), float(x.abs().max()) / 4 / 448)  # a stale scale 4x too small
    s = tensor_stats(x, f8.CastSpec(), scale)
    assert s["scale"] == float(scale)
    assert s["saturation_pct"] == pytest.approx(100.0 * int((x.abs() / scale > 448).sum()) / x.numel(), abs=1e-9)
    assert s["saturation_pct"] > 0


def test_layer_records_x_w_dy_as_the_layer_casts_them():
    net = _mlp()
    with NumericsStats(net, every=1) as stats:
        x = _x(2, (2, 8, 32))  # 3-D: the layer casts x as [-1, K]
        g = _x(3, (2, 8, 32))
        (net(x) * g).sum().backward()  # dy of the last layer is g
    by = {(r["layer"], r["tensor"]): r for r in stats.records}
    assert set(by) == {(lay, t) for lay in ("0", "2") for t in ("x", "w", "dy")}
    assert by["0", "x"]["amax"] == float(x.abs().max())
    assert by["0", "w"]["amax"] == float(net[0].weight.detach().abs().max())
    assert by["2", "dy"]["amax"] == float(g.abs().max())
    spec = net[2].recipe.grad_output
    assert by["2", "dy"]["sqnr_db"] == f8.sqnr(g, f8.dequantize(f8.quantize(g.reshape(-1, 32), spec)).reshape(g.shape))
    assert by["2", "dy"]["scale"] == float(f8.quantize(g.reshape(-1, 32), spec).scale)
    assert all(r["step"] == 0 for r in stats.records)


def test_delayed_recipe_uses_the_state_scale_and_reports_saturation():
    layer = f8.nn.Fp8Linear(32, 32, recipe="delayed")
    stats = NumericsStats(layer, every=1)
    layer(_x(4)).sum().backward()  # records amax of a unit-scale input
    stats.step()
    state_scale = layer.fp8_x_scale.detach().clone()
    big = _x(5) * 8  # 8x larger than the history: the delayed scale saturates it
    layer(big).sum().backward()
    rec = [r for r in stats.records if r["step"] == 1 and r["tensor"] == "x"][0]
    assert rec["scale"] == float(state_scale)
    expect = 100.0 * int((big.abs() * (1 / state_scale) > 448).sum()) / big.numel()
    assert rec["saturation_pct"] == pytest.approx(expect, abs=1e-9) and rec["saturation_pct"] > 0
    stats.remove()


def test_interval_logging_and_explicit_steps(caplog):
    net = _mlp()
    stats = NumericsStats(net, every=3)
    with caplog.at_level(logging.INFO, logger="fp8func"):
        for i in range(7):
            assert stats.recording == (i % 3 == 0)
            net(_x(i)).sum().backward()
            stats.step()
    assert sorted({r["step"] for r in stats.records}) == [0, 3, 6]
    assert len(stats.records) == 3 * 2 * 3  # 3 steps x 2 layers x (x, w, dy)
    lines = [r.getMessage() for r in caplog.records if "stats step" in r.getMessage()]
    assert len(lines) == 3 * 2 and lines[0].startswith("fp8func stats step 0 0: x amax=")
    assert "| dy amax=" in lines[0] and "sqnr=" in lines[0]
    stats.step(10)  # the trainer's global step
    assert (stats.current_step, stats.recording) == (10, False)
    stats.step(12)
    assert stats.recording
    stats.remove()


def test_remove_restores_the_model():
    net = _mlp()
    before = [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in net.modules()]
    with NumericsStats(net, every=1) as stats:
        assert any(m._forward_pre_hooks for m in net.modules())
    assert [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in net.modules()] == before
    net(_x(0)).sum().backward()
    assert stats.records == []


def test_errors_say_what_to_do():
    with pytest.raises(ValueError, match="every=0.*int >= 1"):
        NumericsStats(_mlp(), every=0)
    with pytest.raises(ValueError, match="no Fp8Linear.*fp8func.convert"):
        NumericsStats(nn.Linear(32, 32))
    with pytest.raises(ValueError, match="step=-1"):
        NumericsStats(_mlp()).step(-1)
    with pytest.raises(TypeError, match="not a CastSpec"):
        tensor_stats(torch.ones(4, 4), "tensorwise")


def _train_qwen(with_stats: bool, steps=3):
    model = f8.convert(tiny_qwen3(hidden=64, intermediate=128, layers=1, heads=2, vocab=128), "tensorwise")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    stats = NumericsStats(model, every=2) if with_stats else None
    losses = []
    for step in range(steps):
        ids, labels = batch(step, 0, seq=32, vocab=128)
        loss = model(ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if stats:
            stats.step()
    return torch.stack(losses), model, stats, torch.get_rng_state()


def test_stats_do_not_change_training_bitwise():
    rng = torch.get_rng_state()
    off, m_off, _, rng_off = _train_qwen(False)
    on, m_on, stats, rng_on = _train_qwen(True)
    assert torch.equal(off, on)
    assert torch.equal(rng_off, rng_on)  # the stats drew no random numbers
    for (k, a), b in zip(m_off.state_dict().items(), m_on.state_dict().values()):
        assert torch.equal(a, b), k
    assert sorted({r["step"] for r in stats.records}) == [0, 2]
    assert {r["tensor"] for r in stats.records} == {"x", "w", "dy"}
    torch.set_rng_state(rng)


def _train_compiled(with_stats: bool, fullgraph=False, backend=None, steps=4):
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.reset()  # dynamo does not guard on module hooks: attach, then compile afresh
    net = _mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    stats = NumericsStats(net, every=2) if with_stats else None
    runs = []

    def counting(gm, inputs):  # inductor (the default backend), counting compiled-graph calls
        fn = (backend or compile_fx)(gm, inputs)

        def run(*args):
            runs[-1] += 1
            return fn(*args)

        return run

    compiled = torch.compile(net, backend=counting, fullgraph=fullgraph)
    losses = []
    for i in range(steps):
        runs.append(0)
        loss = compiled(_x(i)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
        if stats:
            stats.step()
    return torch.stack(losses), runs, stats


def test_compiled_model_same_losses_no_graph_break_no_work_off_steps(monkeypatch):
    calls = []
    real = stats_mod.tensor_stats
    monkeypatch.setattr(stats_mod, "tensor_stats", lambda *a: calls.append(1) or real(*a))
    off, runs_off, _ = _train_compiled(False)
    on, runs_on, stats = _train_compiled(True)
    assert torch.equal(off, on)
    assert runs_off == runs_on == [1, 1, 1, 1]  # one graph per step: no graph break, recording or not
    assert len(calls) == 2 * 2 * 2  # steps 0 and 2, 2 layers, x and w (dy is eager-only)
    assert sorted({(r["step"], r["tensor"]) for r in stats.records}) == [(0, "w"), (0, "x"), (2, "w"), (2, "x")]
    eager_x = _x(0)  # the first layer's input is the model input: the compiled record sees it exactly
    rec = [r for r in stats.records if (r["step"], r["layer"], r["tensor"]) == (0, "0", "x")][0]
    assert rec["amax"] == float(eager_x.abs().max())
    assert rec["sqnr_db"] == real(eager_x, f8.CastSpec())["sqnr_db"]


def test_fullgraph_compile_records_too():
    from torch._dynamo.backends.debugging import aot_eager

    _, runs, stats = _train_compiled(True, fullgraph=True, backend=aot_eager, steps=2)
    assert runs == [1, 1]
    assert sorted({r["step"] for r in stats.records}) == [0]


def test_json_and_plot(tmp_path):
    net = _mlp()
    stats = NumericsStats(net, every=1)
    for i in range(3):
        net(_x(i)).sum().backward()
        stats.step()
    path = tmp_path / "stats.json"
    stats.to_json(path)
    data = json.loads(path.read_text())
    assert data["every"] == 1 and len(data["records"]) == 3 * 2 * 3
    assert set(data["records"][0]) >= {"step", "layer", "tensor", "amax", "scale", "underflow_pct",
                                       "saturation_pct", "sqnr_db"}
    png = tmp_path / "out.png"
    plot_main([str(path), str(png)])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    steps, values = stats_plot._grid(data["records"], ["0", "2"], "dy", "amax")
    assert steps == [0, 1, 2] and values[1][2] == [r["amax"] for r in data["records"]
                                                  if (r["layer"], r["tensor"], r["step"]) == ("2", "dy", 2)][0]
    empty = tmp_path / "empty.json"
    empty.write_text('{"every": 1, "records": []}')
    with pytest.raises(ValueError, match="no records"):
        plot_main([str(empty), str(tmp_path / "x.png")])


def test_stats_plot_without_matplotlib_names_the_extra(tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    with pytest.raises(SystemExit, match="1"):
        plot_main([str(tmp_path / "stats.json"), str(tmp_path / "out.png")])
    assert capsys.readouterr().err == ("python -m fp8func.stats_plot needs matplotlib, which is not installed: "
                                       "pip install 'fp8func[demo]' (from a clone: pip install -e '.[demo]')\n")


def _png_size(path):
    head = path.read_bytes()[:24]  # PNG signature, IHDR length and type, then width and height
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def _deep_model_records(blocks=32, steps=(0, 50, 100)):
    """Records as a 32-block Llama writes them: 7 linears per block and lm_head; dy in backward order."""
    kinds = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
    layers = [f"model.layers.{b}.{k}" for b in range(blocks) for k in kinds] + ["lm_head"]
    records = []
    for s in steps:
        for i, layer in enumerate(layers):
            for t in ("x", "w"):
                records.append({"step": s, "layer": layer, "tensor": t, "amax": 1.0 + i + s, "underflow_pct": 0.01,
                                "sqnr_db": 31.0, "scale": 0.01, "saturation_pct": 0.0, "top_binade_pct": 1.0})
        for i, layer in reversed(list(enumerate(layers))):
            if not (s == 100 and layer == "lm_head"):  # one dy missing
                records.append({"step": s, "layer": layer, "tensor": "dy", "amax": 1e-4 * (i + 1),
                                "underflow_pct": 2.0 if i == 5 else 0.0, "sqnr_db": None if i == 0 else 25.0,
                                "scale": 1e-6, "saturation_pct": 0.0, "top_binade_pct": 1.0})
    records.append(dict(records[0], amax=123.0))  # a second forward of the first layer at step 0: the last counts
    return layers, records


def test_heatmap_of_a_32_layer_model(tmp_path):
    layers, records = _deep_model_records()
    assert stats_plot._layers(records) == layers  # forward order, though dy records come in backward order
    steps, amax = stats_plot._grid(records, layers, "x", "amax")
    assert steps == [0, 50, 100] and amax[0] == [123.0, 51.0, 101.0] and amax[224][2] == 100 + 225
    steps, uf = stats_plot._grid(records, layers, "dy", "underflow_pct")
    assert uf[5] == [2.0] * 3 and uf[6] == [0.0] * 3 and math.isnan(uf[224][2])  # no record: NaN (grey)
    sqnr = stats_plot._grid(records, layers, "dy", "sqnr_db")[1]
    assert math.isnan(sqnr[0][0]) and sqnr[1][0] == 25.0  # null (exact cast): NaN
    blocks = stats_plot._blocks(layers)
    assert len(blocks) == 33 and blocks[:2] == [(0, "layers.0"), (7, "layers.1")] and blocks[-1] == (224, "lm_head")
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"every": 50, "records": records}))
    deep, shallow = tmp_path / "deep.png", tmp_path / "shallow.png"
    assert stats_plot.plot(str(path), str(deep)) == 225
    few = [r for r in records if r["layer"].startswith(("model.layers.0.", "lm_head"))]
    path.write_text(json.dumps({"every": 50, "records": few}))
    assert stats_plot.plot(str(path), str(shallow), metrics=["underflow_pct"]) == 8
    (w_deep, h_deep), (w_few, h_few) = _png_size(deep), _png_size(shallow)
    assert h_deep <= 3 * 600 + 60 and w_deep <= 1500  # 3 tensors x 3 metrics, panels at most 6 inches tall
    assert h_few < h_deep and w_few < w_deep
    with pytest.raises(ValueError, match=r"metrics=\['amax', 'bogus'\]; expected one or more of"):
        stats_plot.plot(str(path), str(shallow), metrics=["amax", "bogus"])


def test_heatmap_colour_limits_keep_harmless_spreads_dark():
    import numpy as np

    assert stats_plot._limits(np.array([0.0, 0.01, 0.03]), "underflow_pct") == (0.0, 1.0, "neither")
    lo, hi, extend = stats_plot._limits(np.array([0.0] * 50 + [5.0] * 49 + [60.0]), "underflow_pct")
    assert (lo, extend) == (0.0, "max") and 5.0 <= hi < 60.0  # one outlier does not set the scale
    assert stats_plot._limits(np.array([31.0, 31.2, 31.4]), "sqnr_db") == pytest.approx((28.2, 34.2, "neither"))  # 6 dB
    lo, hi, extend = stats_plot._limits(np.array([25.0] * 200 + [48.0]), "sqnr_db")
    assert hi < 48.0 and extend == "max"
