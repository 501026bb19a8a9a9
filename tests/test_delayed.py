"""Delayed scaling as explicit state: the history update, the scale selection, linear under
torch.func and torch.compile, and the Fp8Linear shell that applies the state."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fp8func as f8
from fp8func._delayed import LinearScalingState, ScalingState

from .strategies import shapes_2d, tensors


@given(xs=st.lists(tensors(shapes_2d(max_groups=5), log2_range=(-10, 12), specials=True), min_size=1, max_size=6),
       history_len=st.integers(1, 4), algo=st.sampled_from(["max", "most_recent"]),
       dtype=st.sampled_from([f8.E4M3, f8.E5M2]), pow2=st.booleans(), bad=st.integers(-1, 5))
def test_history_update_and_scale_selection(xs, history_len, algo, dtype, pow2, bad):
    spec = f8.CastSpec(dtype, power_of_2=pow2)
    if 0 <= bad < len(xs):  # one step sees a NaN: recorded, but the scale must not take it
        xs[bad] = xs[bad].clone()
        xs[bad].view(-1)[0] = float("nan")
    state = ScalingState.init(history_len)
    seen = []
    for x in xs:
        q, new = f8.quantize(x, spec, state=state, algo=algo)
        # the cast used the previous scale, exactly as quantize_with_scale would
        ref = f8.quantize_with_scale(x, state.scale.reshape(1, 1), spec)
        assert torch.equal(q.data.view(torch.uint8), ref.data.view(torch.uint8))
        amax = x.abs().max().float()
        seen.insert(0, amax)
        want_hist = torch.stack((seen + [torch.tensor(0.0)] * history_len)[:history_len])
        assert torch.equal(new.amax_history, want_hist) or (new.amax_history.isnan() == want_hist.isnan()).all()
        basis = want_hist.max() if algo == "max" else amax
        if torch.isfinite(basis) and basis > 0:
            want = f8.compute_scale(basis.reshape(1, 1), dtype, pow2)
        else:
            want = state.scale  # a NaN / inf / all-zero basis keeps the scale
        assert torch.equal(new.scale, want), (new.scale, want)
        assert torch.isfinite(new.scale).all()
        state = new


def test_from_tensor_makes_the_first_cast_the_dynamic_one():
    x = torch.randn(64, 32) * 300
    spec = f8.CastSpec()
    q, _ = f8.quantize(x, spec, state=ScalingState.from_tensor(x, spec, 8))
    dyn = f8.quantize(x, spec)
    assert torch.equal(q.scale, dyn.scale) and torch.equal(q.data.view(torch.uint8), dyn.data.view(torch.uint8))


def test_delayed_scaling_refuses_non_tensorwise_and_bad_states():
    with pytest.raises(ValueError, match="delayed scaling keeps one scale per tensor"):
        f8.quantize(torch.randn(4, 4), f8.CastSpec(granularity=f8.AxisWise(-1)), state=ScalingState.init(2))
    with pytest.raises(ValueError, match="are not plain tensorwise"):
        f8.Recipe.from_name("rowwise", delayed=f8.DelayedScaling())
    with pytest.raises(TypeError, match="needs state=LinearScalingState"):
        f8.linear(torch.randn(4, 16), torch.randn(16, 16), recipe="delayed")
    with pytest.raises(ValueError, match="state= is for delayed scaling"):
        f8.linear(torch.randn(4, 16), torch.randn(16, 16), recipe="tensorwise", state=LinearScalingState.init(2))


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 16, 64, generator=g).bfloat16(), torch.randn(32, 64, generator=g) / 8,
            torch.randn(2, 16, 32, generator=g).bfloat16())


def _warm_state(x, w, dy):
    """A state whose scales are not the identity (one recorded step of each tensor)."""
    spec = f8.Recipe.from_name("delayed")
    return LinearScalingState(ScalingState.from_tensor(x, spec.input, 4), ScalingState.from_tensor(w, spec.weight, 4),
                              ScalingState.from_tensor(dy, spec.grad_output, 4))


def test_linear_state_through_torch_func_grad_equals_eager_autograd():
    x, w, dy = _data()
    state = _warm_state(x, w, dy * 3)

    def loss(w, x, state):
        y, new = f8.linear(x, w, recipe="delayed", state=state)
        return (y.float() * dy.float()).sum(), new

    (gw, gstate), new = torch.func.grad(loss, argnums=(0, 2), has_aux=True)(w, x, state)
    merged = new._replace(grad_output=gstate.grad_output)

    # eager: the grad_output state comes back as .grad of the state tensors
    ww = w.clone().requires_grad_()
    dy_state = ScalingState(*(t.clone().requires_grad_() for t in state.grad_output))
    y, new_eager = f8.linear(x, ww, recipe="delayed", state=state._replace(grad_output=dy_state))
    y.backward(dy)
    assert torch.equal(gw, ww.grad)
    assert torch.equal(merged.grad_output.amax_history, dy_state.amax_history.grad)
    assert torch.equal(merged.grad_output.scale, dy_state.scale.grad)
    # what the backward recorded: dy's amax, and the scale that history gives
    assert merged.grad_output.amax_history[0] == dy.abs().max().float()
    assert torch.equal(merged.input.amax_history, new_eager.input.amax_history)
    # "max" over the history: the calibration step's 3x larger amax still sets the scale
    assert merged.grad_output.amax_history[1] == state.grad_output.amax_history[0]
    assert torch.equal(merged.grad_output.scale, state.grad_output.scale)


def test_linear_delayed_through_the_kernel_twin_is_bitwise_the_plain_casts(monkeypatch):
    """KERNELS="reference" routes the three delayed casts through ``kernels.cast_amax`` (its PyTorch
    twin here; the Triton kernel on a GPU, tests/test_gpu.py), each writing its transposed copy
    for the backward in the same call: same output, gradients and states as the plain casts."""
    import fp8func._casts as casts_mod
    import fp8func.kernels as kernels

    x, w, dy = _data(2)
    state = _warm_state(x, w, dy * 2)
    calls = []
    orig = kernels.cast_amax
    monkeypatch.setattr(kernels, "cast_amax", lambda *a, **k: calls.append(k.get("transpose")) or orig(*a, **k))
    runs = {}
    for mode in ("off", "reference"):
        monkeypatch.setattr(casts_mod, "KERNELS", mode)
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        hist, scale = (t.clone().requires_grad_() for t in state.grad_output)
        y, new = f8.linear(xx, ww, recipe="delayed", state=state._replace(grad_output=ScalingState(hist, scale)))
        y.backward(dy)
        runs[mode] = (y, xx.grad, ww.grad, *new.input, *new.weight, hist.grad, scale.grad)
    assert calls == [True, True, True]  # x and w in the forward, dy in the backward
    for a, b in zip(runs["off"], runs["reference"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kernels", ["off", "reference"])
def test_linear_delayed_compiles_fullgraph_and_matches_eager(kernels, monkeypatch):
    import fp8func._casts as casts_mod

    monkeypatch.setattr(casts_mod, "KERNELS", kernels)
    x, w, dy = _data(1)
    state = _warm_state(x, w, dy)

    def step(x, w, hist, scale):
        st_ = state._replace(grad_output=ScalingState(hist, scale))
        y, new = f8.linear(x, w, recipe="delayed", state=st_)
        return y, new.input.amax_history, new.input.scale, new.weight.scale

    outs = {}
    for name, fn in (("eager", step), ("compiled", torch.compile(step, fullgraph=True))):
        ww = w.clone().requires_grad_()
        hist, scale = (t.clone().requires_grad_() for t in state.grad_output)
        y, *rest = fn(x, ww, hist, scale)
        y.backward(dy)
        outs[name] = (y, *rest, ww.grad, hist.grad, scale.grad)
    for a, b in zip(outs["eager"], outs["compiled"]):
        assert torch.equal(a, b)


def test_fp8_linear_applies_the_state_and_keeps_it_from_the_optimizer():
    torch.manual_seed(0)
    model = f8.convert(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)), "delayed")
    layer = model[2]
    assert layer.fsdp_fp8_all_gather is False
    assert "FSDP2 all-gathers it in bf16" in f8.report(model, print_table=False)[0].reason
    params = {id(p) for p in model.parameters()}
    assert all(id(t) not in params for t in layer.scaling_state()[0] + layer.scaling_state()[2])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dy_amaxes, x_amaxes = [], []
    for step in range(3):
        x = torch.randn(8, 64) * (step + 1)
        y = model(x)
        dy = torch.randn_like(y) * 10 ** step
        y.backward(dy)
        opt.step()
        opt.zero_grad()
        dy_amaxes.insert(0, dy.abs().max())
        x_amaxes.insert(0, x.abs().max())
    assert torch.equal(model[0].fp8_x_history[:3], torch.stack(x_amaxes))
    assert torch.equal(layer.fp8_dy_history[:3], torch.stack(dy_amaxes))  # applied by the hook
    assert layer.fp8_dy_history.grad is None and layer.fp8_dy_scale.grad is None
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    model(torch.randn(8, 64) * 100)
    assert all(torch.equal(frozen[k], v) for k, v in model.state_dict().items())  # eval: unchanged
    fresh = f8.convert(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)), "delayed")
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh[2].fp8_dy_scale, layer.fp8_dy_scale)


def test_fp8_linear_delayed_compiled_trains_bitwise_like_eager_without_recompiles():
    """The shell's state updates under torch.compile(fullgraph=True): same losses and states as
    eager over 4 steps, one graph (the buffers are rebound, never written in place: a compiled
    backward that recomputed a cast's scale from a mutated buffer got a 150x wrong grad)."""
    from torch._dynamo.utils import counters

    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = f8.convert(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)), "delayed")
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(model, fullgraph=True) if compiled else model
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(4):
            g = torch.Generator().manual_seed(step)
            y = fn(torch.randn(8, 64, generator=g) * (step + 1))
            loss = (y * torch.randn(y.shape, generator=g)).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs[compiled] = (losses, model.state_dict(), counters["stats"]["unique_graphs"])
    assert runs[False][0] == runs[True][0]
    assert all(torch.equal(runs[False][1][k], runs[True][1][k]) for k in runs[False][1])
    assert runs[True][2] == 1


def test_functional_train_step_example_is_bitwise_the_stateful_module():
    """examples/functional_train_step.py (functional_call + grad, every state threaded by hand)
    trains exactly like the converted module with SGD: same losses, same final states."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "examples" / "functional_train_step.py"
    spec = importlib.util.spec_from_file_location("functional_train_step", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    functional = ex.main(["--steps", "4", "--lr", "0.05"])

    model = f8.convert(ex.tiny_qwen3(), "delayed")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stateful = []
    for i in range(4):
        ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(i))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        stateful.append(loss.item())
    assert functional == stateful, (functional, stateful)


@pytest.mark.parametrize("kernels", ["off", "reference"])
def test_delayed_scaling_with_a_dynamic_weight(kernels, monkeypatch):
    """``DelayedScaling(weight=False)`` casts the weight with its own amax: the same bits as the
    delayed weight cast whose state holds exactly that amax; its weight state is returned as given;
    weight casts made elsewhere (FSDP2's fp8 gather) give the same bits; compiled equals eager."""
    import fp8func._casts as casts_mod
    from fp8func._delayed_linear import linear_delayed

    monkeypatch.setattr(casts_mod, "KERNELS", kernels)
    x, w, dy = _data(3)
    state = _warm_state(x, w * 3, dy)  # a weight state that is not w's own
    dynamic = f8.Recipe.from_name("delayed", delayed=f8.DelayedScaling(history_len=4, weight=False))
    delayed = f8.Recipe.from_name("delayed", delayed=f8.DelayedScaling(history_len=4))
    own = state._replace(weight=ScalingState.from_tensor(w, delayed.weight, 4))

    def run(fn, recipe, st, **kw):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        hist, scale = (t.clone().requires_grad_() for t in st.grad_output)
        y, new = fn(xx, ww, recipe, st._replace(grad_output=ScalingState(hist, scale)), **kw)
        y.backward(dy)
        return (y, xx.grad, ww.grad, *new.input, hist.grad, scale.grad), new

    def plain(x, w, recipe, st, casts=None):
        return linear_delayed(x, w, None, recipe, st, None, casts)

    want, _ = run(plain, delayed, own)
    got, new = run(plain, dynamic, state)
    assert new.weight is state.weight
    given, _ = run(plain, dynamic, state, casts={"w": f8.quantize(w, dynamic.weight)})
    torch._dynamo.reset()
    compiled, _ = run(torch.compile(plain, fullgraph=True), dynamic, state)
    for a, b, c, d in zip(want, got, given, compiled, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
    with pytest.raises(ValueError, match=r"given weight casts need DelayedScaling\(weight=False\)"):
        plain(x, w, delayed, state, casts={"w": f8.quantize(w, delayed.weight)})


def test_convert_with_a_dynamic_weight_gathers_it_in_fp8_and_keeps_its_state_idle():
    from fp8func.distributed import Fp8AllGatherWeight

    recipe = f8.Recipe.from_name("delayed", delayed=f8.DelayedScaling(weight=False))
    torch.manual_seed(0)
    model = f8.convert(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)), recipe)
    layer = model[2]
    assert layer.fsdp_fp8_all_gather and isinstance(layer.weight, Fp8AllGatherWeight)
    assert "bf16" not in f8.report(model, print_table=False)[0].reason
    w_state = (layer.fp8_w_history.clone(), layer.fp8_w_scale.clone())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(torch.randn(8, 64) * (step + 1)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(layer.fp8_w_history, w_state[0]) and torch.equal(layer.fp8_w_scale, w_state[1])
    assert layer.fp8_x_history[1] > 0 and layer.fp8_dy_history[1] > 0  # two steps recorded
    delayed = f8.convert(nn.Sequential(nn.Linear(64, 128)), "delayed")
    assert not delayed[0].fsdp_fp8_all_gather
    assert "DelayedScaling(weight=False)" in f8.report(delayed, print_table=False)[0].reason


def _dtensor_delayed(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world_size,))
    x, w, dy = _data(4)
    state = _warm_state(x, w / 2, dy)
    y_ref, new_ref = f8.linear(x, w, recipe="delayed", state=state)
    xd = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    wd = DTensor.from_local(w.chunk(world_size)[rank].contiguous(), mesh, [Shard(0)], run_check=False)
    y, new = f8.linear(xd, wd, recipe="delayed", state=state)  # a column-parallel layer (TP)
    y = y.full_tensor()
    states = all(torch.equal(a, b) for a, b in zip((*new.input, *new.weight), (*new_ref.input, *new_ref.weight)))
    return {"states": states, "plain": all(not isinstance(t, DTensor) for t in (*new.input, *new.weight)),
            "rel": ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()}


def test_delayed_linear_on_dtensors_records_the_global_amax():
    """Column-parallel DTensor operands (stock TP): the states record the whole tensors' amaxes,
    as plain tensors equal on every rank, and the output is the one-process output."""
    from .dist_harness import run_workers

    for r in run_workers(_dtensor_delayed, 2):
        assert r["states"] and r["plain"], r
        assert r["rel"] < 1e-6, r


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _train_checkpointed(checkpoint_kwargs, recipe="delayed", steps=4, compiled=False):
    """Two blocks of delayed-scaling layers, each block checkpointed (or not: None); ``compiled``:
    each block's checkpoint call compiled around (``torch.compile(lambda h: checkpoint(...))``)."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = f8.convert(nn.Sequential(_Block(), _Block()), recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if checkpoint_kwargs is None:
        fns = list(model)
    else:
        fns = [lambda h, b=b: checkpoint(b, h, **checkpoint_kwargs) for b in model]
    if compiled:
        fns = [torch.compile(fn) for fn in fns]
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        h = (torch.randn(8, 64, generator=g) * (step + 1)).requires_grad_()  # reentrant checkpoint wants one
        for fn in fns:
            h = fn(h)
        loss = (h * torch.randn(h.shape, generator=g)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def test_activation_checkpointing_replays_the_forward_state():
    """Checkpointing recomputes each block's forward inside the backward; with
    ``context_fn=checkpoint_context`` the recomputation casts with the state the forward used and
    records nothing: losses and every state buffer bitwise the run without checkpointing. Without
    it, the recomputation raises (it would cast with the moved-on state: gradients of a forward that
    never ran, and each amax recorded twice)."""
    plain = _train_checkpointed(None)
    ckpt = _train_checkpointed({"use_reentrant": False, "context_fn": f8.nn.checkpoint_context})
    assert plain[0] == ckpt[0]
    assert plain[1].keys() == ckpt[1].keys() and all(torch.equal(plain[1][k], ckpt[1][k]) for k in plain[1])
    assert plain[1]["0.a.fp8_x_history"][3] > 0  # four steps recorded, once each
    for kwargs in ({"use_reentrant": False}, {"use_reentrant": True}):
        with pytest.raises(RuntimeError, match=r"context_fn=fp8func.nn.checkpoint_context"):
            _train_checkpointed(kwargs, steps=1)


def test_activation_checkpointing_compiled_around_is_bitwise_eager():
    """docs/delayed.md's recipe: compile *around* the checkpoint. Bitwise the eager run without
    checkpointing (losses, every state buffer). Guards the state update: an in-place update under
    compile (session 9, for CUDA graphs) made dynamo trace the checkpoint and reject the context_fn."""
    plain = _train_checkpointed(None, steps=3)
    compiled = _train_checkpointed({"use_reentrant": False, "context_fn": f8.nn.checkpoint_context}, steps=3,
                                   compiled=True)
    assert plain[0] == compiled[0]
    assert all(torch.equal(plain[1][k], compiled[1][k]) for k in plain[1])
