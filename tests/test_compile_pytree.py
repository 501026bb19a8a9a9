"""Fp8Tensor as a pytree; quantize under torch.compile is bitwise equal to eager."""

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
    with pytest.raises(Exception):
        q.meta.spec.dtype = f8.E5M2  # frozen


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
