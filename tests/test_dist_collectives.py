"""Sharded quantization and all_gather across processes (gloo): bitwise against the full tensor."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import fp8func as f8
from fp8func._scaling import block_lengths

from .dist_harness import run_workers

pytestmark = pytest.mark.slow  # every test here spawns processes (gloo or torchrun)

GRANULARITIES = [f8.TensorWise(), f8.AxisWise(-1), f8.AxisWise(0), f8.BlockWise((1, 4)),
                 f8.BlockWise((4, 4)), f8.MX(4), f8.MX(4, axis=0)]


def _split(x, dim, sizes):
    return list(x.split(sizes, dim=dim))


def _bits(q):
    return q.data.view(torch.uint8), q.scale


def _gather_equals_full(rank, world_size, rows, sizes_by_case):
    mesh = init_device_mesh("cpu", (world_size,))
    failures = []
    for dim in (0, 1):
        for gi, g in enumerate(GRANULARITIES):
            for dtype, p2 in ((f8.E4M3, False), (f8.E5M2, True)):
                spec = f8.CastSpec(dtype, g, p2)
                x = torch.randn(rows, 16, generator=torch.Generator().manual_seed(gi)) * 3
                x = x if dim == 0 else x.t().contiguous()
                try:
                    blocks = block_lengths(spec.granularity, tuple(x.shape))
                except ValueError:
                    continue  # this granularity does not tile this shape
                blocked = blocks[dim] is not None and blocks[dim] > 1
                sizes = sizes_by_case["block" if blocked else "plain"]
                if sum(sizes) != x.shape[dim]:
                    continue
                shard = _split(x, dim, sizes)[rank]
                sharding = f8.Sharding(mesh, (Shard(dim),))
                q = f8.quantize(shard, spec, sharding=sharding)
                full = f8.all_gather(q, mesh, 0, dim)
                want = f8.quantize(x, spec)
                if not all(torch.equal(a, b) for a, b in zip(_bits(full), _bits(want))):
                    failures.append((dim, repr(g), str(dtype)))
                if full.meta.sharding is not None:
                    failures.append(("sharding not cleared", repr(g)))
    return failures


@pytest.mark.parametrize("world_size,rows,sizes", [
    (2, 16, {"plain": [9, 7], "block": [8, 8]}),
    (4, 16, {"plain": [5, 5, 5, 1], "block": [8, 4, 4, 0]}),   # uneven, and an empty shard
    (4, 3, {"plain": [1, 1, 1, 0], "block": [0, 0, 0, 0]}),
])
def test_all_gather_of_quantized_shards_is_quantized_full(world_size, rows, sizes):
    results = run_workers(_gather_equals_full, world_size, rows, sizes)
    assert results == [[]] * world_size, results[0]


def _two_d(rank, world_size):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    r0, r1 = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    shard = x.chunk(2, 0)[r0].chunk(2, 1)[r1]
    out = {}
    for name, g in (("tensorwise", f8.TensorWise()), ("rowwise", f8.AxisWise(-1)), ("colwise", f8.AxisWise(0))):
        spec = f8.CastSpec(granularity=g)
        sharding = f8.Sharding(mesh, (Shard(0), Shard(1)))
        out[name + "_dims"] = sharding.amax_mesh_dims(g, tuple(shard.shape))
        q = f8.quantize(shard, spec, sharding=sharding)
        q = f8.all_gather(f8.all_gather(q, mesh, 1, 1), mesh, 0, 0)
        want = f8.quantize(x, spec)
        out[name] = (torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8))
                     and torch.equal(q.scale, want.scale))
        out[name + "_kernels"] = _kernel_cast_is_quantize(shard.contiguous(), spec, sharding)
    out["delayed_kernels"] = _kernel_delayed_cast_is_quantize_delayed(shard.contiguous(), x, f8.Sharding(
        mesh, (Shard(0), Shard(1))))
    return out


def _kernel_delayed_cast_is_quantize_delayed(shard, x, sharding) -> bool:
    """The delayed cast of a shard through ``kernels.cast_amax`` (its twin here) records the
    mesh-reduced amax: the same cast, new state and meta as ``quantize(state=..., sharding=...)``,
    and the history's newest entry is the full tensor's amax on every rank."""
    from fp8func._casts import cast_delayed
    from fp8func._delayed import ScalingState, next_state, quantize_delayed

    spec = f8.CastSpec()
    state = ScalingState.from_tensor(x * 0.25, spec, 4)  # saturates: x is 4x larger
    q, q_t, amax = cast_delayed(shard, spec, state.scale, transpose=True, kernels="reference")
    new = next_state(state, amax, spec, "max", sharding, tuple(shard.shape))
    want, want_new = quantize_delayed(shard, spec, state, sharding=sharding)
    return (torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(q.scale, want.scale)
            and q.meta.spec == want.meta.spec
            and torch.equal(q_t.data.view(torch.uint8), want.data.t().contiguous().view(torch.uint8))
            and all(torch.equal(a, b) for a, b in zip(new, want_new))
            and new.amax_history[0] == x.abs().max() and new.amax_history[1] == (x * 0.25).abs().max())


def _kernel_cast_is_quantize(shard, spec, sharding) -> bool:
    """``cast`` through the kernel dispatch (its twins on the CPU: amax, mesh reduction, cast with
    the reduced scale; FSDP2's pre-all-gather and the TP sequence gather use it) is ``quantize``."""
    import fp8func._casts as casts_mod

    tensorwise = isinstance(spec.granularity, f8.TensorWise)
    q, q_t = casts_mod.cast(shard, spec, transpose=tensorwise, sharding=(sharding,), kernels="reference")
    want = f8.quantize(shard, spec, sharding=sharding)
    same = (torch.equal(q.data.view(torch.uint8), want.data.view(torch.uint8)) and torch.equal(q.scale, want.scale)
            and q.meta == want.meta)
    if tensorwise:
        want_t = f8.quantize(shard.t(), spec, sharding=sharding.transpose(2, 0, 1))
        same = same and torch.equal(q_t.data.view(torch.uint8), want_t.data.view(torch.uint8))
        same = same and torch.equal(q_t.scale, want_t.scale)
    return same


def test_two_d_mesh_reduces_over_exactly_the_right_dims():
    res = run_workers(_two_d, 4)
    for r in res:
        assert r["tensorwise"] and r["rowwise"] and r["colwise"], r
        assert r["tensorwise_kernels"] and r["rowwise_kernels"] and r["colwise_kernels"], r
        assert r["delayed_kernels"], r
        assert r["tensorwise_dims"] == (0, 1)  # split along both dims
        assert r["rowwise_dims"] == (1,)  # a row scale spans dim 1 only
        assert r["colwise_dims"] == (0,)


def _errors(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    msgs = []
    q = f8.quantize(torch.randn(4, 16), f8.CastSpec())  # no sharding: a local scale
    try:
        f8.all_gather(q, mesh)
    except ValueError as e:
        msgs.append(str(e))
    try:
        f8.Sharding(mesh, (Shard(0),)).amax_mesh_dims(f8.BlockWise((4, 4)), (6, 16))
    except ValueError as e:
        msgs.append(str(e))
    try:
        f8.Sharding(mesh, (Shard(0), Replicate()))
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def test_sharding_errors_say_how_to_fix():
    msgs = run_workers(_errors, 2)[0]
    assert "Quantize the shard with sharding=fp8func.Sharding(mesh, placements)" in msgs[0]
    assert "local size 6 is not a multiple of block 4, so a block straddles two ranks" in msgs[1]
    assert "2 placements" in msgs[2] and "1-dim mesh" in msgs[2]


def _sharding_of_dtensor(rank, world_size):
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randn(10, 32, generator=torch.Generator().manual_seed(5))
    out = {}
    for name, g, placement in (("tw_rows", f8.TensorWise(), Shard(0)), ("tw_cols", f8.TensorWise(), Shard(1)),
                               ("row_rows", f8.AxisWise(-1), Shard(0)), ("row_cols", f8.AxisWise(-1), Shard(1))):
        dt = distribute_tensor(x, mesh, [placement])
        sharding = f8.Sharding.of(dt)
        spec = f8.CastSpec(granularity=g)
        q = f8.quantize(dt.to_local(), spec, sharding=sharding)
        full = f8.all_gather(q, mesh, 0, placement.dim)
        want = f8.quantize(x, spec)
        out[name] = (torch.equal(full.data.view(torch.uint8), want.data.view(torch.uint8))
                     and torch.equal(full.scale, want.scale), sharding.amax_mesh_dims(g, tuple(q.shape)))
    return out


def test_sharding_of_dtensor():
    for r in run_workers(_sharding_of_dtensor, 2):
        assert r["tw_rows"] == (True, (0,)) and r["tw_cols"] == (True, (0,))
        assert r["row_rows"] == (True, ())  # a row scale lies wholly inside a row shard: no reduction
        assert r["row_cols"] == (True, (0,))


def _more_errors(rank, world_size):
    from torch.distributed.tensor import Partial

    mesh = init_device_mesh("cpu", (world_size,))
    msgs = []
    for make in (lambda: f8.Sharding("mesh", (Shard(0),)), lambda: f8.Sharding(mesh, (Partial(),)),
                 lambda: f8.Sharding.of(torch.ones(2))):
        try:
            make()
        except (TypeError, ValueError) as e:
            msgs.append(str(e))
    q = f8.quantize(torch.randn(4, 16), f8.CastSpec(granularity=f8.BlockWise((4, 4))),
                    sharding=f8.Sharding(mesh, (Shard(0),)))
    try:
        f8.all_gather(q, mesh, sizes=[4, 2])
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def test_more_sharding_errors():
    msgs = run_workers(_more_errors, 2)[0]
    assert "expected a torch.distributed DeviceMesh" in msgs[0]
    assert "a Partial() placement holds partial sums" in msgs[1]
    assert "Sharding.of: expected a DTensor, got Tensor" in msgs[2]
    assert "shard sizes [4, 2] along dim 0 are not multiples of block 4" in msgs[3]


def _dtensor_casts(rank, world_size):
    """Eager casts of DTensors through the kernel dispatch (twins on the CPU) against DTensor ops."""
    from torch.distributed.tensor import DTensor

    import fp8func._casts as casts_mod
    import fp8func.distributed._dtensor as dtensor_mod

    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 16, generator=g) * 4  # 9 rows: uneven over 2 ranks
    bad = []

    calls = {"reference": 0, "off": 0}
    orig = dtensor_mod._cast_dtensor

    def counted(t, spec, transpose, kernels):
        calls[kernels] += 1
        return orig(t, spec, transpose, kernels)

    def run(mode, fn):
        dtensor_mod._cast_dtensor = counted
        try:
            return fn(mode)
        finally:
            dtensor_mod._cast_dtensor = orig

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    for placement in (Shard(0), Shard(1), Replicate()):
        d = DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [placement])
        for gran in (f8.TensorWise(), f8.AxisWise(-1)):
            spec = f8.CastSpec(granularity=gran)
            transpose = isinstance(gran, f8.TensorWise)
            ours = run("reference", lambda mode: casts_mod.cast(d, spec, transpose, kernels=mode))
            plain = run("off", lambda mode: casts_mod.cast(d, spec, transpose, kernels=mode))
            for a, b in zip(ours, plain):
                if a is None:
                    continue
                local = lambda t: t.to_local().contiguous().view(torch.uint8)  # noqa: E731 (gloo moves no fp8)
                same = (torch.equal(local(a.data), local(b.data))
                        and torch.equal(full(a.scale), full(b.scale)) and a.data.placements == b.data.placements
                        and a.scale.placements == b.scale.placements and a.data.shape == b.data.shape)
                if not same:
                    bad.append((str(placement), repr(gran)))
    # a tensor-parallel linear, eager: column-parallel weight, replicated input
    w = torch.randn(8, 16, generator=g) / 4
    dy = torch.randn(6, 8, generator=g)
    for recipe in ("tensorwise", "rowwise"):
        outs = {}
        for mode in ("reference", "off"):
            xd = DTensor.from_local(x[:6].clone(), mesh, [Replicate()], run_check=False).requires_grad_()
            wd = DTensor.from_local(w.chunk(2, 0)[rank].clone(), mesh, [Shard(0)], run_check=False).requires_grad_()
            y = run(mode, lambda m: f8.linear(xd, wd, recipe=f8.Recipe.from_name(recipe, kernels=m)))
            dy_local = dy.chunk(2, 1)[rank].contiguous()
            run(mode, lambda m: y.backward(DTensor.from_local(dy_local, mesh, [Shard(1)], run_check=False)))
            outs[mode] = [full(t) for t in (y, xd.grad, wd.grad)]
        if not all(torch.equal(a, b) for a, b in zip(outs["reference"], outs["off"])):
            bad.append(("linear", recipe))
    # 6 direct casts; tensorwise linear x, w, dy (and dy.T); row-wise x, w (its dy with the
    # transposed copy, and the weight's grad_input cast, take other groups: DTensor ops)
    if calls["off"] or calls["reference"] != 6 + 3 + 2:
        bad.append(("kernel path not taken as expected", calls))
    return bad


def test_eager_dtensor_casts_through_the_kernels_are_the_dtensor_casts():
    """An eager Fp8Linear on DTensors (tensor parallel without compile, or a layer outside the
    compiled regions) casts each local shard with the kernels and the mesh-reduced amax: the same
    bits and placements as DTensor's own ops."""
    assert run_workers(_dtensor_casts, 2) == [[], []]
