"""Every public op under every torch.func transform, torch.compile and their compositions.

Rows are ops written as functions of their differentiable tensors; columns are transforms. Each
cell is compared bitwise with eager autograd (values and every gradient), and a vmap with the
same op applied example by example. Gradient rules: an FP8 payload is not differentiable
(``quantize`` gives zero gradients under torch.func), ``fake_quantize`` is straight-through,
``dequantize`` and ``gemm`` are differentiable in their scales, ``linear`` has its FP8 backward,
and a delayed-scaling state's gradient is the next state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vjp, vmap

import fp8func as f8
from fp8func.nn import Fp8Linear

B = 3  # examples for vmap


@dataclass(frozen=True)
class Row:
    name: str
    fn: Callable[..., torch.Tensor]
    make: Callable[[int], tuple]  # seed -> the op's inputs
    # gemm's emulated path is plain fp32 matmuls, which torch batches under vmap: bmm sums in
    # another order than mm, so batched gradients agree to fp32 rounding, not bitwise.
    batched_rtol: float = 0.0
    # Gradients that are plain fp32 sums (a bias gradient, a scale's): compiled code may sum them
    # in another order (inductor's reductions), so compiled cells compare them to fp32 rounding.
    sums: tuple[int, ...] = ()


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _xw(seed: int, m=32, k=128, n=128):
    g = _g(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / 8


def _state(seed: int):
    g = _g(seed)
    spec = f8.CastSpec()
    states = [f8.ScalingState.from_tensor(torch.randn(64, generator=g) * s, spec, 4) for s in (2.0, 0.1, 0.5)]
    return tuple(t for st in states for t in st)


def _fp8(seed: int, shape, spec):
    q = f8.quantize(torch.randn(*shape, generator=_g(seed)), spec)
    return q.data, q.scale


SPEC = f8.CastSpec(granularity=f8.AxisWise(-1))
_D, _ = _fp8(100, (32, 128), SPEC)
_DA, _ = _fp8(101, (32, 128), SPEC)
_DB, _ = _fp8(102, (64, 128), SPEC)
_OFFS = torch.tensor([8, 8, 32], dtype=torch.int32)
_MIXED = f8.LinearPlan(
    output=f8.GemmPlan(f8.CastSpec(f8.E4M3, f8.AxisWise(-1), True), f8.CastSpec(f8.E4M3, f8.AxisWise(-1), True)),
    grad_input=f8.GemmPlan(f8.CastSpec(f8.E5M2), f8.CastSpec(f8.E4M3)),
    grad_weight=f8.GemmPlan(f8.CastSpec(f8.E5M2), f8.CastSpec(f8.E4M3)), name="rowwise-forward")


def _delayed(x, w, *state):
    return f8.linear_delayed(x, w, None, "delayed", f8.LinearScalingState.from_tensors(state))[0]


def _layer(recipe) -> Fp8Linear:
    torch.manual_seed(0)
    return f8.nn.Fp8Linear(128, 128, bias=True, recipe=recipe, fsdp_fp8_all_gather=False)


_LAYER, _LAYER_DELAYED = _layer("tensorwise"), _layer("delayed")
_STATE_NAMES = tuple(f"fp8_{r}_{k}" for r in ("x", "w", "dy") for k in ("history", "scale"))


def _module(x, w, b):
    return functional_call(_LAYER, {"weight": w, "bias": b}, (x,))


def _module_delayed(x, w, b, *state):
    return f8.nn.apply(_LAYER_DELAYED, {"weight": w, "bias": b}, dict(zip(_STATE_NAMES, state)), x)[0]


ROWS = [
    Row("quantize", lambda x: f8.dequantize(f8.quantize(x, SPEC)), lambda s: (_xw(s)[0],)),
    Row("fake_quantize", lambda x: f8.fake_quantize(x, SPEC), lambda s: (_xw(s)[0],)),
    Row("dequantize", lambda s: f8.dequantize(f8.Fp8Tensor(_D, s, f8.Fp8Meta(SPEC, torch.float32, None))),
        lambda s: (torch.rand(32, 1, generator=_g(s)) + 0.5,), sums=(0,)),
    Row("gemm", lambda sa, sb: f8.gemm(f8.Fp8Tensor(_DA, sa, f8.Fp8Meta(SPEC, torch.float32, None)),
                                       f8.Fp8Tensor(_DB, sb, f8.Fp8Meta(SPEC, torch.float32, None)).t(),
                                       out_dtype=torch.float32),
        lambda s: (torch.rand(32, 1, generator=_g(s)) + 0.5, torch.rand(64, 1, generator=_g(s + 1)) + 0.5), 1e-6,
        sums=(0, 1)),
    *[Row(f"linear-{r}", lambda x, w, r=r: f8.linear(x, w, recipe=r), _xw)
      for r in ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")],
    Row("linear-blockwise", lambda x, w: f8.linear(x, w, recipe="blockwise"), lambda s: _xw(s, m=128)),
    Row("linear-mixed-plan", lambda x, w: f8.linear(x, w, recipe=_MIXED), _xw),
    Row("linear_delayed", _delayed, lambda s: (*_xw(s), *_state(s))),
    Row("grouped_linear", lambda x, w: f8.grouped_linear(x, w, _OFFS),
        lambda s: (_xw(s)[0], torch.randn(3, 64, 128, generator=_g(s + 7)) / 8)),
    Row("Fp8Linear", _module, lambda s: (*_xw(s), torch.randn(128, generator=_g(s + 3))), sums=(2,)),
    Row("Fp8Linear-delayed", _module_delayed,
        lambda s: (*_xw(s), torch.randn(128, generator=_g(s + 3)), *_state(s)), sums=(2,)),
]
COLUMNS = ["grad", "vjp", "vmap", "functional_call", "compile", "compile∘grad", "compile∘vjp", "compile∘vmap∘grad",
           "grad∘vmap"]
SLOW = {"compile", "compile∘grad", "compile∘vjp", "compile∘vmap∘grad"}


class _Holder(nn.Module):
    """Holds the op's inputs as parameters; its forward returns them (functional_call swaps them)."""

    def __init__(self, tensors):
        super().__init__()
        self.n = len(tensors)
        for i, t in enumerate(tensors):
            self.register_parameter(f"p{i}", nn.Parameter(torch.zeros_like(t)))

    def forward(self):
        return tuple(getattr(self, f"p{i}") for i in range(self.n))


def _cot(y: torch.Tensor, seed: int = 9) -> torch.Tensor:
    return torch.randn(y.shape, generator=_g(seed)).to(y.dtype)


def _eager(row: Row, inputs: tuple, cot=None):
    """(y, gradients of (y * cot).sum() by eager autograd; zeros where y does not depend on an input)."""
    xs = [t.clone().requires_grad_() for t in inputs]
    y = row.fn(*xs)
    cot = _cot(y) if cot is None else cot
    if y.requires_grad:
        (y * cot).sum().backward()
    return y.detach(), tuple(torch.zeros_like(x) if x.grad is None else x.grad for x in xs)


def _loss(row: Row, cot):
    return lambda *xs: (row.fn(*xs) * cot).sum()


def _same(a, b, what: str, rtol: float = 0.0, sums: tuple[int, ...] = ()) -> None:
    a, b = (tuple(t) if isinstance(t, (tuple, list)) else (t,) for t in (a, b))
    assert len(a) == len(b), what
    for i, (u, v) in enumerate(zip(a, b)):
        assert u.shape == v.shape, f"{what}[{i}]"
        if i in sums:
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5 * v.abs().max().item(), msg=f"{what}[{i}]")
        elif rtol:
            torch.testing.assert_close(u, v, rtol=rtol, atol=rtol * v.abs().max().item(), msg=f"{what}[{i}]")
        else:
            assert torch.equal(u.nan_to_num(nan=7.0), v.nan_to_num(nan=7.0)), f"{what}[{i}]"


def _batched(row: Row) -> tuple[tuple, list[tuple]]:
    examples = [row.make(s) for s in range(B)]
    return tuple(torch.stack(parts) for parts in zip(*examples)), examples


def _cell(row: Row, column: str) -> None:
    inputs = row.make(0)
    y, grads = _eager(row, inputs)
    cot = _cot(y)
    argnums = tuple(range(len(inputs)))
    if column == "grad":
        _same(grad(_loss(row, cot), argnums=argnums)(*inputs), grads, "grad")
    elif column == "vjp":
        out, fn = vjp(row.fn, *inputs)
        _same(out, y, "vjp value")
        _same(fn(cot), grads, "vjp")
    elif column == "compile":
        xs = [t.clone().requires_grad_() for t in inputs]
        out = torch.compile(row.fn, fullgraph=True)(*xs)
        _same(out.detach(), y, "compiled value")
        if out.requires_grad:
            (out * cot).sum().backward()
        _same(tuple(torch.zeros_like(x) if x.grad is None else x.grad for x in xs), grads, "compiled grads",
              sums=row.sums)
    elif column == "compile∘grad":
        got = torch.compile(grad(_loss(row, cot), argnums=argnums), fullgraph=True)(*inputs)
        _same(got, grads, "compile∘grad", sums=row.sums)
    elif column == "compile∘vjp":
        got = torch.compile(lambda *xs: vjp(row.fn, *xs)[1](cot), fullgraph=True)(*inputs)
        _same(got, grads, "compile∘vjp", sums=row.sums)
    elif column == "functional_call":
        holder = _Holder(inputs)
        params = {f"p{i}": t for i, t in enumerate(inputs)}
        got = grad(lambda p: _loss(row, cot)(*functional_call(holder, p, ())))(params)
        _same(tuple(got[f"p{i}"] for i in range(len(inputs))), grads, "functional_call")
    else:
        batched, examples = _batched(row)
        per_example = [_eager(row, ex, cot) for ex in examples]
        if column == "vmap":
            _same(vmap(row.fn)(*batched), torch.stack([p[0] for p in per_example]), "vmap", row.batched_rtol)
            return
        want = tuple(torch.stack(parts) for parts in zip(*(p[1] for p in per_example)))
        if column == "grad∘vmap":
            cots = torch.stack([cot] * B)
            got = grad(lambda *xs: (vmap(row.fn)(*xs) * cots).sum(), argnums=argnums)(*batched)
        else:  # compile∘vmap∘grad
            got = torch.compile(vmap(grad(_loss(row, cot), argnums=argnums)), fullgraph=True)(*batched)
        _same(got, want, column, row.batched_rtol, row.sums if column.startswith("compile") else ())


@pytest.mark.parametrize("column", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in COLUMNS])
@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_transform_matrix(row: Row, column: str):
    torch._dynamo.reset()
    _cell(row, column)


def test_gradient_rules_of_the_casts():
    """The FP8 payload is not differentiable: eager autograd refuses a backward through it, and
    torch.func gives zeros; fake_quantize is the differentiable round trip, straight-through,
    bitwise the same values."""
    x = torch.randn(8, 32, requires_grad=True)
    q = f8.quantize(x, SPEC)
    assert not q.data.requires_grad and not q.scale.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        f8.dequantize(q).sum().backward()
    y = f8.fake_quantize(x, SPEC)
    assert torch.equal(y, f8.dequantize(q))
    y.backward(torch.full_like(y, 3.0))
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
