"""Delayed scaling as explicit state: the history update and scale selection, ``linear_delayed``'s
overwrite-with-gradient states (threaded uses merge by max, stale states refused, faults shown),
under torch.func and torch.compile, and the Fp8Linear shell that applies the state."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import fp8func as f8
from fp8func._delayed import LinearScalingState, ScalingState, next_state, record_merged

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
        q, new = f8.quantize_delayed(x, spec, state, algo=algo)
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


@given(amaxes=st.lists(st.floats(0.0, 1e4), min_size=1, max_size=4), history_len=st.integers(1, 4),
       algo=st.sampled_from(["max", "most_recent"]), pow2=st.booleans())
def test_threaded_uses_record_one_entry_holding_their_max(amaxes, history_len, algo, pow2):
    """``record_merged`` over a chain of uses (the backward visits the last use first): one history
    entry per step holding the max of the uses' amaxes, as one use of that max would record."""
    spec = f8.CastSpec(f8.E5M2, power_of_2=pow2)
    state = ScalingState(torch.arange(1.0, history_len + 1), torch.full((1, 1), 0.5))
    incoming = ScalingState(torch.zeros(history_len), torch.zeros(1, 1))  # no later use
    for a in reversed(amaxes):
        incoming = record_merged(state, incoming, torch.tensor(a), spec, algo)
    once = next_state(state, torch.tensor(max(amaxes)), spec, algo)
    assert torch.equal(incoming.amax_history, once.amax_history)
    if algo == "max" or len(amaxes) == 1:
        assert torch.equal(incoming.scale, once.scale)


def test_quantize_and_linear_have_fixed_return_types():
    x, w = torch.randn(4, 16), torch.randn(16, 16)
    with pytest.raises(ValueError, match="delayed scaling keeps one scale per tensor"):
        f8.quantize_delayed(torch.randn(4, 4), f8.CastSpec(granularity=f8.AxisWise(-1)), ScalingState.init(2))
    with pytest.raises(ValueError, match="are not plain tensorwise"):
        f8.Recipe.from_name("rowwise", delayed=f8.DelayedScaling())
    with pytest.raises(TypeError, match=r"fp8func.quantize_delayed\(x, spec, state\)"):
        f8.quantize(x, f8.CastSpec(), state=ScalingState.init(2))
    with pytest.raises(TypeError, match=r"fp8func.linear_delayed\(x, weight, bias, recipe, state\)"):
        f8.linear(x, w, recipe="delayed")
    with pytest.raises(TypeError, match=r"fp8func.linear_delayed"):
        f8.linear(x, w, recipe="tensorwise", state=LinearScalingState.init(2))
    with pytest.raises(ValueError, match="scales dynamically; use fp8func.linear"):
        f8.linear_delayed(x, w, None, "tensorwise", LinearScalingState.init(2))
    with pytest.raises(ValueError, match="do not require grad, so the update would be lost"):
        f8.linear_delayed(x, w.requires_grad_(), None, "delayed", LinearScalingState.init(2))


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 16, 64, generator=g).bfloat16(), torch.randn(32, 64, generator=g) / 8,
            torch.randn(2, 16, 32, generator=g).bfloat16())


def _warm_state(x, w, dy):
    """A state whose scales are not the identity (one recorded step of each tensor)."""
    spec = f8.Recipe.from_name("delayed")
    return LinearScalingState(ScalingState.from_tensor(x, spec.input, 4), ScalingState.from_tensor(w, spec.weight, 4),
                              ScalingState.from_tensor(dy, spec.grad_output, 4))


def _fresh(state: LinearScalingState) -> LinearScalingState:
    return LinearScalingState.from_tensors(t.clone().requires_grad_() for t in state.tensors())


def _eager(x, w, dy, state, recipe="delayed", x_grad=False):
    """(y, dw, next state) by eager autograd: the next state is the states' .grad (None for a
    state the plan does not record); with ``x_grad`` also dx, after dw."""
    ww, st_ = w.clone().requires_grad_(), _fresh(state)
    xx = x.clone().requires_grad_() if x_grad else x
    y, _ = f8.linear_delayed(xx, ww, None, recipe, st_)
    y.backward(dy)
    grads = (ww.grad, xx.grad) if x_grad else (ww.grad,)
    return (y, *grads, LinearScalingState.from_tensors(t.grad for t in st_.tensors()))


def test_the_next_state_is_the_gradient_under_torch_func_and_eager_autograd():
    x, w, dy = _data()
    state = _warm_state(x, w, dy * 3)

    def loss(w, state):
        y, _ = f8.linear_delayed(x, w, None, "delayed", state)
        return (y.float() * dy.float()).sum()

    gw, nxt = torch.func.grad(loss, argnums=(0, 1))(w, state)
    y, dw, eager = _eager(x, w, dy, state)
    assert torch.equal(gw, dw)
    assert all(torch.equal(a, b) for a, b in zip(nxt.tensors(), eager.tensors()))
    # what each cast recorded: its tensor's amax, newest first, and the scale from the history's max
    for st_, t, old in ((nxt.input, x, state.input), (nxt.weight, w, state.weight),
                        (nxt.grad_output, dy, state.grad_output)):
        assert st_.amax_history[0] == t.abs().max().float() and torch.equal(st_.amax_history[1:], old.amax_history[:-1])
        want = f8.compute_scale(st_.amax_history.max().reshape(1, 1), f8.E4M3 if t is not dy else f8.E5M2, False)
        assert torch.equal(st_.scale, want)


def test_a_state_threaded_through_two_uses_records_their_max_once():
    """A layer applied twice in a step (a scan, a shared block): the threaded state records one
    history entry with the larger amax of each tensor, where adding the two uses' new states (what
    autograd does to a state used twice without threading) would record their sum."""
    x, w, dy = _data(1)
    state = _warm_state(x, w, dy)
    st_ = _fresh(state)
    ww = w.clone().requires_grad_()
    y1, passed = f8.linear_delayed(x, ww, None, "delayed", st_)
    y2, _ = f8.linear_delayed(x * 3, ww, None, "delayed", passed)
    ((y1.float() * dy.float()).sum() + (y2.float() * (dy.float() * 5)).sum()).backward()
    nxt = LinearScalingState.from_tensors(t.grad for t in st_.tensors())
    assert nxt.input.amax_history[0] == (x * 3).abs().max().float()
    assert nxt.grad_output.amax_history[0] == (dy.float() * 5).bfloat16().abs().max().float()  # y2's grad, bf16
    for got, old in zip(nxt, state):
        assert torch.equal(got.amax_history[1:], old.amax_history[:-1])  # one shift for the step
    # the module: a layer called twice before its backward does the same
    layer = f8.nn.Fp8Linear(64, 32, bias=False, recipe="delayed")
    with torch.no_grad():
        layer.weight.copy_(w)
    out = layer(x.float()).sum() + layer(x.float() * 3).sum()
    out.backward()
    assert layer.fp8_x_history[0] == (x.float() * 3).abs().max() and layer.fp8_x_history[1] == 0


def test_a_consumed_state_is_refused_with_the_fix():
    x, w, dy = _data(2)
    st_ = _fresh(_warm_state(x, w, dy))
    f8.linear_delayed(x, w.clone().requires_grad_(), None, "delayed", st_)
    with pytest.raises(ValueError, match=r"already consumed[\s\S]*y2, state = fp8func.linear_delayed"):
        f8.linear_delayed(x, w.clone().requires_grad_(), None, "delayed", st_)
    with torch.no_grad():  # no update is due without grad, so reuse is fine
        f8.linear_delayed(x, w, None, "delayed", st_)


def test_a_consumed_state_copied_or_loaded_is_fresh(tmp_path):
    """The consumed mark stays with the tensor it marks: a deepcopy or a torch.save of the state
    (loaded with torch.load's default weights_only=True) is a fresh state."""
    import copy

    x, w, dy = _data(2)
    st_ = _fresh(_warm_state(x, w, dy))
    f8.linear_delayed(x, w.clone().requires_grad_(), None, "delayed", st_)
    torch.save(list(st_.tensors()), tmp_path / "state.pt")
    loaded = LinearScalingState.from_tensors(t.requires_grad_() for t in torch.load(tmp_path / "state.pt"))
    for fresh in (copy.deepcopy(st_), loaded):
        f8.linear_delayed(x, w.clone().requires_grad_(), None, "delayed", fresh)
    with pytest.raises(ValueError, match="already consumed"):
        f8.linear_delayed(x, w.clone().requires_grad_(), None, "delayed", st_)


@pytest.mark.parametrize("where", ["input", "grad_output"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_a_non_finite_tensor_shows_in_the_outputs_and_gradients(where, bad):
    """An inf (an fp16 loss-scale overflow) or NaN in the input or grad_output is not saturated
    away: the step's outputs or gradients are non-finite, as with dynamic scaling, while the
    next state keeps a finite scale (the history records the fault)."""
    x, w, dy = _data(3)
    x, dy = x.clone(), dy.clone()
    (x if where == "input" else dy)[0, 0, 0] = bad
    y, dw, nxt = _eager(x, w, dy, _warm_state(x.nan_to_num(0, 0, 0), w, dy.nan_to_num(0, 0, 0)))
    if where == "input":
        assert not torch.isfinite(y).all()
    assert not torch.isfinite(dw).all()
    assert all(torch.isfinite(st_.scale).all() for st_ in nxt)
    recorded = (nxt.input if where == "input" else nxt.grad_output).amax_history[0]
    assert not torch.isfinite(recorded)


@pytest.mark.parametrize("weight", [True, False])
def test_linear_delayed_through_the_kernel_twin_is_bitwise_the_plain_casts(weight, monkeypatch):
    """kernels="reference" routes the delayed casts through ``kernels.cast_amax`` (its PyTorch
    twin here; the Triton kernel on a GPU, the `gpu` test below), each writing its transposed copy
    for the backward in the same call: same output, gradients and next states as the plain casts."""
    import fp8func.kernels as kernels

    x, w, dy = _data(2)
    state = _warm_state(x, w, dy * 2)
    calls = []
    orig = kernels.cast_amax
    monkeypatch.setattr(kernels, "cast_amax", lambda *a, **k: calls.append(k.get("transpose")) or orig(*a, **k))
    runs = {}
    for mode in ("off", "reference"):
        recipe = f8.Recipe.from_name("delayed", kernels=mode, delayed=f8.DelayedScaling(4, weight=weight))
        y, dw, dx, nxt = _eager(x, w, dy, state, recipe, x_grad=True)
        runs[mode] = (y, dw, dx, *nxt.tensors())
    assert calls == ([True, True, True] if weight else [True, True])  # x (and w) forward, dy backward
    for a, b in zip(runs["off"], runs["reference"], strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("kernels", ["off", "reference"])
def test_linear_delayed_compiles_fullgraph_and_matches_eager(kernels):
    x, w, dy = _data(1)
    state = _warm_state(x, w, dy)
    recipe = f8.Recipe.from_name("delayed", kernels=kernels)

    def step(x, w, *tensors):
        y, _ = f8.linear_delayed(x, w, None, recipe, LinearScalingState.from_tensors(tensors))
        return y

    outs = {}
    for name, fn in (("eager", step), ("compiled", torch.compile(step, fullgraph=True))):
        ww, st_ = w.clone().requires_grad_(), _fresh(state)
        y = fn(x, ww, *st_.tensors())
        y.backward(dy)
        outs[name] = (y, ww.grad, *(t.grad for t in st_.tensors()))
    for a, b in zip(outs["eager"], outs["compiled"]):
        assert torch.equal(a, b)
    with torch.no_grad():  # evaluation / inference: nothing requires grad, no update is due
        torch._dynamo.reset()
        y_eval = torch.compile(step, fullgraph=True)(x, w, *state.tensors())
    assert torch.equal(y_eval, outs["eager"][0])


def test_vmap_over_an_ensemble_gives_each_member_its_own_state():
    xs, ws, dys, states = [], [], [], []
    for s in range(3):
        x, w, dy = _data(10 + s)
        xs.append(x), ws.append(w), dys.append(dy), states.append(_warm_state(x, w * (s + 1), dy))

    def loss(x, w, dy, *tensors):
        y, _ = f8.linear_delayed(x, w, None, "delayed", LinearScalingState.from_tensors(tensors))
        return (y.float() * dy.float()).sum()

    stacked = [torch.stack(parts) for parts in zip(*(s.tensors() for s in states))]
    got = torch.func.vmap(torch.func.grad(loss, argnums=(1, 3, 4, 5, 6, 7, 8)))(
        torch.stack(xs), torch.stack(ws), torch.stack(dys), *stacked)
    for i in range(3):
        _, dw, nxt = _eager(xs[i], ws[i], dys[i], states[i])
        assert torch.equal(got[0][i], dw)
        assert all(torch.equal(g[i], t) for g, t in zip(got[1:], nxt.tensors()))


def test_fp8_linear_applies_the_state_and_keeps_it_from_the_optimizer():
    torch.manual_seed(0)
    model = f8.convert(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)), "delayed")
    layer = model[2]
    assert layer.fsdp_fp8_all_gather is False
    assert "FSDP2 all-gathers it in bf16" in f8.report(model, print_table=False)[0].reason
    params = {id(p) for p in model.parameters()}
    assert all(id(t) not in params for t in layer.scaling_state().tensors())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dy_amaxes, x_amaxes = [], []
    for step in range(3):
        x = torch.randn(8, 64) * (step + 1)
        y = model(x)
        assert model[0].fp8_x_history[0] == (x_amaxes[0] if x_amaxes else 0)  # the forward changes nothing
        dy = torch.randn_like(y) * 10 ** step
        y.backward(dy)
        opt.step()
        opt.zero_grad()
        dy_amaxes.insert(0, dy.abs().max())
        x_amaxes.insert(0, x.abs().max())
    assert torch.equal(model[0].fp8_x_history[:3], torch.stack(x_amaxes))
    assert torch.equal(layer.fp8_dy_history[:3], torch.stack(dy_amaxes))  # applied by the hook
    assert all(t.grad is None for t in layer.scaling_state().tensors())
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    model.eval()
    model(torch.randn(8, 64) * 100)
    assert all(torch.equal(frozen[k], v) for k, v in model.state_dict().items())  # no backward: unchanged
    fresh = f8.convert(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)), "delayed")
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh[2].fp8_dy_scale, layer.fp8_dy_scale)


_DYNAMIC_WEIGHT = f8.Recipe.from_name("delayed", delayed=f8.DelayedScaling(4, weight=False))


@pytest.mark.parametrize("recipe", ["delayed", _DYNAMIC_WEIGHT], ids=["delayed", "dynamic-weight"])
def test_a_delayed_fp8_linear_stack_trains_bitwise_as_the_functional_op(recipe):
    """Three delayed ``Fp8Linear`` layers trained five steps with SGD: every loss, weight and state
    is bitwise what ``linear_delayed`` gives with the states threaded by hand, each step's next
    state the gradient of its state."""
    torch.manual_seed(0)
    sizes = [(64, 128), (128, 96), (96, 32)]
    model = f8.convert(nn.Sequential(*[nn.Linear(k, n) for k, n in sizes]), recipe, fsdp_fp8_all_gather=False)
    params = [(layer.weight.detach().clone(), layer.bias.detach().clone()) for layer in model]
    states = [LinearScalingState.from_tensors(t.detach().clone() for t in layer.scaling_state().tensors())
              for layer in model]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(5):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(16, 64, generator=g) * (step + 1)
        dy = torch.randn(16, 32, generator=g)
        loss = (model(x) * dy).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        leaves = [tuple(t.requires_grad_() for t in p) for p in params]
        tracked = [_fresh(st_) for st_ in states]
        h = x
        for (w, b), st_ in zip(leaves, tracked):
            h, _ = f8.linear_delayed(h, w, b, recipe, st_)
        want = (h * dy).sum()
        inputs = [t for p in leaves for t in p] + [t for st_ in tracked for t in st_.tensors()]
        grads = torch.autograd.grad(want, inputs, allow_unused=True)
        assert torch.equal(loss, want), step
        flat = iter(grads[:6])
        params = [tuple(t.detach().add(next(flat), alpha=-0.05) for t in p) for p in leaves]  # SGD's update
        new = iter(grads[6:])
        states = [LinearScalingState.from_tensors(t.detach() if (n := next(new)) is None else n for t in st_.tensors())
                  for st_ in tracked]
        for layer, (w, b), st_ in zip(model, params, states):
            assert torch.equal(layer.weight, w) and torch.equal(layer.bias, b), step
            assert all(torch.equal(a, b) for a, b in zip(layer.scaling_state().tensors(), st_.tensors())), step


def test_a_delayed_fp8_linear_keeps_its_checkpoint_keys():
    """The state buffers sit under the layer's own keys, ``nn.Linear``'s and six more, so
    checkpoints saved with these names load; a dynamic layer has ``nn.Linear``'s alone."""
    layer = f8.nn.Fp8Linear(64, 32, recipe="delayed")
    keys = ["weight", "bias", "fp8_x_history", "fp8_x_scale", "fp8_w_history", "fp8_w_scale", "fp8_dy_history",
            "fp8_dy_scale"]
    assert list(layer.state_dict()) == keys
    assert list(f8.nn.Fp8Linear(64, 32, recipe="tensorwise").state_dict()) == keys[:2]
    saved = {"weight": torch.randn(32, 64), "bias": torch.randn(32)}
    saved.update({k: torch.rand(16) if k.endswith("history") else torch.rand(1, 1) for k in keys[2:]})
    layer.load_state_dict(saved)
    assert all(torch.equal(layer.state_dict()[k], v) for k, v in saved.items())
    assert layer.scaling_buffers.packed is not None  # loaded in place: still the one packed leaf
    layer(torch.randn(8, 64)).sum().backward()
    assert torch.equal(layer.fp8_x_history[1:], saved["fp8_x_history"][:-1])  # and trained from there


@pytest.mark.parametrize("compiled", [False, True])
def test_a_delayed_step_syncs_nothing_and_writes_its_states_once(compiled):
    """A training step of a delayed model waits for no GPU value (no ``.item()``, no ``nonzero``:
    each would be a host sync per step) and writes every layer's next state with one multi-tensor
    copy; compiled, nothing outside the graphs packs or copies the state again."""
    import collections

    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = f8.convert(nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 32)),
                       "delayed", fsdp_fp8_all_gather=False)
    torch._dynamo.reset()
    fn = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 64)

    def step():
        fn(x).sum().backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
    ops = collections.Counter(e.name for e in prof.events())
    assert not [k for k in ops if k in ("aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero")]
    assert ops["aten::_foreach_copy_"] == 2
    if compiled:
        assert ops["aten::cat"] == ops["aten::clone"] == 0, ops


def test_fp8_linear_under_a_torch_func_transform_points_to_apply():
    layer = f8.nn.Fp8Linear(64, 32, recipe="delayed")
    params = {k: v.detach() for k, v in layer.named_parameters()}
    with pytest.raises(RuntimeError, match=r"fp8func.nn.apply\(model, params, states"):
        torch.func.grad(lambda p: torch.func.functional_call(layer, p, (torch.randn(4, 64),)).sum())(params)


def test_fp8_linear_delayed_compiled_trains_bitwise_like_eager_without_recompiles():
    """The shell's state updates under torch.compile(fullgraph=True): same losses and states as
    eager over 4 steps, one graph."""
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


@pytest.mark.parametrize("copy_kind", ["deepcopy", "pickle"])
def test_a_copy_of_a_delayed_model_trains_compiled_from_its_first_call(copy_kind):
    """A copy's state buffers are new tensors; the copy hooks them itself, so its first call may be
    a compiled one (fullgraph: no eager call in between), and its next states are written."""
    import copy
    import io

    torch.manual_seed(0)
    model = f8.convert(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32)), "delayed", fsdp_fp8_all_gather=False)
    x = torch.randn(8, 64)
    model(x).sum().backward()  # the original has trained a step: its states are not the initial ones
    if copy_kind == "deepcopy":
        other = copy.deepcopy(model)
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        other = torch.load(buf, weights_only=False)
    before = other[0].fp8_x_history.clone()
    torch._dynamo.reset()
    torch.compile(other, fullgraph=True)(x * 4).sum().backward()
    assert not torch.equal(other[0].fp8_x_history, before)  # the compiled step wrote the next state
    assert torch.equal(model[0].fp8_x_history, before)  # and not the original's


# dynamo probes ``hasattr(t, "grad")`` on a layer's input (a non-leaf) inside a filter meant to
# hide this warning, which pytest's warnings-as-errors turns into an error first.
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning")
def test_delayed_layers_compiled_one_by_one_share_one_graph():
    """Per-block compile (torchtitan's): identical delayed layers compiled each on its own run one
    compiled graph; nothing layer-specific (such as the id() of a state buffer) is guarded on, so
    the recompilation limit is never reached in a deep model."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    layers = f8.convert(nn.Sequential(*[nn.Linear(64, 64, bias=False) for _ in range(6)]), "delayed",
                        fsdp_fp8_all_gather=False)
    for i, layer in enumerate(layers):
        layers[i] = torch.compile(layer)
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(8, 64)
    for _ in range(2):
        layers(x).sum().backward()
    # two: the first layer reads a tensor that needs no grad, the other five one that does
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["recompiles"])


@pytest.mark.slow
def test_functional_train_step_example_is_bitwise_the_stateful_module():
    """examples/functional_train_step.py (nn.apply + grad, every state in and out) trains exactly
    like the converted module with SGD: same losses. Compiled whole, inductor fuses the model's
    norms and softmax in its own order: the same losses to fp32 rounding."""
    from .examples import load_example

    ex = load_example("functional_train_step")
    functional = ex.main(["--steps", "3", "--lr", "0.05"])
    torch._dynamo.reset()
    compiled = ex.main(["--steps", "3", "--lr", "0.05", "--compile"])

    model = f8.convert(ex.tiny_qwen3(), "delayed")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    stateful = []
    for i in range(3):
        ids = ex.batch(i)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        stateful.append(loss.item())
    assert functional == stateful, (functional, stateful)
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(stateful), rtol=1e-6, atol=0)


@pytest.mark.parametrize("kernels", ["off", "reference"])
def test_delayed_scaling_with_a_dynamic_weight(kernels):
    """``DelayedScaling(weight=False)`` casts the weight with its own amax: the same bits as the
    delayed weight cast whose state holds exactly that amax; its weight state gets no gradient (no
    update); weight casts made elsewhere (FSDP2's fp8 gather) give the same bits; compiled equals eager."""
    from fp8func._autograd import fp8_linear

    x, w, dy = _data(3)
    state = _warm_state(x, w * 3, dy)  # a weight state that is not w's own
    dynamic = f8.Recipe.from_name("delayed", delayed=f8.DelayedScaling(history_len=4, weight=False), kernels=kernels)
    delayed = f8.Recipe.from_name("delayed", delayed=f8.DelayedScaling(history_len=4), kernels=kernels)
    own = state._replace(weight=ScalingState.from_tensor(w, delayed.weight, 4))

    def run(fn, recipe, st, **kw):
        xx, ww, st_ = x.clone().requires_grad_(), w.clone().requires_grad_(), _fresh(st)
        y, _ = fn(xx, ww, recipe, st_, **kw)
        y.backward(dy)
        return (y, xx.grad, ww.grad, *st_.input, *st_.grad_output), st_

    def plain(x, w, recipe, st, w_casts=None):
        return fp8_linear(x, w, None, recipe, state=st, w_casts=w_casts)

    want, _ = run(plain, delayed, own)
    got, st_ = run(plain, dynamic, state)
    want = want[:3] + tuple(t.grad for t in (want[3:]))
    got_grads = got[:3] + tuple(t.grad for t in got[3:])
    assert st_.weight.amax_history.grad is None and st_.weight.scale.grad is None
    given, _ = run(plain, dynamic, state, w_casts={"w": f8.quantize(w, dynamic.weight)})
    torch._dynamo.reset()
    compiled, _ = run(torch.compile(plain, fullgraph=True), dynamic, state)
    for i, a in enumerate(want[:3]):
        assert torch.equal(a, got_grads[i]) and torch.equal(a, given[i]) and torch.equal(a, compiled[i])
    assert all(torch.equal(a, b) for a, b in zip(want[3:], got_grads[3:]))
    with pytest.raises(ValueError, match=r"DelayedScaling\(weight=False\) with a delayed recipe"):
        plain(x, w, delayed, state, w_casts={"w": f8.quantize(w, delayed.weight)})


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
    y_ref, _, nxt_ref = _eager(x, w, dy, state)
    xd = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    wd = DTensor.from_local(w.chunk(world_size)[rank].contiguous(), mesh, [Shard(0)], run_check=False)
    wd.requires_grad_()
    st_ = _fresh(state)
    y, _ = f8.linear_delayed(xd, wd, None, "delayed", st_)  # a column-parallel layer (TP)
    y.backward(DTensor.from_local(dy.chunk(world_size, -1)[rank].contiguous(), mesh, [Shard(2)], run_check=False))
    nxt = [t.grad for t in st_.tensors()]
    y = y.full_tensor()
    return {"states": all(torch.equal(a, b) for a, b in zip(nxt, nxt_ref.tensors())),
            "plain": all(not isinstance(t, DTensor) for t in nxt),
            "rel": ((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max()).item()}


@pytest.mark.slow
def test_delayed_linear_on_dtensors_records_the_global_amax():
    """Column-parallel DTensor operands (stock TP): the next states hold the whole tensors' amaxes,
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


@pytest.mark.parametrize("kwargs", [{"use_reentrant": False}, {"use_reentrant": True},
                                    {"use_reentrant": False, "context_fn": f8.nn.checkpoint_context}])
def test_activation_checkpointing_is_bitwise_the_run_without_it(kwargs):
    """Checkpointing recomputes each block's forward inside the backward; the forward never moves
    the state, so the recomputation casts with the forward's scales: losses and every state
    buffer bitwise the run without checkpointing, each amax recorded once."""
    plain = _train_checkpointed(None)
    ckpt = _train_checkpointed(kwargs)
    assert plain[0] == ckpt[0]
    assert plain[1].keys() == ckpt[1].keys() and all(torch.equal(plain[1][k], ckpt[1][k]) for k in plain[1])
    assert plain[1]["0.a.fp8_x_history"][3] > 0  # four steps recorded, once each


def test_activation_checkpointing_compiled_around_is_bitwise_eager():
    """Compile *around* the checkpoint: bitwise the eager run without checkpointing."""
    plain = _train_checkpointed(None, steps=3)
    compiled = _train_checkpointed({"use_reentrant": False}, steps=3, compiled=True)
    assert plain[0] == compiled[0]
    assert all(torch.equal(plain[1][k], compiled[1][k]) for k in plain[1])


@given(amaxes=st.lists(st.sampled_from([0.0, 1e-30, 0.5, 3.0, 448.0, 1e6, float("inf"), float("nan")]),
                       min_size=3, max_size=3),
       later=st.lists(st.booleans(), min_size=3, max_size=3), history_len=st.integers(1, 4),
       algo=st.sampled_from(["max", "most_recent"]), pow2=st.lists(st.booleans(), min_size=3, max_size=3),
       seed=st.integers(0, 2**16))
def test_the_packed_state_update_is_bitwise_the_one_state_update(amaxes, later, history_len, algo, pow2, seed):
    """``linear``'s backward updates its three states in one computation over their packed rows
    (``record_merged_packed``); its obviously-right twin is ``record_merged``, one state at a time."""
    from fp8func._delayed import record_merged_packed

    g = torch.Generator().manual_seed(seed)
    specs = tuple(f8.CastSpec(d, power_of_2=p) for d, p in zip((f8.E4M3, f8.E4M3, f8.E5M2), pow2))
    mine = [ScalingState(torch.rand(history_len, generator=g) * 100, torch.rand(1, 1, generator=g)) for _ in range(3)]
    theirs = [ScalingState(torch.rand(history_len, generator=g) * 100, torch.rand(1, 1, generator=g) + 0.1) if lt
              else ScalingState(torch.zeros(history_len), torch.zeros(1, 1)) for lt in later]
    pack = lambda sts: torch.stack([torch.cat([st.amax_history, st.scale.reshape(1)]) for st in sts])  # noqa: E731
    a = torch.tensor(amaxes)
    new = record_merged_packed(pack(mine), pack(theirs), a, specs, algo)
    h, s = new[:, :-1], new[:, -1:]
    for i in range(3):
        want = record_merged(mine[i], theirs[i], a[i], specs[i], algo)
        assert torch.equal(h[i].nan_to_num(7.0), want.amax_history.nan_to_num(7.0))
        assert torch.equal(s[i].reshape(1, 1), want.scale)


@pytest.mark.parametrize("weight,compiled", [(True, False), (False, False), (False, True)])
def test_packed_state_is_bitwise_the_six_state_tensors(weight, compiled):
    """The op takes the state as six tensors or packed in one (``Fp8Linear``'s one autograd leaf
    per layer): the same outputs and gradients, and the packed gradient is the six gradients
    concatenated (a state not recorded, a dynamic weight's, comes back unchanged), threaded
    through a second use too."""
    from fp8func._autograd import fp8_linear, unpack_state

    torch._dynamo.reset()
    x, w, dy = _data(5)
    state = _warm_state(x, w * 3, dy)
    recipe = f8.Recipe.from_name("delayed", delayed=f8.DelayedScaling(4, weight=weight))

    def two_uses(x, w, st):
        y1, passed = fp8_linear(x, w, None, recipe, state=st, packed=True)
        if not isinstance(st, torch.Tensor):
            passed = unpack_state(passed, st)
        y2, _ = fp8_linear(x * 2, w, None, recipe, state=passed, packed=True)
        return y1 + y2

    fn = torch.compile(two_uses, fullgraph=True) if compiled else two_uses
    six = _fresh(state)
    packed = torch.cat([t.detach().reshape(-1) for t in state.tensors()]).requires_grad_()
    ww1, ww2 = w.clone().requires_grad_(), w.clone().requires_grad_()
    fn(x, ww1, six).backward(dy)
    fn(x, ww2, packed).backward(dy)
    assert torch.equal(ww1.grad, ww2.grad)
    want = [t.grad if t.grad is not None else t.detach() for t in six.tensors()]
    assert (six.weight.scale.grad is None) == (not weight)
    assert torch.equal(packed.grad, torch.cat([t.reshape(-1) for t in want]))


def test_fp8_linear_state_is_one_autograd_leaf_per_layer():
    """A delayed ``Fp8Linear`` keeps its six state buffers as views of one packed tensor, the one
    leaf autograd accumulates the next state into (not six), and packs them again when something
    replaces them (``load_state_dict(assign=True)``, a deep copy); ``.bfloat16()`` leaves the state
    float32. Every way trains to the same state."""
    import copy

    def packed(layer):
        ts = layer.scaling_state().tensors()
        base = layer.scaling_buffers.packed
        return (base is not None and base.requires_grad and not any(t.requires_grad for t in ts)
                and all(t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr() for t in ts))

    def step(layer, x):
        layer(x).float().pow(2).sum().backward()

    torch.manual_seed(0)
    x = torch.randn(4, 16, 64).bfloat16()
    layer = f8.nn.Fp8Linear(64, 32, bias=False, recipe="delayed").bfloat16()  # the state stays float32
    assert packed(layer) and layer.weight.dtype == torch.bfloat16 and layer.fp8_x_scale.dtype == torch.float32
    step(layer, x)
    ref = {k: v.clone() for k, v in layer.state_dict().items()}
    assert packed(layer) and layer.scaling_buffers.packed.grad is None and layer.fp8_x_history[0] > 0
    old = layer.scaling_buffers.packed
    layer.to(torch.bfloat16)
    assert packed(layer) and layer.scaling_buffers.packed is old  # nothing to move
    copied = copy.deepcopy(layer)
    assert packed(copied) and copied.scaling_buffers.packed is not layer.scaling_buffers.packed
    loaded = f8.nn.Fp8Linear(64, 32, bias=False, recipe="delayed")
    loaded.load_state_dict({k: v.clone() for k, v in ref.items()}, assign=True)
    assert packed(loaded)
    for other in (copied, loaded):
        assert all(torch.equal(other.state_dict()[k], ref[k]) for k in ref)
    for m in (layer, copied, loaded):
        step(m, x * 3)
    for k in ref:
        assert torch.equal(copied.state_dict()[k], layer.state_dict()[k])
        assert torch.equal(loaded.state_dict()[k], layer.state_dict()[k])


def test_a_state_that_cannot_be_packed_stays_six_leaves_and_says_so(caplog):
    """A state of unequal history lengths (set by hand) cannot be packed: the layer keeps six
    leaves, logs it, and still writes the next state into its buffers."""
    import logging

    layer = f8.nn.Fp8Linear(64, 32, bias=False, recipe="delayed")
    layer.fp8_w_history = torch.zeros(3)  # another length than the input's and grad_output's
    x = torch.randn(4, 16, 64)
    with caplog.at_level(logging.DEBUG, logger="fp8func"):
        layer(x).pow(2).sum().backward()
    assert layer.scaling_buffers.packed is None and "six autograd leaves" in caplog.text
    assert layer.fp8_x_history[0] > 0 and layer.fp8_w_history[0] > 0 and layer.fp8_x_history.grad is None


def test_next_states_are_written_once_per_model_and_after_a_backward_that_raised():
    """A converted model's delayed layers share one StateWrites (one write at the end of each
    backward); a copy writes its own layers; a backward that raises before its end leaves
    nothing behind, and the next backward writes every layer's next state."""
    import copy

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    torch.manual_seed(0)
    model = f8.convert(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32)), "delayed", fsdp_fp8_all_gather=False)
    assert model[0].scaling_buffers.writes is model[1].scaling_buffers.writes
    other = copy.deepcopy(model)
    assert other[0].scaling_buffers.writes is other[1].scaling_buffers.writes \
        and other[0].scaling_buffers.writes is not model[0].scaling_buffers.writes
    with pytest.raises(RuntimeError, match="boom"):
        model[1](Boom.apply(model[0](torch.randn(8, 64)))).sum().backward()
    fresh = f8.convert(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 32)), "delayed", fsdp_fp8_all_gather=False)
    fresh.load_state_dict(model.state_dict())
    for m in (model, fresh):
        with torch.no_grad():
            m[1].scaling_buffers.packed.grad = None  # what the failed backward accumulated
        m[0].scaling_buffers.pending = m[1].scaling_buffers.pending = None
    x = torch.randn(8, 64)
    for m in (model, fresh):
        m(x).sum().backward()
    for k, v in fresh.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert model[0].fp8_x_history[0] > 0 and model[1].fp8_dy_history[0] > 0


# --------------------------------------------------------------------------------------------
# GPU (the `gpu` mark: skipped with the reason where no FP8-capable CUDA GPU is visible).


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_delayed_linear_with_triton_kernels_is_bitwise_the_plain_casts(compiled):
    """Delayed scaling through ``kernels.cast_amax`` (cast, transposed copy and amax in one pass)
    against the plain casts: output, gradients and all three next states (the states' gradients)."""
    from fp8func._delayed import LinearScalingState, ScalingState

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(4, 256, 512, device="cuda", generator=g).bfloat16()
    w = (torch.randn(1024, 512, device="cuda", generator=g) / 512**0.5).bfloat16()
    dy = torch.randn(4, 256, 1024, device="cuda", generator=g).bfloat16()
    spec = f8.Recipe.from_name("delayed")
    state = LinearScalingState(ScalingState.from_tensor(x, spec.input, 4),
                               ScalingState.from_tensor(w / 4, spec.weight, 4),
                               ScalingState.from_tensor(dy * 8, spec.grad_output, 4))  # w's scale saturates
    runs = {}
    for mode in ("off", "auto"):
        recipe = f8.Recipe.from_name("delayed", kernels=mode)

        def step(x, w, *tensors):
            return f8.linear_delayed(x, w, None, recipe, LinearScalingState.from_tensors(tensors))[0]

        torch._dynamo.reset()
        fn = torch.compile(step, fullgraph=True) if compiled else step
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        st = [t.clone().requires_grad_() for t in state.tensors()]
        y = fn(xx, ww, *st)
        y.backward(dy)
        runs[mode] = (y, xx.grad, ww.grad, *(t.grad for t in st))
    for a, b in zip(runs["off"], runs["auto"], strict=True):
        assert torch.equal(a, b)
