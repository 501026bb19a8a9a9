"""TP-local scaling (the TP styles' ``local_scales=True``): bitwise one process that simulates the
ranks with the same scale groups, and no amax all-reduce in the layers' forward or backward.

The reference here is written from the contract in docs/tp.md, with ``fp8func.quantize`` /
``fp8func.gemm`` on plain tensors: each rank's shard of a TP-sharded activation or gradient is
cast with its own amax; a sequence gather is the ranks' casts side by side with one scale per
row (its rank's); a GEMM contracting over gathered tokens is one tensorwise GEMM per chunk of
S/tp tokens, summed in fp32 in token order and rounded once. The ranks' own GEMMs (column
shards, row shards) are computed one by one, on the shapes each rank has.
"""

import contextlib

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

import fp8func as f8
from fp8func._qtensor import Fp8Meta, Fp8Tensor

from .dist_harness import run_workers

pytestmark = pytest.mark.slow  # every test here spawns gloo processes

B, S, D, H = 2, 64, 64, 128  # batch, sequence, model dim, MLP hidden (split over the TP ranks)
X_SPEC, W_SPEC, DY_SPEC = f8.CastSpec(f8.E4M3), f8.CastSpec(f8.E4M3), f8.CastSpec(f8.E5M2)


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(D, H, bias=False)
        self.up = nn.Linear(D, H, bias=False)
        self.down = nn.Linear(H, D, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def _data():
    g = torch.Generator().manual_seed(1)
    # one large token per rank's chunk at a different size: the ranks' amaxes differ by 100x
    x = torch.randn(B, S, D, generator=g)
    x[:, 0, 0] = 300.0
    dy = torch.randn(B, S, D, generator=g) * 1e-3
    return x, dy


def _weights():
    torch.manual_seed(0)
    return SwiGLU().to(torch.bfloat16)  # bf16 weights: grad_weight is rounded once from the fp32 sums


def _collectives(mode: CommDebugMode) -> dict[str, int]:
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items() if n}


def _sp_mlp(rank, world, recipe, local, compiled):
    from fp8func.distributed import Fp8ColwiseParallel, Fp8RowwiseParallel

    mesh = init_device_mesh("cpu", (world,))
    model = f8.convert(_weights(), recipe, fsdp_fp8_all_gather=False)
    col = dict(input_layouts=Shard(1), local_scales=local)
    parallelize_module(model, mesh, {"gate": Fp8ColwiseParallel(**col), "up": Fp8ColwiseParallel(**col),
                                     "down": Fp8RowwiseParallel(output_layouts=Shard(1), local_scales=local)})
    run = torch.compile(model, fullgraph=True) if compiled else model  # fullgraph: no graph break
    x_full, dy_full = _data()
    x = x_full.chunk(world, dim=1)[rank].clone().requires_grad_()
    # collectives counted eagerly (a dispatch mode does not compile)
    fwd, bwd = (contextlib.nullcontext() if compiled else CommDebugMode() for _ in range(2))
    with fwd:
        y = run(x)
    with bwd:
        y.backward(dy_full.chunk(world, dim=1)[rank])
    return {"y": y.detach().clone(), "dx": x.grad.clone(),
            "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()},
            "forward": None if compiled else _collectives(fwd), "backward": None if compiled else _collectives(bwd)}


def _gathered(parts: list[torch.Tensor], spec: f8.CastSpec) -> tuple[Fp8Tensor, list[Fp8Tensor]]:
    """The ranks' shards ``[B, S/tp, F]`` cast each with its own amax, and the sequence gather of
    those casts: ``[B*S, F]`` in token order with one scale per row (its rank's)."""
    qs = [f8.quantize(p.reshape(-1, p.shape[-1]), spec) for p in parts]
    s = parts[0].shape[1]
    data = torch.stack([q.data.view(torch.uint8).reshape(B, s, -1) for q in qs], 1).reshape(B * S, -1)
    rows = torch.stack([q.scale.expand(B * s, 1).reshape(B, s, 1) for q in qs], 1).reshape(B * S, 1)
    row_spec = spec.with_granularity(f8.AxisWise(-1))
    return Fp8Tensor(data.view(spec.dtype), rows, Fp8Meta(row_spec, torch.float32, None)), qs


def _chunked_grad_weight(dy: Fp8Tensor, x: Fp8Tensor, s: int, path: str) -> torch.Tensor:
    """``dy.T @ x`` over ``M`` tokens: one tensorwise GEMM per chunk of ``s`` tokens (each operand
    with its chunk's scale), summed in fp32 in token order, rounded to bf16 once."""
    total = 0
    for c in range(dy.shape[0] // s):
        rows = slice(c * s, (c + 1) * s)
        dy_c, x_c = (Fp8Tensor(q.data[rows], q.scale[rows][:1] if q.scale.shape[0] > 1 else q.scale,
                               Fp8Meta(q.spec.with_granularity(f8.TensorWise()), torch.float32, None)) for q in (dy, x))
        total = total + f8.gemm(dy_c.t(), x_c, torch.float32, path=path)
    return total.to(torch.bfloat16)


def _reference(world: int, path: str = "auto") -> dict:
    """One process, the ranks one by one (see the module docstring)."""
    model = _weights()
    x_full, dy_full = _data()
    w = {name: f8.quantize(getattr(model, name).weight.detach(), W_SPEC) for name in ("gate", "up", "down")}
    h, s = H // world, S // world

    def shard(name, r, dim):  # the weight cast's shard on rank r (its scale the whole weight's)
        data = w[name].data.view(torch.uint8).narrow(dim, r * h, h).contiguous().view(W_SPEC.dtype)
        return Fp8Tensor(data, w[name].scale, Fp8Meta(W_SPEC, torch.bfloat16, None))

    xg, _ = _gathered(list(x_full.chunk(world, dim=1)), X_SPEC)
    dyg, _ = _gathered(list(dy_full.chunk(world, dim=1)), DY_SPEC)
    y = dx_gate = dx_up = 0
    grads = {n: [] for n in ("gate.weight", "up.weight", "down.weight")}
    for r in range(world):
        g = f8.gemm(xg, shard("gate", r, 0).t(), torch.float32, path=path).requires_grad_()
        u = f8.gemm(xg, shard("up", r, 0).t(), torch.float32, path=path).requires_grad_()
        hid = torch.nn.functional.silu(g) * u
        qh = f8.quantize(hid.detach(), X_SPEC)  # down's input, sharded along its features: this rank's amax
        y = y + f8.gemm(qh, shard("down", r, 1).t(), torch.float32, path=path)  # partial sums, reduced
        dh = f8.gemm(dyg, shard("down", r, 1), torch.float32, path=path)
        grads["down.weight"].append(_chunked_grad_weight(dyg, qh, s, path))
        dg, du = torch.autograd.grad(hid, (g, u), dh)
        for name, d in (("gate", dg), ("up", du)):
            qd = f8.quantize(d, DY_SPEC)  # a column-parallel grad_output: this rank's amax
            part = f8.gemm(qd, shard(name, r, 0), torch.float32, path=path)
            dx_gate, dx_up = (dx_gate + part, dx_up) if name == "gate" else (dx_gate, dx_up + part)
            grads[f"{name}.weight"].append(_chunked_grad_weight(qd, xg, s, path))
    # dx: gate's and up's partial sums, each reduce-scattered, then added (as x.grad accumulates them)
    return {"y": y.reshape(B, S, D), "dx_parts": (dx_gate.reshape(B, S, D), dx_up.reshape(B, S, D)),
            "grads": {"gate.weight": torch.cat(grads["gate.weight"]), "up.weight": torch.cat(grads["up.weight"]),
                      "down.weight": torch.cat(grads["down.weight"], dim=1)}}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_local_scales_are_bitwise_one_process_with_the_same_scale_groups(compiled):
    """TP=2, a sequence-parallel SwiGLU: output, input gradient and every weight gradient are
    bitwise the one-process reference; compiled (fullgraph) bitwise eager."""
    ref = _reference(2)
    ranks = run_workers(_sp_mlp, 2, "tensorwise", True, compiled)
    for rank, out in enumerate(ranks):
        assert torch.equal(out["y"], ref["y"].chunk(2, dim=1)[rank])
        dx = sum(part.chunk(2, dim=1)[rank] for part in ref["dx_parts"])
        assert torch.equal(out["dx"], dx)
        for name, g in ref["grads"].items():
            assert torch.equal(out["grads"][name], g), name


def test_local_scales_run_no_amax_all_reduce():
    """Eager, counted by DTensor's CommDebugMode per rank: with local scales the backward runs no
    all-reduce and the forward only the weights' (their tensorwise amax over TP, one per weight;
    under FSDP2 they are precomputed once per optimizer step instead); global scales add one per
    sequence gather and per cast of a TP-sharded activation or grad_output. The all-gathers and
    reduce-scatters are the same."""
    local = run_workers(_sp_mlp, 2, "tensorwise", True, False)[0]
    glob = run_workers(_sp_mlp, 2, "tensorwise", False, False)[0]
    assert local["forward"] == {"all_reduce": 3, "all_gather_into_tensor": 2, "reduce_scatter_tensor": 1}, local
    assert local["backward"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 2}, local
    # global: + gate's and up's input gathers and down's input (forward), + gate's and up's
    # grad_outputs and down's grad_output gather (backward)
    assert glob["forward"] == {**local["forward"], "all_reduce": 3 + 3}, glob
    assert glob["backward"] == {**local["backward"], "all_reduce": 3}, glob


def _high_precision() -> dict:
    """The SwiGLU in fp32, no FP8 (the bf16 weights' values), one process."""
    model = _weights().float()
    x_full, dy_full = _data()
    x = x_full.clone().requires_grad_()
    y = model(x)
    y.backward(dy_full)
    return {"y": y.detach(), "dx": x.grad, "grads": {n: p.grad for n, p in model.named_parameters()}}


def test_local_scales_stay_close_to_global_scales():
    """The values: every output and gradient finite, and as close to the fp32 computation as the
    global-scale run (SQNR, within 1 dB), though one rank's tokens are 100x larger than the other's."""
    hp = _high_precision()
    local = run_workers(_sp_mlp, 2, "tensorwise", True, False)
    glob = run_workers(_sp_mlp, 2, "tensorwise", False, False)
    for rank, (a, b) in enumerate(zip(local, glob)):
        for key in ("y", "dx", *(f"grads.{n}" for n in hp["grads"])):
            def get(out, key=key):
                return out["grads"][key[6:]] if key.startswith("grads.") else out[key].chunk(2, dim=1)[rank] \
                    if out is hp else out[key]
            want, got_local, got_global = get(hp), get(a), get(b)
            assert torch.isfinite(got_local).all(), key
            q_local, q_global = f8.sqnr(want, got_local.float()), f8.sqnr(want, got_global.float())
            print(rank, key, round(q_local, 2), round(q_global, 2))
            assert q_local > 20 and q_local > q_global - 3, (key, q_local, q_global)


def test_local_scales_on_four_ranks():
    """TP=4 (chunks of 16 tokens): every weight gradient bitwise the reference (each is one
    rank's own GEMMs); the output and the input gradient, which sum four ranks' partial sums in
    the reduce-scatter's order, equal to the reference's sums up to that order."""
    ref = _reference(4)
    for rank, out in enumerate(run_workers(_sp_mlp, 4, "tensorwise", True, False)):
        for name, g in ref["grads"].items():
            assert torch.equal(out["grads"][name], g), name
        for got, want in ((out["y"], ref["y"]), (out["dx"], sum(ref["dx_parts"]))):
            want = want.chunk(4, dim=1)[rank]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


class QKV(nn.Module):
    """An attention block's projections: q, k, v read one input, o writes the output."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D, bias=False) for _ in range(4))

    def forward(self, x):
        return self.o(self.q(x) * torch.sigmoid(self.k(x)) + self.v(x))


def _sp_qkv(rank, world):
    """The attention projections sequence-parallel (one FP8 gather for q, k and v), global and
    TP-local scales: outputs, gradients and the collectives of each."""
    from fp8func.distributed import Fp8ColwiseParallel, Fp8RowwiseParallel, PrepareFp8ModuleInput

    mesh = init_device_mesh("cpu", (world,))
    x_full, dy_full = _data()
    runs = {}
    for local in (False, True):
        torch.manual_seed(0)
        model = f8.convert(QKV(), "tensorwise", fsdp_fp8_all_gather=False)
        col = Fp8ColwiseParallel(local_scales=local)
        parallelize_module(model, mesh, {
            "": PrepareFp8ModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(), local_scales=local),
            "q": col, "k": col, "v": col, "o": Fp8RowwiseParallel(output_layouts=Shard(1), local_scales=local)})
        x = x_full.chunk(world, dim=1)[rank].clone().requires_grad_()
        with CommDebugMode() as fwd:
            y = model(x)
        with CommDebugMode() as bwd:
            y.backward(dy_full.chunk(world, dim=1)[rank])
        runs[local] = {"y": y.detach().clone(), "dx": x.grad.clone(), "forward": _collectives(fwd),
                       "backward": _collectives(bwd),
                       "grads": {n: p.grad.full_tensor() for n, p in model.named_parameters()}}
    return runs


def test_attention_projections_with_one_gather_run_no_amax_all_reduce():
    """``PrepareFp8ModuleInput`` + the q/k/v/o styles with local scales: one gather for q, k, v,
    no all-reduce but the four weights' amaxes, and values as close to fp32 as the global scales'."""
    for runs in run_workers(_sp_qkv, 2):
        local, glob = runs[True], runs[False]
        assert local["forward"] == {"all_reduce": 4, "all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, local
        assert local["backward"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, local
        # global: + the gather's cast and o's input (forward), q's, k's and v's grad_outputs and
        # o's grad_output gather (backward)
        assert glob["forward"]["all_reduce"] == 4 + 2 and glob["backward"]["all_reduce"] == 4, glob
        for got, want in [(local["y"], glob["y"]), (local["dx"], glob["dx"])] + [
                (local["grads"][n], glob["grads"][n]) for n in local["grads"]]:
            assert torch.isfinite(got).all() and f8.sqnr(want, got) > 15, f8.sqnr(want, got)


def _refusals(rank, world):
    """What parallelize_module raises for combinations TP-local scales cannot serve, on each rank."""
    from fp8func.distributed import Fp8ColwiseParallel, Fp8RowwiseParallel, PrepareFp8ModuleInput

    mesh = init_device_mesh("cpu", (world,))
    cases = {
        "rowwise": ("rowwise", False, {"0": Fp8ColwiseParallel(input_layouts=Shard(1), local_scales=True)}),
        "delayed": ("delayed", False, {"0": Fp8RowwiseParallel(local_scales=True)}),
        "prepare": ("rowwise", False, {"": PrepareFp8ModuleInput(input_layouts=Shard(1),
                                                                  desired_input_layouts=Replicate(),
                                                                  local_scales=True)}),
        "bias": ("tensorwise", True, {"0": Fp8ColwiseParallel(local_scales=True)}),
        "flag": ("tensorwise", False, {"0": Fp8RowwiseParallel(local_scales="on")}),
    }
    out = {}
    for key, (recipe, bias, plan) in cases.items():
        model = f8.convert(nn.Sequential(nn.Linear(D, D, bias=bias)), recipe, fsdp_fp8_all_gather=False)
        try:
            parallelize_module(model, mesh, plan)
            out[key] = "no error"
        except (TypeError, ValueError) as e:
            out[key] = f"{type(e).__name__}: {e}"
    return out


def test_combinations_local_scales_cannot_serve_raise_on_every_rank():
    for out in run_workers(_refusals, 2):
        for key in ("rowwise", "delayed", "prepare"):
            assert out[key].startswith("ValueError: ") and "TP-local scales apply to dynamic tensorwise recipes" \
                in out[key] and "Use local_scales=False with this recipe" in out[key], out[key]
        assert "recipe 'rowwise' (non-tensorwise or high-precision casts of ['input', 'weight', 'grad_output'])" \
            in out["rowwise"], out["rowwise"]
        assert "(delayed scaling)" in out["delayed"], out["delayed"]
        assert out["bias"].startswith("ValueError: Fp8ColwiseParallel(local_scales=True) on a Fp8Linear with a bias")
        assert "Drop the bias, or use local_scales=False for this layer" in out["bias"], out["bias"]
        assert out["flag"] == "TypeError: Fp8RowwiseParallel(local_scales='on'): expected True or False.", out["flag"]
