"""The shell: convert / report / Fp8Linear on ordinary models (single process)."""

import copy
import functools
import logging

import pytest
import torch
from torch import nn

import fp8func as f8
from fp8func.distributed import Fp8AllGatherWeight

from .models import ResidualMlp, tiny_qwen3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 64)
        self.up = nn.Linear(64, 128)
        self.odd = nn.Linear(128, 24)  # N=24 is no multiple of 16
        self.down = nn.Linear(24, 64, bias=False)
        self.head = nn.Linear(64, 32, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(self.down(self.odd(torch.relu(self.up(h)))))


def test_convert_keeps_names_values_and_logs_one_line(caplog):
    torch.manual_seed(0)
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="fp8func"):
        f8.convert(net, "tensorwise")
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "fp8func"]
    assert lines == [("WARNING", "convert: 2/4 linear layers in FP8 (recipe=tensorwise, fsdp_fp8_all_gather=True); "
                                 "kept in high precision: odd (K=128, N=24: FP8 GEMMs need both divisible by 16); "
                                 "down (K=24, N=64: FP8 GEMMs need both divisible by 16). fp8func.report(model) "
                                 "lists every layer and why.")]
    after = net.state_dict()
    assert list(after) == list(before)
    for k in before:
        assert torch.equal(after[k].as_subclass(torch.Tensor) if isinstance(after[k], Fp8AllGatherWeight)
                           else after[k], before[k]), k
    assert isinstance(net.up, f8.nn.Fp8Linear) and isinstance(net.head, f8.nn.Fp8Linear)
    assert type(net.odd) is nn.Linear and type(net.down) is nn.Linear
    assert isinstance(net.up.weight, Fp8AllGatherWeight)
    assert net.head.weight is net.emb.weight and not net.head.fsdp_fp8_all_gather  # tied: bf16 gather


def test_report_says_why(capsys):
    net = f8.convert(Net(), "rowwise", filter=lambda m, fqn: fqn != "up")
    assert not any(k.startswith("_fp8func") for k in vars(net))  # nothing stashed on the user's model
    # the decisions live in the FP8 layers: the convert call's rows, and each converted layer's note
    assert [(r.fqn, r.converted) for r in net.head.conversion] == [("up", False), ("odd", False), ("down", False),
                                                                   ("head", True)]
    assert "shared with another module" in net.head.note
    rows = f8.report(net)
    printed = capsys.readouterr().out
    by = {r.fqn: r for r in rows}
    assert not by["up"].converted and by["up"].reason == "excluded by filter"
    assert not by["odd"].converted and "N=24: FP8 GEMMs need both divisible by 16" in by["odd"].reason
    assert by["head"].converted and "shared with another module" in by["head"].reason
    assert by["head"].recipe == "rowwise" and (by["head"].in_features, by["head"].out_features) == (64, 32)
    assert "1/4 linear layers in FP8" in printed and "excluded by filter" in printed


def test_blockwise_keeps_untileable_layers_high_precision():
    plan = f8.nn.plan_conversion(Net(), "blockwise", fsdp_fp8_all_gather=False)  # decides, changes nothing
    by = {r.fqn: r for r in plan}
    assert not by["up"].converted and ("the output GEMM's input x cast BlockWise(block=(1, 128)) does not tile its "
                                       "operand (128, 64)") in by["up"].reason
    net = f8.convert(Net(), "blockwise", fsdp_fp8_all_gather=False)
    assert not any(isinstance(m, f8.nn.Fp8Linear) for m in net.modules())  # no layer tiles: none converted


@pytest.mark.parametrize("gather", [True, False])
def test_converted_model_trains_like_functional_linear(gather):
    torch.manual_seed(0)
    ref, model = nn.Linear(64, 32), nn.Linear(64, 32)
    model.load_state_dict(ref.state_dict())
    container = f8.convert(nn.Sequential(model), "rowwise", fsdp_fp8_all_gather=gather)  # in place
    w = container[0].weight
    assert isinstance(container[0], f8.nn.Fp8Linear)
    assert (w._tensor if gather else w).data_ptr() == model.weight.data_ptr()  # same storage, no copy
    x = torch.randn(8, 64, requires_grad=True)
    y_ref = f8.linear(x, ref.weight, ref.bias, recipe="rowwise")
    y = container(x)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, dy)
    (gx_ref,) = torch.autograd.grad(y_ref, x, dy)
    assert torch.equal(gx, gx_ref)


def _mixed_plan() -> f8.LinearPlan:
    """Row-wise forward and grad_input, a tensorwise e5m2 x e4m3 grad_weight: no Recipe says it."""
    row, tw = f8.CastSpec(f8.E4M3, f8.AxisWise(-1), True), f8.CastSpec(f8.E4M3)
    return f8.LinearPlan(output=f8.GemmPlan(row, row), grad_input=f8.GemmPlan(row, row),
                         grad_weight=f8.GemmPlan(f8.CastSpec(f8.E5M2), tw), name="row-fwd")


@pytest.mark.parametrize("gather", [True, False])
def test_mixed_plan_converts_and_trains_bitwise_as_functional_linear(gather):
    """A per-GEMM LinearPlan goes through convert: every layer holds that one plan, and three SGD
    steps of the converted model are bitwise three steps of fp8func.linear with the plan."""
    mixed = _mixed_plan()
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    ref = [t.detach().clone().requires_grad_() for t in (base[0].weight, base[0].bias, base[2].weight, base[2].bias)]
    model = f8.convert(base, mixed, fsdp_fp8_all_gather=gather)
    assert all(m.plan is mixed and m.recipe is mixed for m in (model[0], model[2]))
    assert [r.recipe for r in f8.report(model, print_table=False)] == ["row-fwd", "row-fwd"]
    opt, opt_ref = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref, lr=0.1)
    for _ in range(3):
        x = torch.randn(8, 64)
        y = model(x)
        y_ref = f8.linear(torch.relu(f8.linear(x, ref[0], ref[1], mixed)), ref[2], ref[3], mixed)
        assert torch.equal(y, y_ref)
        y.square().sum().backward()
        y_ref.square().sum().backward()
        opt.step(), opt_ref.step(), opt.zero_grad(), opt_ref.zero_grad()
    for p, r in zip((model[0].weight, model[0].bias, model[2].weight, model[2].bias), ref):
        assert torch.equal(p.detach(), r.detach())  # (the fp8 all-gather weight compares as its values)
    assert f8.convert(model, mixed)[0].plan is mixed  # the same plan again: nothing to change


def test_layers_resolve_the_recipe_once(monkeypatch):
    """convert resolves a Recipe to one LinearPlan that every layer holds (recipe reads the Recipe
    back); the forward and backward run it without planning again."""
    import fp8func._plan as plan_mod

    recipe = f8.Recipe.from_name("rowwise", kernels="off")
    model = f8.convert(nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 32)), recipe)
    assert model[0].plan is model[1].plan and model[0].plan == f8.plan(recipe) and model[0].recipe is recipe
    assert model[0].weight.plan is model[0].plan and model[0].weight.recipe is recipe
    assert f8.nn.Fp8Linear(64, 32, recipe="tensorwise").plan is f8.plan("tensorwise")  # named: one prebuilt plan

    def replan(r):
        raise AssertionError(f"planned {r.name!r} again")

    monkeypatch.setattr(plan_mod, "_plan_of", replan)
    model(torch.randn(4, 64)).sum().backward()
    with pytest.raises(TypeError, match="Fp8Linear: recipe=3; expected a Recipe, a LinearPlan or a recipe name"):
        f8.nn.Fp8Linear(64, 32, recipe=3)


@pytest.mark.slow
def test_mixed_plan_layer_compiles_without_graph_breaks():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = f8.convert(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16)), _mixed_plan())
    x = torch.randn(8, 64)
    eager = model(x)
    compiled = torch.compile(model)(x)
    assert torch.equal(compiled, eager)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


@pytest.mark.slow
def test_qwen3_converts_and_runs_compiled():
    torch._dynamo.reset()
    model = f8.convert(tiny_qwen3(layers=1), "tensorwise")
    rows = f8.report(model, print_table=False)
    assert sum(r.converted for r in rows) == 8  # q, k, v, o, gate, up, down, lm_head
    ids = torch.randint(0, 256, (2, 64))
    eager = model(input_ids=ids, labels=ids).loss
    compiled = torch.compile(model, fullgraph=True)(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    compiled.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    eager.backward()
    # inductor rounds the fp32 intermediates otherwise, which moves some fp8 roundings: 51-107 dB here
    for n, p in model.named_parameters():
        assert f8.sqnr(p.grad.double(), grads[n].double()) > 40, (n, f8.sqnr(p.grad.double(), grads[n].double()))


def test_fsdp_gathered_weight_refuses_other_uses():
    from fp8func.distributed import Fp8GatheredWeight

    q = f8.quantize(torch.randn(32, 64), f8.CastSpec())
    w = Fp8GatheredWeight({"w": q}, (32, 64), torch.bfloat16)
    with pytest.raises(RuntimeError, match="only Fp8Linear can consume it"):
        w + 1
    assert isinstance(w.detach(), Fp8GatheredWeight)


def _logged(caplog, fn, *args, **kwargs) -> list[tuple[str, str]]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fp8func"):
        fn(*args, **kwargs)
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "fp8func"]


def test_convert_warns_about_what_it_leaves_in_high_precision(caplog):
    square = lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))  # noqa: E731
    # every layer in FP8: one INFO line, no prefix of its own (the logger's name is "fp8func")
    assert _logged(caplog, f8.convert, square(), "tensorwise") == [
        ("INFO", "convert: 2/2 linear layers in FP8 (recipe=tensorwise, fsdp_fp8_all_gather=True)")]
    # layers the filter excludes are the user's choice: counted, not warned about
    assert _logged(caplog, f8.convert, square(), "rowwise", filter=["2"]) == [
        ("INFO", "convert: 1/2 linear layers in FP8 (recipe=rowwise, fsdp_fp8_all_gather=True)")]
    [(level, line)] = _logged(caplog, f8.convert, nn.Sequential(nn.Linear(100, 10)), "tensorwise")
    assert level == "WARNING" and line.startswith("convert: 0/1 linear layers in FP8 (recipe=tensorwise, ")
    assert "; nothing is in FP8; kept in high precision: 0 (K=100, N=10: FP8 GEMMs need both divisible by 16)" in line
    [(level, line)] = _logged(caplog, f8.convert, square(), "tensorwise", filter=["0", "2"])
    assert level == "WARNING" and "nothing is in FP8; kept in high precision: 0, 2 (excluded by filter)" in line
    assert _logged(caplog, f8.convert, nn.Sequential(nn.ReLU()), "tensorwise") == [
        ("WARNING", "convert: the model has no nn.Linear layer (nor HF fused MoE experts module): nothing is in FP8.")]
    [(level, line)] = _logged(caplog, f8.convert, tiny_qwen3(layers=1, vocab=1000), "tensorwise")
    assert level == "WARNING" and line.startswith("convert: 7/8 linear layers in FP8")
    assert "kept in high precision: lm_head (K=256, N=1000: FP8 GEMMs need both divisible by 16)" in line
    many = nn.Sequential(*[nn.Linear(64, 40) if i % 2 else nn.Linear(40, 64) for i in range(10)])
    [(level, line)] = _logged(caplog, f8.convert, many, "tensorwise")
    assert ("kept in high precision: 0, 2, 4 and 2 more (K=40, N=64: FP8 GEMMs need both divisible by 16); "
            "1, 3, 5 and 2 more (K=64, N=40: FP8 GEMMs need both divisible by 16).") in line


def test_second_convert_with_other_options_warns_and_names_the_change(caplog):
    model = f8.convert(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32)), "tensorwise")
    assert _logged(caplog, f8.convert, model, "tensorwise") == [  # the same options: nothing changes
        ("INFO", "convert: 2/2 linear layers in FP8 (recipe=tensorwise, fsdp_fp8_all_gather=True)")]
    [(level, line)] = _logged(caplog, f8.convert, model, "rowwise", fp8_weights=True)
    assert level == "WARNING" and model[0].recipe.name == "rowwise" and model[0].fp8_weights
    assert ("in FP8 from an earlier convert() and converted again from their high-precision values (exclude them "
            "with filter=[...] to keep them as they are): 0, 1 (tensorwise, fsdp_fp8_all_gather=True -> rowwise, "
            "fsdp_fp8_all_gather=True, fp8_weights=True)") in line
    [(level, line)] = _logged(caplog, f8.convert, model, "blockwise", filter=["1"])  # 64x64 has no 128x128 block
    assert level == "WARNING" and type(model[0]) is nn.Linear and model[1].recipe.name == "rowwise"
    assert "kept in high precision: 0 (the output GEMM's input x cast BlockWise(block=(1, 128)) does not tile" in line
    assert "0 (rowwise, fsdp_fp8_all_gather=True, fp8_weights=True -> high precision)" in line


def test_convert_refuses_what_is_not_a_module_and_suggests_a_recipe_name():
    for fn in (f8.convert, f8.nn.plan_conversion, f8.unconvert, f8.report):
        with pytest.raises(TypeError, match=rf"{fn.__name__}: model is a torch.Tensor; expected a torch.nn.Module"):
            fn(torch.randn(3))
    with pytest.raises(TypeError, match=r"convert: model is a dict; expected a torch.nn.Module .* fp8func.quantize"):
        f8.convert({"w": torch.randn(3)}, "rowwise")
    for typo, name in (("tensorwize", "tensorwise"), ("row_wise", "rowwise"), ("mxfp4", "mxfp8")):
        with pytest.raises(ValueError, match=rf"unknown recipe \(did you mean '{name}'\?\); expected one of"):
            f8.convert(Net(), typo)
    with pytest.raises(ValueError, match=r"Recipe.from_name\('fp4'\): unknown recipe; expected one of"):
        f8.Recipe.from_name("fp4")  # nothing close: no guess


def test_shell_errors():
    with pytest.raises(TypeError, match=r"convert: recipe=3; expected a Recipe, a LinearPlan or a recipe name"):
        f8.convert(Net(), 3)
    with pytest.raises(ValueError, match="the model itself is an nn.Linear; wrap it in a module first"):
        f8.convert(nn.Linear(64, 64))
    from fp8func._autograd import linear_with_casts

    w = torch.randn(32, 64)
    q = f8.quantize(w, f8.CastSpec())
    with pytest.raises(ValueError, match=r"plan 'rowwise' needs weight casts \['w', 'w_t'\], got \['w'\]"):
        linear_with_casts(torch.randn(4, 64), w, None, f8.Recipe.from_name("rowwise"), {"w": q})
    with pytest.raises(TypeError, match="all_gather: expected an Fp8Tensor, got Tensor"):
        f8.all_gather(w, None)


def test_convert_auto_filter_keeps_small_layers_in_bf16_and_says_why():
    """filter="auto": the roofline model (H200 calibration off the GPU, logged) prices layers as they
    run in a compiled model: it converts a 4096x14336 layer at 8192 tokens and keeps a Llama-3.2-1B
    k/v projection (2048 -> 512), whose casts cost more than its GEMMs save."""
    from torch import nn

    model = nn.Sequential(nn.Linear(4096, 14336, bias=False), nn.Linear(2048, 512, bias=False))
    f8.convert(model, "tensorwise", filter="auto", tokens=8192, fsdp_fp8_all_gather=False)
    rows = {r.fqn: r for r in f8.report(model, print_table=False)}
    assert rows["0"].converted and rows["0"].reason.startswith("auto: 1."), rows["0"]
    assert not rows["1"].converted and rows["1"].reason.startswith("auto: kept bf16, FP8 not faster"), rows["1"]
    assert "at 8192 tokens on H200" in rows["1"].reason
    with pytest.raises(ValueError, match="filter='fast'; expected a callable"):
        f8.convert(nn.Sequential(nn.Linear(16, 16)), filter="fast")


def test_auto_bench_reads_convert_decisions_and_flags_slower_conversions():
    """``python -m fp8func.bench auto`` (GPU only) takes its decisions from ``convert``/``report``
    and flags a converted layer slower than bf16; its bookkeeping runs here on the CPU."""
    from fp8func.bench import _auto

    big, small = (16384, 4096, 14336), (4096, 2048, 2048)
    converted, note = _auto.decision(*big, f8.Recipe.from_name("tensorwise"))
    assert converted and _auto._modelled(note) > 1.0, note
    kept, note = _auto.decision(*small, f8.Recipe.from_name("tensorwise"))
    assert not kept and _auto._modelled(note) < 1.0, note
    times = {"bf16_ms": 1.0, "bf16_b2b_ms": 1.0}
    rows = [{"shape": big, "recipe": "tensorwise", "auto_fp8": True, "modelled": 1.4, **times,
             "fp8_ms": 0.7, "fp8_b2b_ms": 0.7},
            {"shape": big, "recipe": "rowwise", "auto_fp8": True, "modelled": 1.4, **times,
             "fp8_ms": 0.9, "fp8_b2b_ms": 1.1},
            {"shape": small, "recipe": "tensorwise", "auto_fp8": False, "modelled": 0.5, **times,
             "fp8_ms": 0.8, "fp8_b2b_ms": 0.9},
            {"shape": small, "recipe": "rowwise", "auto_fp8": False, "modelled": 0.5, **times,
             "fp8_ms": 1.3, "fp8_b2b_ms": 0.9}]
    assert [_auto.verdict(r) for r in rows] == ["ok", "SLOWER (b2b)", "missed", "ok"]
    for r in rows:
        r["verdict"] = _auto.verdict(r)
    assert _auto.table(rows).endswith("converted 2 of 4 (shape, recipe) cases; 1 of them slower than bf16 in some "
                                      "timing; 1 kept in bf16 where FP8 was faster in both timings.")


def test_roofline_model_ranks_the_measured_shapes():
    """The isolated-layer model's verdicts against four runs of ``python -m fp8func.bench auto`` on
    an H200 (208 shape x recipe measurements of isolated, synchronized layers). FP8 wins on the
    large shapes in every recipe; the small ones stay bf16; and the six cases that measured slower
    than bf16 (0.71-0.99x) in some run stay bf16."""
    from fp8func.nn._auto import MARGIN, PROFILES, estimate_ms

    p = PROFILES["H200"]
    faster = lambda shape, recipe: (  # noqa: E731
        estimate_ms(*shape, f8.Recipe.from_name(recipe), p, isolated=True) * MARGIN
        <= estimate_ms(*shape, None, p, isolated=True))
    for shape in [(16384, 4096, 14336), (16384, 14336, 4096), (8192, 8192, 8192), (8192, 4096, 14336)]:
        for recipe in ("tensorwise", "rowwise", "blockwise", "delayed"):  # measured 1.25-1.72x
            assert faster(shape, recipe), (shape, recipe)
        # on the GPU (the lead left out), delayed scaling's casts read each operand once: less
        # time than dynamic tensorwise's amax pass and cast
        delayed, dynamic = (estimate_ms(*shape, f8.Recipe.from_name(r), p)
                            for r, k in (("delayed", "delayed"), ("tensorwise", "tensorwise")))
        assert delayed < dynamic
    for shape in [(4096, 2048, 2048), (4096, 4096, 1024), (2048, 4096, 14336), (8192, 4096, 1024)]:
        for recipe in ("tensorwise", "rowwise", "blockwise", "delayed"):  # measured 0.25-0.96x
            assert not faster(shape, recipe), (shape, recipe)
    for shape, recipe in [((8192, 4096, 4096), "tensorwise"), ((8192, 4096, 4096), "blockwise"),
                          ((8192, 4096, 4096), "delayed"), ((16384, 4096, 4096), "blockwise"),
                          ((4096, 14336, 4096), "blockwise"), ((4096, 14336, 4096), "rowwise")]:
        assert not faster(shape, recipe), (shape, recipe)


def test_state_dict_of_fp8_all_gather_weights_saves_plain_tensors():
    """Checkpoints hold plain high-precision tensors: weights_only loads work without fp8func."""
    import io

    model = f8.convert(tiny_qwen3(layers=1), "rowwise")
    assert isinstance(model.model.layers[0].mlp.up_proj.weight, Fp8AllGatherWeight)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    w = loaded["model.layers.0.mlp.up_proj.weight"]
    assert type(w) is torch.Tensor and torch.equal(w, model.model.layers[0].mlp.up_proj.weight._tensor)
    # distinct, real addresses: code that keys parameters by data_ptr() (accelerate) tells them apart
    ptrs = [p.data_ptr() for p in model.parameters()]
    assert len(set(ptrs)) == len(ptrs) and 0 not in ptrs
    fresh = f8.convert(tiny_qwen3(layers=1, seed=1), "rowwise")
    fresh.load_state_dict(loaded)
    assert isinstance(fresh.model.layers[0].mlp.up_proj.weight, Fp8AllGatherWeight)
    assert torch.equal(fresh.model.layers[0].mlp.up_proj.weight._tensor, w)


def test_plan_conversion_decides_without_touching_the_model():
    net = Net()
    before = {name: type(m) for name, m in net.named_modules()}
    plan = f8.nn.plan_conversion(net, "rowwise", filter=["up"])
    assert {name: type(m) for name, m in net.named_modules()} == before
    converted = f8.convert(net, "rowwise", filter=["up"])
    assert converted is net  # model = convert(model) keeps working
    assert [(r.fqn, r.converted, r.reason) for r in plan] == \
        [(r.fqn, r.converted, r.reason) for r in f8.report(net, print_table=False)]


def test_filter_takes_fqn_patterns_and_refuses_anything_else(caplog):
    model = f8.convert(tiny_qwen3(layers=2), "tensorwise", filter=["lm_head", "layers.0.*", "model.layers.1.mlp"])
    fp8 = {fqn for fqn, m in model.named_modules() if isinstance(m, f8.nn.Fp8Linear)}
    # "lm_head": a substring (torchtitan's filter_fqns); "layers.0.*": a glob on the whole fqn, which
    # matches no fqn (they start with "model."); "model.layers.1.mlp": every projection of that MLP.
    assert "lm_head" not in fp8 and "model.layers.1.mlp.up_proj" not in fp8
    assert "model.layers.0.mlp.up_proj" in fp8 and "model.layers.1.self_attn.q_proj" in fp8
    with caplog.at_level(logging.WARNING, logger="fp8func"):
        f8.nn.plan_conversion(tiny_qwen3(layers=1), filter=["layers.0.*"])
    assert "patterns ['layers.0.*'] match no linear layer" in caplog.text
    for bad in ("lm_head", 3, [3], ["lm_head", None], {"lm_head": 1}):
        with pytest.raises(ValueError, match="expected a callable .* 'auto', a list of"):
            f8.convert(tiny_qwen3(layers=1), filter=bad)


def test_second_convert_reconverts_or_raises():
    model = f8.convert(tiny_qwen3(layers=1), "tensorwise")
    w = model.model.layers[0].mlp.up_proj.weight.hp_values().clone()
    f8.convert(model, "rowwise", fp8_weights=True)  # another recipe, fp8 weights: converted again
    up = model.model.layers[0].mlp.up_proj
    assert up.recipe.name == "rowwise" and up.fp8_weights and torch.equal(up.weight.dequantize(), w)
    f8.convert(model, "tensorwise", filter=["mlp"])  # layers the filter excludes stay as they are
    assert model.model.layers[0].mlp.up_proj is up
    assert model.model.layers[0].self_attn.q_proj.recipe.name == "tensorwise"
    rows = {r.fqn: r for r in f8.report(model, print_table=False)}
    assert rows["model.layers.0.mlp.up_proj"].recipe == "rowwise" and rows["lm_head"].recipe == "tensorwise"
    f8.convert(model, "blockwise", filter=lambda m, fqn: fqn == "lm_head")  # a callable filter selects it
    assert model.lm_head.recipe.name == "blockwise"
    f8.convert(model, "rowwise", filter=lambda m, fqn: fqn == "lm_head" or "layers" not in fqn)
    assert model.lm_head.recipe.name == "rowwise"


@pytest.mark.slow
def test_second_convert_of_a_sharded_layer_raises():
    from .dist_harness import run_workers

    assert run_workers(_convert_sharded_twice, 1) == ["raised"]


def _convert_sharded_twice(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = f8.convert(tiny_qwen3(layers=1), "tensorwise")
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    f8.convert(model, "tensorwise")  # the same options: nothing to change
    try:
        f8.convert(model, "rowwise")
    except ValueError as e:
        assert "cannot be converted again in place" in str(e), e
        assert model.lm_head.recipe.name == "tensorwise"  # nothing changed
        return "raised"
    return "converted"


# --------------------------------------------------------------------------------------------
# GPU (the `gpu` mark: skipped with the reason where no FP8-capable CUDA GPU is visible).


def _six_steps(recipe: str, mode: str):
    """Outputs and gradients of 6 fwd+bwd steps of a compiled Fp8Linear (fresh, seeded)."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 384, bias=False, device="cuda", dtype=torch.bfloat16)
    mod = f8.nn.Fp8Linear.from_linear(lin, f8.Recipe.from_name(recipe), fsdp_fp8_all_gather=False)
    cm = torch.compile(mod, mode=mode)
    g = torch.Generator(device="cuda").manual_seed(1)
    outs = []
    for _ in range(6):
        torch.compiler.cudagraph_mark_step_begin()
        x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
        mod.weight.grad = None
        y = cm(x)
        y.backward(torch.randn(512, 384, device="cuda", dtype=torch.bfloat16, generator=g))
        state = mod.scaling_state()
        outs.append((y.detach().clone(), x.grad.clone(), mod.weight.grad.clone(),
                     *(() if state is None else (t.detach().clone() for t in state.tensors()))))
    torch.compiler.reset()
    return outs


# cudagraph trees capture some graphs empty here (torch's UserWarning; the replays still run them)
EMPTY_GRAPH = "ignore:The CUDA Graph is empty:UserWarning"


@pytest.mark.gpu
@pytest.mark.filterwarnings(EMPTY_GRAPH)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_linear_under_cuda_graphs_is_bitwise_the_default_compile(recipe):
    """torch.compile(mode="reduce-overhead") (CUDA graphs) replays the same kernels: same bits."""
    for a, b in zip(_six_steps(recipe, "default"), _six_steps(recipe, "reduce-overhead")):
        for t, u in zip(a, b):
            assert torch.equal(t, u)


@pytest.mark.gpu
@pytest.mark.filterwarnings(EMPTY_GRAPH)
def test_delayed_linear_under_cuda_graphs():
    """The state buffers are written by the post-accumulate-grad hook after the graph replays,
    never rebound in the forward: CUDA graphs give the default compile's bits."""
    for a, b in zip(_six_steps("delayed", "default"), _six_steps("delayed", "reduce-overhead")):
        for t, u in zip(a, b):
            assert torch.equal(t, u)


class _QuantizeOp:
    """The handle ``torch.ops.fp8func.kernels_quantize.default`` has where Triton registers it (its
    ``name()``), for the policy's routing on machines without the fused kernels."""

    def name(self) -> str:
        return "fp8func::kernels_quantize"


def test_selective_checkpoint_policy_keeps_input_casts_and_defers_the_rest():
    from torch.utils.checkpoint import CheckpointPolicy

    mm, add = torch.ops.aten.mm.default, torch.ops.aten.add.Tensor
    policy = f8.nn.selective_checkpoint_policy([mm])
    assert policy(None, mm) == CheckpointPolicy.MUST_SAVE
    assert policy(None, add) == CheckpointPolicy.PREFER_RECOMPUTE
    x, fp8 = torch.zeros(2, 2), torch.float8_e4m3fn
    # (x, dtype, pow2, gm, gk, transpose, fuse_amax): an input's cast is kept, a weight's recomputed
    assert policy(None, _QuantizeOp(), x, fp8, False, 0, 0, True, True) == CheckpointPolicy.MUST_SAVE
    assert policy(None, _QuantizeOp(), x, fp8, False, 0, 0, True, False) == CheckpointPolicy.PREFER_RECOMPUTE
    assert policy(None, _QuantizeOp(), x, fuse_amax=True) == CheckpointPolicy.MUST_SAVE

    asked = []

    def own(ctx, op, *args, **kwargs):
        asked.append(op)
        return CheckpointPolicy.MUST_RECOMPUTE

    policy = f8.nn.selective_checkpoint_policy(own)
    assert policy(None, add) == CheckpointPolicy.MUST_RECOMPUTE
    assert policy(None, _QuantizeOp(), x, fp8, False, 0, 0, True, True) == CheckpointPolicy.MUST_SAVE
    assert asked == [add]
    with pytest.raises(TypeError, match="expected a list or set of ops"):
        f8.nn.selective_checkpoint_policy("aten.mm")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_selective_checkpoint_policy_trains_bitwise_as_without_checkpointing(compiled):
    """A converted block under op-level selective checkpointing with the policy: outputs and
    gradients bitwise those without checkpointing (and of the plain list policy)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    save = [torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default]

    torch.manual_seed(0)
    base = f8.convert(ResidualMlp(64, 128), "tensorwise", fsdp_fp8_all_gather=False)
    x0 = torch.randn(32, 64)
    results = []
    for policy in (None, save, f8.nn.selective_checkpoint_policy(save)):
        torch._dynamo.reset()
        model = copy.deepcopy(base)
        run = model if policy is None else checkpoint_wrapper(
            model, preserve_rng_state=False, context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
        fn = torch.compile(run, fullgraph=True) if compiled else run
        x = x0.clone().requires_grad_()
        y = fn(x)
        y.square().sum().backward()
        results.append([y.detach(), x.grad, *(p.grad for p in model.parameters())])
    torch._dynamo.reset()
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other, strict=True))
