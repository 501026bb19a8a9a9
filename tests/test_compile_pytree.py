"""Fp8Tensor as a pytree; quantize under torch.compile is bitwise equal to eager."""

import dataclasses

import optree
import pytest
import torch
import torch.utils._pytree as pytree

import fp8func as f8

GRANULARITIES = [f8.TensorWise(), f8.AxisWise(-1), f8.AxisWise(0), f8.BlockWise((1, 32)),
                 f8.BlockWise((32, 32)), f8.MX(32)]


def _bits(q):
    return q.data.view(torch.uint8), q.scale


@pytest.mark.parametrize("g", GRANULARITIES, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_compiled_is_bitwise_eager(g, dtype):
    torch._dynamo.reset()
    spec = f8.CastSpec(f8.E4M3, g, power_of_2=False)
    x = (torch.randn(64, 96, generator=torch.Generator().manual_seed(3)) * 7).to(dtype)
    eager = f8.quantize(x, spec)
    compiled = torch.compile(lambda t: f8.quantize(t, spec), fullgraph=True)(x)
    assert isinstance(compiled, f8.Fp8Tensor) and compiled.meta == eager.meta
    for a, b in zip(_bits(compiled), _bits(eager)):
        assert torch.equal(a, b)
    deq = torch.compile(f8.dequantize, fullgraph=True)(eager, torch.float32)
    assert torch.equal(deq, f8.dequantize(eager, torch.float32))


def test_torch_pytree_roundtrip_and_keys():
    q = f8.quantize(torch.randn(8, 16), f8.CastSpec(granularity=f8.AxisWise(-1)))
    leaves, spec = pytree.tree_flatten(q)
    assert len(leaves) == 2 and leaves[0] is q.data and leaves[1] is q.scale
    q2 = pytree.tree_unflatten(leaves, spec)
    assert isinstance(q2, f8.Fp8Tensor) and q2.meta == q.meta
    paths = [pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(q)[0]]
    assert paths == [".data", ".scale"]
    doubled = pytree.tree_map(lambda t: t.float() * 2, q)
    assert isinstance(doubled, f8.Fp8Tensor) and torch.equal(doubled.scale, q.scale * 2)


def test_optree_roundtrip():
    q = f8.quantize(torch.randn(8, 16), f8.CastSpec())
    leaves, treespec = optree.tree_flatten(q, namespace="fp8func")
    assert len(leaves) == 2
    q2 = optree.tree_unflatten(treespec, leaves)
    assert isinstance(q2, f8.Fp8Tensor) and q2.meta == q.meta
    nested = {"w": q, "b": torch.ones(2)}
    assert len(optree.tree_leaves(nested, namespace="fp8func")) == 3


def test_meta_and_specs_are_hashable_static():
    q = f8.quantize(torch.randn(4, 8), f8.CastSpec(granularity=f8.BlockWise((2, 4))))
    assert hash(q.meta) == hash(f8.Fp8Meta(f8.CastSpec(granularity=f8.BlockWise((2, 4))), torch.float32))
    assert {f8.Recipe.from_name("rowwise"): 1}[f8.Recipe.from_name("rowwise")] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.meta.spec.dtype = f8.E5M2


def test_transpose_remaps_granularity():
    x = torch.randn(8, 64)
    for g, gt in [(f8.AxisWise(-1), f8.AxisWise(0)), (f8.BlockWise((1, 32)), f8.BlockWise((32, 1))),
                  (f8.MX(32), f8.MX(32, axis=0)), (f8.TensorWise(), f8.TensorWise())]:
        q = f8.quantize(x, f8.CastSpec(granularity=g))
        assert q.t().granularity == gt
        assert torch.equal(f8.dequantize(q.t()), f8.dequantize(q).t())


def test_torch_func_transforms_see_two_leaves():
    x = torch.randn(4, 32)
    spec = f8.CastSpec(granularity=f8.AxisWise(-1))
    qs = torch.func.vmap(lambda r: f8.quantize(r, f8.CastSpec()))(x)  # per-row tensorwise == rowwise
    assert torch.equal(qs.data.view(torch.uint8), f8.quantize(x, spec).data.view(torch.uint8))


ALL_SPECS = [f8.CastSpec(), f8.CastSpec(f8.E5M2, f8.AxisWise(-1), True), f8.CastSpec(granularity=f8.BlockWise((4, 8))),
             f8.CastSpec(granularity=f8.MX(8))]


@pytest.mark.parametrize("spec", ALL_SPECS, ids=lambda s: type(s.granularity).__name__)
def test_fp8_tensor_pickles_and_loads_with_weights_only(spec):
    import io
    import pickle

    q = f8.quantize(torch.randn(8, 16) * 7, spec)
    for back in (pickle.loads(pickle.dumps(q)), _saved_and_loaded(q, io)):
        assert isinstance(back, f8.Fp8Tensor) and back.meta == q.meta and back.dtype == q.dtype
        assert torch.equal(back.data.view(torch.uint8), q.data.view(torch.uint8)) and torch.equal(back.scale, q.scale)


def _saved_and_loaded(q, io):
    buf = io.BytesIO()
    torch.save({"q": q}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)["q"]


def test_an_exported_program_returning_an_fp8_tensor_saves_and_loads():
    import io

    class Quant(torch.nn.Module):
        def forward(self, x):
            return f8.quantize(x, f8.CastSpec(granularity=f8.AxisWise(-1)))

    x = torch.randn(8, 32)
    ep = torch.export.export(Quant(), (x,))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    buf.seek(0)
    got = torch.export.load(buf).module()(x)
    want = Quant()(x)
    assert isinstance(got, f8.Fp8Tensor) and got.meta == want.meta
    assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(got.scale, want.scale)


def test_jagged_fp8_tensor_has_keyed_leaves():
    q = f8.quantize_jagged(torch.randn(10, 32), torch.tensor([4, 4, 10], dtype=torch.int32),
                           f8.CastSpec(granularity=f8.AxisWise(-1)))
    paths = [pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(q)[0]]
    assert paths == [".data", ".scale"]


def test_fp8_tensor_and_configs_validate_their_fields():
    q = f8.quantize(torch.randn(4, 32), f8.CastSpec(granularity=f8.AxisWise(-1)))
    with pytest.raises(TypeError, match="data has dtype torch.float32; its meta's spec casts to torch.float8_e4m3fn"):
        f8.Fp8Tensor(torch.randn(4, 32), q.scale, q.meta)
    with pytest.raises(ValueError, match=r"takes scales of shape \(4, 1\); got \(1, 1\)"):
        f8.Fp8Tensor(q.data, torch.ones(1, 1), q.meta)
    with pytest.raises(TypeError, match="scale has dtype torch.bfloat16"):
        f8.Fp8Tensor(q.data, q.scale.bfloat16(), q.meta)
    with pytest.raises(TypeError, match=r"AxisWise\(axis=1.5\): expected an int"):
        f8.AxisWise(1.5)
    with pytest.raises(TypeError, match=r"Recipe\(grad_weight_hp='no'\): expected bool"):
        f8.Recipe(grad_weight_hp="no")
    with pytest.raises(TypeError, match=r"CastSpec\(power_of_2='yes'\)"):
        f8.CastSpec(power_of_2="yes")
    with pytest.raises(ValueError, match="give both casts"):
        f8.GemmPlan(f8.CastSpec(), None)
    # pytree code may rebuild nodes from transformed leaves (vmap's batch dim, tree_map): not validated
    assert pytree.tree_map(lambda t: t.float(), q).data.dtype == torch.float32


def test_check_finite_refuses_float64_beyond_float32_range():
    x = torch.ones(4, 8, dtype=torch.float64)
    x[1, 2] = 1e300
    with pytest.raises(ValueError, match=r"beyond the float32 range, first 1e\+300 at index \(1, 2\)"):
        f8.quantize(x, f8.CastSpec(), check_finite=True)
    assert torch.isfinite(f8.dequantize(f8.quantize(x / 1e290, f8.CastSpec(), check_finite=True))).all()
