"""One input cast for sibling FP8 layers (``fp8func.input_casts``, ``convert(share_input_casts=)``):
the same bits as every layer casting its own input, eager, compiled (where each layer casts its
own) and under torch.func."""

import copy
import io

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import fp8func as f8
import fp8func._casts as casts_mod
import fp8func.nn._shared as shared_mod


class Block(nn.Module):
    """An attention-like block: q, k and v read one normalized tensor; o reads another."""

    def __init__(self, dim=256, inplace=False):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.inplace = inplace

    def forward(self, x):
        h = self.norm(x)
        q = self.q(h)
        if self.inplace:
            h.mul_(2)  # k and v read other values than q: their casts must not be q's
        return x + self.o(q * torch.sigmoid(self.k(h)) + self.v(h))


def _recipe(name):
    # kernels="reference": the kernels' route on the CPU, so the transposed-copy input cast runs too
    return f8.Recipe.from_name(name, kernels="reference")


def _step(model, x, compiled=False):
    for t in [x, *model.parameters()]:
        t.grad = None
    forward = torch.compile(model, fullgraph=True) if compiled else model
    y = forward(x)
    y.sum().backward()
    return [y.detach(), x.grad.clone(), *(p.grad.clone() for p in model.parameters())]


def _models(recipe, inplace=False):
    torch.manual_seed(0)
    base = nn.Sequential(Block(inplace=inplace), Block(inplace=inplace))
    return {share: f8.convert(copy.deepcopy(base), _recipe(recipe), fsdp_fp8_all_gather=False,
                              share_input_casts=share) for share in (False, True)}


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_input_casts_give_linear_the_same_bits(recipe):
    torch.manual_seed(0)
    h = torch.randn(2, 128, 256, requires_grad=True)
    ws = [torch.randn(128, 256, requires_grad=True) for _ in range(3)]

    def run(share):
        for t in [h, *ws]:
            t.grad = None
        given = f8.input_casts(h, _recipe(recipe)) if share else None
        ys = [f8.linear(h, w, recipe=_recipe(recipe), x_casts=given) for w in ws]
        (ys[0] * ys[1].sigmoid() + ys[2]).sum().backward()
        return [*(y.detach() for y in ys), h.grad.clone(), *(w.grad.clone() for w in ws)], given

    alone, _ = run(False)
    shared, given = run(True)
    assert "x.T" in given  # the forward cast's transposed copy, written in the same pass
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))


def test_input_casts_none_where_the_layer_needs_its_input():
    assert f8.input_casts(torch.randn(4, 64), "rowwise_with_gw_hp") is None


def test_input_casts_checked_against_the_recipe():
    x, w = torch.randn(4, 64), torch.randn(8, 64)
    with pytest.raises(ValueError, match=r"needs input casts \['x', 'x_t'\].*fp8func.input_casts"):
        f8.linear(x, w, recipe="rowwise", x_casts=f8.input_casts(x, "tensorwise"))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_sibling_layers_cast_their_shared_input_once(recipe, monkeypatch):
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0])
        return casts_mod.input_casts(*args, **kwargs)

    monkeypatch.setattr(shared_mod, "input_casts", counting)
    models = _models(recipe)
    x = torch.randn(2, 64, 256, requires_grad=True)
    alone, shared = _step(models[False], x), _step(models[True], x)
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))
    assert len(calls) == 4  # per block: one for q, k and v, one for o
    group = models[True][0].q._input_casts
    assert group is models[True][0].k._input_casts is models[True][0].v._input_casts is models[True][0].o._input_casts
    assert group._x is None  # emptied after the block's call: no tensor held between steps
    assert models[False][0].q._input_casts is None


@pytest.mark.parametrize("compiled", [False, True])
def test_a_tensor_changed_in_place_between_siblings_is_cast_again(compiled):
    models = _models("tensorwise", inplace=True)
    x = torch.randn(2, 64, 256, requires_grad=True)
    alone, shared = _step(models[False], x, compiled), _step(models[True], x, compiled)
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_compiled_shared_casts_are_bitwise_unshared_without_graph_breaks(recipe):
    models = _models(recipe)
    x = torch.randn(2, 64, 256, requires_grad=True)
    torch._dynamo.utils.counters.clear()
    alone, shared = _step(models[False], x, True), _step(models[True], x, True)
    assert not torch._dynamo.utils.counters["graph_break"]
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))


def test_shared_casts_under_torch_func_transforms():
    """grad over the parameters (eager and compiled) and vmap over examples (each example's casts
    are made inside its layers: nothing is shared across the batch dimension)."""
    models = _models("tensorwise")
    x = torch.randn(3, 32, 256)
    out = {}
    for share, m in models.items():
        params = dict(m.named_parameters())
        g = grad(lambda p: functional_call(m, p, (x,)).sum())(params)
        cg = torch.compile(lambda p, x: grad(lambda p: functional_call(m, p, (x,)).sum())(p), fullgraph=True)(params, x)
        vm = vmap(lambda xi: functional_call(m, params, (xi,)))(x)
        out[share] = [*g.values(), *cg.values(), vm]
    assert all(torch.equal(a, b) for a, b in zip(out[False], out[True]))


def test_copies_pickles_and_unconvert_keep_their_own_groups():
    model = _models("tensorwise")[True]
    x = torch.randn(2, 16, 256)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        assert other[0].q._input_casts is other[0].k._input_casts is not model[0].q._input_casts
        assert torch.equal(other(x), model(x))
    f8.unconvert(model)
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks
    assert not hasattr(model[0], "_fp8_shared_input_casts")
    f8.convert(model, "tensorwise", share_input_casts=False)
    assert model[0].q._input_casts is None and not model[0]._forward_hooks


def test_delayed_layers_keep_their_own_casts():
    torch.manual_seed(0)
    model = f8.convert(Block(), "delayed", fsdp_fp8_all_gather=False)
    assert model.q._input_casts is None and not model._forward_hooks


# dynamo probes ``hasattr(t, "grad")`` on a block's input (a non-leaf) inside a filter meant to
# hide this warning, which pytest's warnings-as-errors turns into an error first.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
def test_blocks_compiled_one_by_one_share_one_graph():
    """Per-block compile (torchtitan's), the group's hooks inside each compiled layer: nothing per
    layer (the group object, a hook's id) reaches the guards, so identical layers run one compiled
    graph, as without shared casts."""
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Sequential(Block()) for _ in range(4)])  # layers holding the blocks
    graphs = {}
    for share in (False, True):
        model = f8.convert(copy.deepcopy(base), _recipe("tensorwise"), fsdp_fp8_all_gather=False,
                           share_input_casts=share)
        for i, layer in enumerate(model):
            model[i] = torch.compile(layer)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model(torch.randn(2, 64, 256)).sum().backward()
        graphs[share] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # two: the first layer reads a tensor that needs no grad, the other three one that does
    assert graphs[True] == graphs[False] == 2, graphs


# --------------------------------------------------------------------------------------------
# GPU (the `gpu` mark: skipped with the reason where no FP8-capable CUDA GPU is visible).


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
@pytest.mark.parametrize("compiled", [False, True])
def test_shared_input_casts_on_gpu_are_bitwise_and_cast_once(recipe, compiled):
    """q, k and v reading one tensor (convert's share_input_casts): every output and gradient is
    bitwise the unshared model's, and eager, the Triton casts of the shared input run once per
    step (compiled code casts per layer: see fp8func.nn.SharedInputCasts)."""
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    class QKV(nn.Module):
        def __init__(self, dim=512):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))

        def forward(self, x):
            h = x * 1.5  # an intermediate, as a norm's output is in a decoder layer
            return self.q(h) * torch.sigmoid(self.k(h)) + self.v(h)

    torch.manual_seed(0)
    base = QKV().cuda().bfloat16()
    x = torch.randn(4, 256, 512, device="cuda").bfloat16()
    runs = {}
    for share in (False, True):
        torch._dynamo.reset()
        model = f8.convert(copy.deepcopy(base), recipe, fsdp_fp8_all_gather=False, share_input_casts=share)
        fn = torch.compile(model, fullgraph=True) if compiled else model
        xx = x.clone().requires_grad_()
        fn(xx).sum().backward()  # compile / warm up
        xx.grad = None
        for p in model.parameters():
            p.grad = None
        with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
            y = fn(xx)
            y.sum().backward()
            torch.cuda.synchronize()
        # the input casts: kernels reading the [1024, 512] bf16 tensor (amax / quantize launches)
        casts = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                    and ("quant" in e.name or "amax" in e.name or "_cast" in e.name))
        runs[share] = ([y.detach(), xx.grad, *(p.grad for p in model.parameters())], casts)
    assert all(torch.equal(a, b) for a, b in zip(runs[False][0], runs[True][0]))
    if compiled:
        assert runs[True][1] == runs[False][1], (runs[False][1], runs[True][1])
    else:
        assert runs[True][1] < runs[False][1], (runs[False][1], runs[True][1])
