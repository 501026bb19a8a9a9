"""FSDP2 with fp32 master weights and bf16 mixed precision: fp8 all-gather on == off, bitwise."""

import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fp8func as f8
from fp8func._casts import weight_casts

from .dist_harness import run_workers
from .models import batch, tiny_qwen3


class _CountAllGather:
    """Counts the bytes FSDP2 hands to its all-gather (``dist.all_gather_single`` in torch 2.13,
    ``dist.all_gather_into_tensor`` before): the weight all-gathers, nothing else."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self):
        self.bytes = 0
        self._orig = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def __enter__(self):
        for name, orig in self._orig.items():
            def counting(output_tensor, input_tensor, *args, _orig=orig, **kwargs):
                self.bytes += input_tensor.numel() * input_tensor.element_size()
                return _orig(output_tensor, input_tensor, *args, **kwargs)

            setattr(dist, name, counting)
        return self

    def __exit__(self, *exc):
        for name, orig in self._orig.items():
            setattr(dist, name, orig)


def _train(rank, world_size, recipe, fp8_gather, steps, reshard, param_dtype, precompute=False, compiled=False):
    # precompute: False (the hooks make every scale), True / "once" (precompute_scales called here after
    # every / the first step), "auto" (every optimizer step precomputes by itself, the default setting)
    f8.distributed.precompute_after_optimizer_step(precompute == "auto")
    mesh = init_device_mesh("cpu", (world_size,))
    model = tiny_qwen3(layers=1 if compiled else 2)  # compiling on 2 CPU cores is the slow part
    if param_dtype == "bf16-weights":
        model = model.bfloat16()
        mp = MixedPrecisionPolicy()
    else:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if recipe is not None:
        f8.convert(model, recipe, fsdp_fp8_all_gather=fp8_gather)
        if isinstance(recipe, f8.Recipe) and recipe.delayed is not None:
            f8.distributed.share_scaling_state(model, mesh)  # one scaling state on every rank
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard)
    if compiled:  # per-block compile, FSDP2 hooks eager (the torchtitan layout)
        for layer in model.model.layers:
            layer.compile(fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, covered = [], []
    used = []
    import fp8func.distributed._fsdp as fsdp_mod
    import fp8func.distributed._precompute as precompute_mod

    fresh = []  # scales the pre-all-gather hook computed (amax and its all-reduce), not reused
    restore = {fn_name: getattr(fsdp_mod, fn_name) for fn_name in ("cast", "scale_for_cast", "cast_with_scale")}
    import fp8func.kernels as kernel_ops

    restore_precompute = precompute_mod.cast_with_scale, kernel_ops.cast_many
    for fn_name in ("cast", "scale_for_cast"):
        def count(*a, _orig=restore[fn_name], **k):
            fresh.append(1)
            return _orig(*a, **k)

        setattr(fsdp_mod, fn_name, count)
    if precompute:
        orig = fsdp_mod.cast_with_scale

        def counting(*a, **k):
            used.append(1)
            return orig(*a, **k)

        def counting_many(xs, *a, _orig=kernel_ops.cast_many, **k):
            used.extend([1] * len(xs))
            return _orig(xs, *a, **k)

        # the hooks' casts with a kept scale, and precompute_scales' own (one weight at a time, or
        # every tensorwise weight of a mesh in one cast_many)
        fsdp_mod.cast_with_scale = precompute_mod.cast_with_scale = counting
        kernel_ops.cast_many = counting_many
    with _CountAllGather() as counter:
        for step in range(steps):
            ids, labels = batch(step, rank)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if precompute == "once" and step == 0 or precompute is True:
                covered.append(f8.precompute_scales(model))
            losses.append(loss.detach().float().item())
    for fn_name, fn in restore.items():
        setattr(fsdp_mod, fn_name, fn)
    precompute_mod.cast_with_scale, kernel_ops.cast_many = restore_precompute
    n_layers = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, f8.nn.Fp8Linear))
    n_root = model.lm_head.weight.numel() if isinstance(model.lm_head, f8.nn.Fp8Linear) else 0
    return {"losses": losses, "bytes": counter.bytes, "fp8_numel_layers": n_layers, "fp8_numel_root": n_root,
            "scale_bytes": _row_scale_bytes(model, world_size) if fp8_gather else 0, "covered": covered,
            "precomputed_used": len(used), "fresh_scales": len(fresh),
            "fp8_casts": sum(len(weight_casts(m.recipe)) for m in model.modules() if isinstance(m, f8.nn.Fp8Linear))}


def _train_on_off(rank, world_size, recipe, *args):
    """``_train`` with the fp8 all-gather on, then off, in the same processes (one spawn: starting
    and importing is a good part of a short run). ``args``: ``_train``'s after ``fp8_gather``."""
    on = _train(rank, world_size, recipe, True, *args)
    torch._dynamo.reset()
    return on, _train(rank, world_size, recipe, False, *args)


def _row_scale_bytes(model, world_size: int) -> int:
    """Bytes of row-split scales one rank adds to FSDP2's all-gather of all the fp8 weights: the
    forward cast's scale groups of its row shard, fp32 (tensorwise: none, its scale spans the
    rows). Evenly sharded weights (uneven ones gather their scales in a collective of their own)."""
    from fp8func._scaling import block_lengths, scale_shape
    from fp8func.distributed import chunk_sizes

    total = 0
    for m in model.modules():
        if isinstance(m, f8.nn.Fp8Linear):
            n, k = m.weight.shape
            b = block_lengths(m.recipe.weight.granularity, (n, k))[0]
            if b is not None and len(set(chunk_sizes(n, world_size))) == 1:
                total += n // world_size // b * scale_shape(m.recipe.weight.granularity, (n, k))[1] * 4
    return total


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fsdp_fp8_all_gather_on_off_bitwise_and_bytes(recipe):
    steps = 20
    on, off = zip(*run_workers(_train_on_off, 2, recipe, steps, True, "fp32-master"))
    # The backward's all-gather casts the unchanged weights again with the forward's scales: one
    # amax (and amax all-reduce) per cast and step, not one per all-gather.
    assert on[0]["fresh_scales"] == steps * on[0]["fp8_casts"], (on[0]["fresh_scales"], on[0]["fp8_casts"])
    for r_on, r_off in zip(on, off):
        assert r_on["losses"] == r_off["losses"], (r_on["losses"][:3], r_off["losses"][:3])
        assert all(torch.isfinite(torch.tensor(r_on["losses"])))
    saved = off[0]["bytes"] - on[0]["bytes"]
    # Every FSDP2 group here (reshard_after_forward=True, the root too) gathers its weights in the
    # forward and again in the backward, one fp8 payload each time (row-wise: the forward's cast,
    # then the backward's): 1 byte per weight element instead of bf16's 2, i.e. half; row-wise
    # and block scales travel in the same all-gather (every gather: the forward cast's scales).
    world = 2
    fp8_numel = on[0]["fp8_numel_layers"] + on[0]["fp8_numel_root"]
    assert (on[0]["scale_bytes"] == 0) == (recipe == "tensorwise"), on[0]["scale_bytes"]
    assert saved == steps * 2 * (fp8_numel // world - on[0]["scale_bytes"]), (saved, on[0]["bytes"], off[0]["bytes"])


@pytest.mark.slow
def test_fsdp_delayed_scaling_with_a_dynamic_weight_gathers_fp8_bitwise():
    """``DelayedScaling(weight=False)``: the input and grad_output keep their histories, the weight
    is cast dynamically, so FSDP2 all-gathers it in FP8 (half the bytes), bitwise the bf16 gather."""
    steps = 6
    recipe = f8.Recipe.from_name("delayed", delayed=f8.DelayedScaling(weight=False))
    on, off = zip(*run_workers(_train_on_off, 2, recipe, steps, True, "fp32-master"))
    for r_on, r_off in zip(on, off):
        assert r_on["losses"] == r_off["losses"], (r_on["losses"][:3], r_off["losses"][:3])
        assert all(torch.isfinite(torch.tensor(r_on["losses"])))
    fp8_numel = on[0]["fp8_numel_layers"] + on[0]["fp8_numel_root"]
    assert fp8_numel > 0 and on[0]["fresh_scales"] == steps * on[0]["fp8_casts"]
    assert off[0]["bytes"] - on[0]["bytes"] == steps * 2 * (fp8_numel // 2), (on[0]["bytes"], off[0]["bytes"])


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp_bf16_weights_and_no_reshard(recipe):
    # No resharding after forward: one gather per step, and row-wise weights send both casts in it.
    on = run_workers(_train, 2, recipe, True, 6, False, "bf16-weights")
    off = run_workers(_train, 2, recipe, False, 6, False, "bf16-weights")
    assert on[0]["losses"] == off[0]["losses"]
    fp8_numel = on[0]["fp8_numel_layers"] + on[0]["fp8_numel_root"]
    payloads = 2 if recipe == "rowwise" else 1
    assert off[0]["bytes"] - on[0]["bytes"] == 6 * ((2 - payloads) * fp8_numel // 2 - on[0]["scale_bytes"])


@pytest.mark.slow
def test_fsdp_four_ranks_rowwise():
    on = run_workers(_train, 4, "rowwise", True, 6, True, "fp32-master")
    off = run_workers(_train, 4, "rowwise", False, 6, True, "fp32-master")
    assert on[0]["losses"] == off[0]["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe,reshard", [("rowwise", False), ("rowwise", True), ("blockwise", True)])
def test_fsdp_one_rank_mesh(recipe, reshard):
    # dp=1 (TP only, or one GPU, with fully_shard applied anyway): FSDP2 then skips the collective
    # and copies only the first all-gather input; the second row-wise payload and the row scales
    # must still reach the gathered weight.
    [(on, off)] = run_workers(_train_on_off, 1, recipe, 4, reshard, "fp32-master")
    assert on["losses"] == off["losses"]
    assert on["bytes"] == off["bytes"] == 0  # no collective on one rank


@pytest.mark.slow
def test_precompute_scales_keeps_the_contract():
    on = run_workers(_train, 2, "tensorwise", True, 6, True, "fp32-master", True)
    off = run_workers(_train, 2, "tensorwise", False, 6, True, "fp32-master")
    assert on[0]["losses"] == off[0]["losses"]
    assert on[0]["covered"] == [15] * 6  # every converted layer: 2 decoder layers x 7, and lm_head
    # Casts with a known scale: precompute_scales casts every weight once per call (6 x 15), and the
    # gathers after it cast nothing (they send its payload); step 0's backward gathers cast with the
    # scales of step 0's forward (15), the only gathers that computed a scale (15).
    assert on[0]["precomputed_used"] == 6 * 15 + 15
    assert on[0]["fresh_scales"] == 15


@pytest.mark.slow
def test_every_optimizer_step_precomputes_the_scales():
    """By default every optimizer step ends with precompute_scales over the fp8 weights it holds: after
    the first step no all-gather hook computes a scale, the losses are bitwise the fp8 all-gather off,
    and the one all-reduce per step replaces one per weight."""
    on = run_workers(_train, 2, "tensorwise", True, 6, True, "fp32-master", "auto")
    off = run_workers(_train, 2, "tensorwise", False, 6, True, "fp32-master")
    assert on[0]["losses"] == off[0]["losses"] and on[1]["losses"] == off[1]["losses"]
    assert on[0]["fresh_scales"] == 15  # step 0's forward only: 2 decoder layers x 7, and lm_head
    # 1 decoder layer x 7 and lm_head, covered twice; an explicit call after the step's own precompute:
    # no new collective
    assert run_workers(_precompute_twice, 2) == [(1, 8, 8, 1)] * 2


def _precompute_twice(rank, world_size):
    """One step with the automatic precompute, then precompute_scales twice: both cover every weight,
    and only the step's own made an all-reduce (the kept payloads are current after it)."""
    import fp8func.distributed._precompute as precompute_mod

    model, opt = _model_and_opt(world_size)
    reduced = []
    orig = precompute_mod._reduce_max_eager
    precompute_mod._reduce_max_eager = lambda *a: reduced.append(1) or orig(*a)
    try:
        ids, labels = batch(0, rank)
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()  # the automatic precompute: one reduction
        after_step = len(reduced)
        return after_step, f8.precompute_scales(model), f8.precompute_scales(model), len(reduced)
    finally:
        precompute_mod._reduce_max_eager = orig


def _rowwise_all_reduces(rank, world_size, auto, one_read=False):
    """Three row-wise FSDP2 steps (fp8 all-gather on): losses, trained weights and the amax
    all-reduces of each step (the hooks' and the optimizer step's precompute). ``one_read``: the
    precompute takes the route it takes on CUDA (both casts of a shard from one amax pass and
    one cast pass; here their PyTorch twins), counted."""
    import torch.distributed._functional_collectives as funcol

    import fp8func.distributed._precompute as precompute_mod
    import fp8func.kernels as fk

    one_reads, orig_rc, orig_uk = [], fk.cast_rows_cols, precompute_mod.use_kernels
    if one_read:
        precompute_mod.use_kernels = lambda t, spec: True
        fk.cast_rows_cols = lambda *a, **k: one_reads.append(1) or orig_rc(*a, **k)
    f8.distributed.precompute_after_optimizer_step(auto)
    model, opt = _model_and_opt(world_size, "rowwise", layers=2, lr=3e-3)
    # the hooks reduce through functional collectives, the optimizer step's precompute through c10d
    counts, orig, orig_c10d = [], funcol.all_reduce, dist.all_reduce
    funcol.all_reduce = lambda *a, **k: counts.__setitem__(-1, counts[-1] + 1) or orig(*a, **k)
    dist.all_reduce = lambda *a, **k: counts.__setitem__(-1, counts[-1] + 1) or orig_c10d(*a, **k)
    try:
        losses = _counted_steps(model, opt, rank, 3, counts)
    finally:
        funcol.all_reduce, dist.all_reduce = orig, orig_c10d
        fk.cast_rows_cols, precompute_mod.use_kernels = orig_rc, orig_uk
        f8.distributed.precompute_after_optimizer_step(True)
    weights = [p.to_local().detach().clone() for p in model.parameters()]
    return {"losses": losses, "counts": counts, "weights": weights, "one_reads": len(one_reads)}


@pytest.mark.slow
def test_rowwise_weights_column_scales_are_precomputed_in_one_all_reduce():
    """Row-wise weights under FSDP2: each w_t cast's column amax spans the row shards. The hooks
    reduce it per weight (15 per step: 2 layers x 7 and lm_head); the optimizer step's precompute
    reduces them all in one all-reduce, after which the hooks reduce none: the same bits; so does
    the route the precompute takes on CUDA (each shard's two casts from one amax pass and one cast
    pass), every weight, every step."""
    auto = run_workers(_rowwise_all_reduces, 2, True)
    hooks = run_workers(_rowwise_all_reduces, 2, False)
    one_read = run_workers(_rowwise_all_reduces, 2, True, True)
    for a, h, o in zip(auto, hooks, one_read):
        assert a["losses"] == h["losses"] == o["losses"]
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a["weights"], h["weights"], o["weights"]))
    assert hooks[0]["counts"] == [15, 15, 15], hooks[0]["counts"]
    assert auto[0]["counts"] == one_read[0]["counts"] == [15 + 1, 1, 1], (auto[0]["counts"], one_read[0]["counts"])
    assert auto[0]["one_reads"] == 0 and one_read[0]["one_reads"] == 3 * 15, one_read[0]["one_reads"]


@pytest.mark.slow
def test_a_precomputed_scale_is_never_used_stale():
    """Precomputed once, after step 0: the optimizer's later updates make it stale, so the hook
    computes fresh scales (the optimizer writes through FSDP2's DTensor into the wrapper, below
    autograd, where the inner tensor's ``_version`` never moves: each wrapper counts its writes)."""
    # Two ranks: the hook's kept inputs (built from the last gather, several ranks only) meet the stale payload too.
    (on, off), _ = run_workers(_train_on_off, 2, "tensorwise", 3, True, "fp32-master", "once")
    assert on["losses"] == off["losses"], (on["losses"], off["losses"])
    assert on["covered"] == [15]
    # step 1's two gathers per weight use it; at step 2 it is stale: one fresh scale per weight
    assert on["precomputed_used"] >= 15 and on["fresh_scales"] == 2 * 15, (on["precomputed_used"], on["fresh_scales"])


def _poke(model, rank) -> None:
    """Writes three weights in place, without a precompute after: an in-place op on the FSDP2
    parameter, a ``load_state_dict`` (every parameter), a write through a ``detach()`` alias."""
    from fp8func.distributed._compat import local_tensor

    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.mul_(1.5)
        sd = model.state_dict()
        key = "model.layers.0.mlp.down_proj.weight"
        sd[key] = sd[key] * 0.75
        model.load_state_dict(sd)
        local_tensor(model.lm_head.weight).detach().mul_(0.5)


def _precomputed_run(rank, world_size, recipe, on, reshard, compiled, steps=4, poke_after=1):
    """``steps`` FSDP2 steps with the automatic precompute; after step ``poke_after``'s optimizer
    step, ``_poke``. Per step: the casts and collectives made inside the pre-all-gather hooks,
    the collectives of the step by kind (c10d's flight recorder: every collective the process
    group ran), the payload bytes kept after the optimizer step against the shards' elements, and
    stale entries kept. Also the losses, the trained weights, and whether the poked weight's first
    gathered ``w`` payload after the poke is bitwise a fresh cast of its shard."""
    import pickle

    import torch.distributed._functional_collectives as funcol

    import fp8func.distributed._fsdp as fsdp_mod
    from fp8func.distributed._compat import local_tensor

    f8.distributed.precompute_after_optimizer_step(True)
    model, opt = _model_and_opt(world_size, recipe, layers=1 if compiled else 2, lr=3e-3,
                                fsdp_fp8_all_gather=on, reshard=reshard)
    if compiled:
        for layer in model.model.layers:
            layer.compile(fullgraph=True)
    in_hook, hook_casts, hook_colls, fresh, seen = [False], [], [], [], []
    poked = local_tensor(model.model.layers[0].self_attn.q_proj.weight)

    def counting(fn, counts):
        return lambda *a, **k: (counts.__setitem__(-1, counts[-1] + in_hook[0]), fn(*a, **k))[1]

    hook = fsdp_mod.Fp8AllGatherWeight.__dict__["fsdp_pre_all_gather"]  # a signed_hook
    orig_hook = hook.fn

    @functools.wraps(orig_hook)  # FSDP2 reads the hook's signature
    def pre_hook(weight, *a, **k):
        in_hook[0] = True
        try:
            out = orig_hook(weight, *a, **k)
        finally:
            in_hook[0] = False
        if weight is poked and fresh and not seen:
            seen.append(torch.equal(out[0][0][:fresh[0].shape[0]], fresh[0]))
        return out

    patched = [(fsdp_mod, n, hook_casts) for n in ("cast", "cast_with_scale", "scale_for_cast")]
    patched += [(funcol, "all_reduce", hook_colls), (dist, "all_reduce", hook_colls)]
    restore = [(mod, n, getattr(mod, n)) for mod, n, _ in patched]
    for mod, n, counts in patched:
        setattr(mod, n, counting(getattr(mod, n), counts))
    fsdp_mod.Fp8AllGatherWeight.fsdp_pre_all_gather = fsdp_mod.signed_hook(pre_hook)
    dump = torch._C._distributed_c10d._dump_fr_trace
    last = max((e["record_id"] for e in pickle.loads(dump(True, False, False)).get("entries", [])), default=-1)
    losses, colls, kept = [], [], []
    try:
        for step in range(steps):
            hook_casts.append(0)
            hook_colls.append(0)
            ids, labels = batch(step, rank)
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            entries = [e for e in pickle.loads(dump(True, False, False))["entries"] if e["record_id"] > last]
            last = max([last] + [e["record_id"] for e in entries])
            kinds: dict = {}
            for e in entries:
                kinds[e["profiling_name"]] = kinds.get(e["profiling_name"], 0) + 1
            colls.append(kinds)
            kept.append(_kept_bytes(model) if on else None)
            if step == poke_after:
                _poke(model, rank)
                if on and recipe == "rowwise":  # w: row scales, within the shard
                    spec = dict(weight_casts(poked.plan))["w"]
                    fresh.append(fsdp_mod.cast(poked.hp_values().to(torch.bfloat16), spec)[0].data.view(torch.uint8))
    finally:
        fsdp_mod.Fp8AllGatherWeight.fsdp_pre_all_gather = hook
        for mod, n, fn in restore:
            setattr(mod, n, fn)
    weights = [p.to_local().detach().clone() for p in model.parameters()]
    return {"losses": losses, "weights": weights, "hook_casts": hook_casts, "hook_colls": hook_colls,
            "colls": colls, "kept": kept, "fresh_seen": seen}


def _kept_bytes(model) -> tuple[int, int, int]:
    """(payload bytes the fp8 all-gather weights keep, elements of their shards, kept entries or
    all-gathers made at another weight version than the current one)."""
    from fp8func.distributed._compat import local_tensor
    from fp8func.distributed._fsdp import Fp8AllGatherWeight

    payload = numel = stale = 0
    for p in model.parameters():
        w = local_tensor(p)
        if isinstance(w, Fp8AllGatherWeight):
            numel += w.numel()
            version = w.weight_version()
            for e in w._scales.values():
                payload += e[2].numel() * e[2].element_size() if len(e) == 3 else 0
                stale += e[0] != version
            for g in w.__dict__.get("_gathers_kept", {}).values():
                stale += g.entries is not None and any(e[0] != version for _, e in g.entries)
    return payload, numel, stale


def _precomputed_on_off(rank, world_size, *args):
    on = _precomputed_run(rank, world_size, args[0], True, *args[1:])
    torch._dynamo.reset()
    return on, _precomputed_run(rank, world_size, args[0], False, *args[1:])


@pytest.mark.slow
@pytest.mark.parametrize("recipe,reshard,compiled", [("rowwise", True, False), ("rowwise", False, False),
                                                     ("rowwise", True, True), ("tensorwise", True, False)])
def test_precomputed_casts_keep_the_contract_and_the_hooks_cast_and_reduce_nothing(recipe, reshard, compiled):
    """Every optimizer step precomputes every FSDP2 fp8 weight's casts (row-wise: w with row
    scales and w_t with column scales, the column amaxes of all weights in one all-reduce) and
    keeps their payloads; the hooks then hand FSDP2 the kept payloads. Checked per step: the
    losses and trained weights are bitwise the fp8 all-gather off; after the first step the hooks
    cast nothing and launch no collective, and the step runs the collectives of the high-precision
    path plus that one all-reduce (c10d's flight recorder, every collective of the process
    group); the payloads kept between steps are one byte per shard element per cast (row-wise:
    two), none stale. A weight written in place after the precompute (an in-place op, a
    ``load_state_dict``, a write through an alias) is never sent stale: its next gather is a
    fresh cast, bitwise."""
    if not hasattr(torch._C._distributed_c10d, "_dump_fr_trace"):
        pytest.skip(f"torch {torch.__version__} has no c10d flight recorder dump for gloo")
    import os

    os.environ["TORCH_FR_BUFFER_SIZE"] = "20000"  # before the workers make their process groups
    try:
        results = run_workers(_precomputed_on_off, 2, recipe, reshard, compiled)
    finally:
        del os.environ["TORCH_FR_BUFFER_SIZE"]
    casts = 2 if recipe == "rowwise" else 1
    for on, off in results:
        assert on["losses"] == off["losses"], (on["losses"], off["losses"])
        assert all(torch.equal(a, b) for a, b in zip(on["weights"], off["weights"]))
        # step 2 follows the poke: its hooks cast (and reduce) what was written; steps 1 and 3 nothing
        assert on["hook_casts"][1] == on["hook_casts"][3] == 0 < on["hook_casts"][2], on["hook_casts"]
        assert on["hook_colls"][1] == on["hook_colls"][3] == 0, on["hook_colls"]
        for step in (1, 3):
            plus_one = {k: v + ("all_reduce" in k) for k, v in off["colls"][step].items()}
            assert on["colls"][step] == plus_one, (step, on["colls"][step], off["colls"][step])
        for payload, numel, stale in on["kept"]:
            assert payload == casts * numel and stale == 0, on["kept"]
        assert on["fresh_seen"] == ([True] if recipe == "rowwise" else []), on["fresh_seen"]


@pytest.mark.parametrize("write", ["mul_", "copy_", "detach_alias", "hp_values_alias", "data", "load_state_dict"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_kept_casts_are_bitwise_fresh_casts_and_any_write_makes_them_stale(recipe, write):
    """A weight's kept casts (``_keep_casts``, what precompute_scales keeps for the all-gathers)
    are bitwise the casts of its shard in the param dtype; after any write to the weight they
    are no longer current, so the hook casts afresh."""
    from fp8func._ops import quantize
    from fp8func.distributed import Fp8AllGatherWeight

    layer = f8.convert(torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)), recipe)[0]
    w = layer.weight
    assert isinstance(w, Fp8AllGatherWeight)
    w._param_dtype, w._sharding_kept = torch.bfloat16, (None, None, ())  # as after an all-gather, one rank
    w._keep_casts()
    assert w._payloads_kept()
    for name, spec in weight_casts(w.plan):
        want = quantize(w.hp_values().to(torch.bfloat16), spec)
        _, scale, data = w._scales[name]
        assert torch.equal(scale, want.scale) and torch.equal(data.view(torch.uint8), want.data.view(torch.uint8))
    new = torch.randn(32, 64)
    with torch.no_grad():
        if write == "mul_":
            w.mul_(2)
        elif write == "copy_":
            w.copy_(new)
        elif write == "detach_alias":
            w.detach().add_(1)
        elif write == "hp_values_alias":
            w.hp_values().add_(1)
        elif write == "data":
            w.data = new
        else:
            layer.load_state_dict({"weight": new})
    assert not w._payloads_kept() and w._kept_gather(None, torch.bfloat16, (32, 64), ("w",)) is None


def test_kept_casts_of_a_mixed_mesh_group_say_why_they_are_not_kept(caplog):
    """One FSDP2 mesh's tensorwise weights share the precompute's kept buffers only when they share
    cast spec, dtype and rounding; otherwise the precompute casts them with new tensors each step
    (the same bits) and says once, at INFO, which weight differs in what."""
    from fp8func._log import forget
    from fp8func.distributed._precompute import _KeptCasts

    def weight(dtype):
        w = f8.convert(torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)), "tensorwise")[0].weight
        w._tensor = w._tensor.to(dtype)
        w._param_dtype = torch.bfloat16  # as after an all-gather
        return w

    forget(("kept casts", "dtype"))
    with caplog.at_level("INFO", logger="fp8func"):
        assert _KeptCasts.of([weight(torch.float32), weight(torch.float32)]) is not None
        assert _KeptCasts.of([weight(torch.float32), weight(torch.bfloat16)]) is None
    said = [r.getMessage() for r in caplog.records if "kept buffers" in r.getMessage()]
    assert len(said) == 1 and "weight 1 differs from the first in its dtype" in said[0], said


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fsdp_compiled_on_off_bitwise(recipe):
    (on, off), _ = run_workers(_train_on_off, 2, recipe, 3, True, "fp32-master", False, True)
    assert on["losses"] == off["losses"]
    assert on["bytes"] < off["bytes"]


def _misaligned_blocks(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    model = f8.convert(tiny_qwen3(layers=1), "blockwise")
    fully_shard(model, mesh=mesh)
    ids, labels = batch(0, rank)
    try:
        model(input_ids=ids, labels=labels)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.slow
def test_fsdp_blockwise_misaligned_shards_raise_with_the_fix():
    msg = run_workers(_misaligned_blocks, 4)[0]
    assert "row shards of [64, 64, 64, 64] over 4 ranks" in msg and "fsdp_fp8_all_gather=False" in msg


def _checkpointed(rank, world_size, recipe, fp8_gather):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    mesh = init_device_mesh("cpu", (world_size,))
    model = tiny_qwen3()
    f8.convert(model, recipe, fsdp_fp8_all_gather=fp8_gather)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
        fully_shard(model.model.layers[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    ids, labels = batch(0, rank)
    try:
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
    except RuntimeError as e:
        return str(e)
    return loss.item()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_activation_checkpointing(recipe):
    on = run_workers(_checkpointed, 2, recipe, True)[0]
    off = run_workers(_checkpointed, 2, recipe, False)[0]
    if recipe == "tensorwise":  # one cast serves both passes: checkpointing just works
        assert on == off
    else:  # never silently wrong: the recomputed forward finds only the backward's cast
        assert isinstance(on, str) and "activation checkpointing recomputes the forward" in on, on


def _checkpointed_delayed(rank, world_size, checkpointing):
    """Delayed scaling (dynamic weight: FSDP2 gathers it in FP8) with each decoder layer under
    checkpoint_wrapper, three SGD steps; ``checkpointing``: None, "context" or "plain"."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    mesh = init_device_mesh("cpu", (world_size,))
    model = tiny_qwen3()
    f8.convert(model, f8.Recipe.from_name("delayed", delayed=f8.DelayedScaling(weight=False)))
    f8.distributed.share_scaling_state(model, mesh)
    kwargs = {"context_fn": f8.nn.checkpoint_context} if checkpointing == "context" else {}
    for i, layer in enumerate(model.model.layers):
        if checkpointing:
            model.model.layers[i] = layer = checkpoint_wrapper(layer, **kwargs)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    try:
        return _counted_steps(model, opt, rank, 3, [])
    except RuntimeError as e:
        return str(e)


@pytest.mark.slow
def test_activation_checkpointing_with_delayed_scaling_under_fsdp2():
    """FSDP2 + checkpoint_wrapper + delayed scaling: the recomputed layers cast with their
    forward's state (the forward never moves it), so the losses are bitwise the run without
    checkpointing, with or without the (no-op) ``context_fn=checkpoint_context``."""
    plain = run_workers(_checkpointed_delayed, 2, None)
    replayed = run_workers(_checkpointed_delayed, 2, "context")
    stock = run_workers(_checkpointed_delayed, 2, "plain")
    assert plain == replayed == stock and all(isinstance(r, list) and len(r) == 3 for r in plain), (plain, stock)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fsdp_uneven_shards(recipe):
    # 3 ranks: 256-row weights shard as 86/86/84 rows, so FSDP2 pads the last shard.
    on = run_workers(_train, 3, recipe, True, 4, True, "fp32-master")
    off = run_workers(_train, 3, recipe, False, 4, True, "fp32-master")
    assert on[0]["losses"] == off[0]["losses"]
    assert on[0]["bytes"] < off[0]["bytes"]


def _shared_delayed_state_compiled(rank, world_size):
    """Delayed scaling with its amaxes shared over the ranks, the model compiled (fullgraph), against
    the same model run eagerly, 3 steps: the scaling states, bitwise; losses and gradients to fp32
    rounding (inductor fuses the GELU and the loss's reduction in another order)."""
    mesh = init_device_mesh("cpu", (world_size,))
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.GELU(),
                                    torch.nn.Linear(64, 64, bias=False))
        f8.convert(model, "delayed", fsdp_fp8_all_gather=False)
        f8.distributed.share_scaling_state(model, mesh)
        run = torch.compile(model, fullgraph=True) if compiled else model
        losses = []
        for step in range(3):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 * step + rank)) * (1 + step + rank)
            loss = run(x).square().mean()
            loss.backward()
            losses.append(loss.detach())
        runs.append((losses, [p.grad for p in model.parameters()], [b.clone() for b in model.buffers()]))
    return runs


@pytest.mark.slow
def test_shared_delayed_scaling_state_compiles_and_matches_eager():
    for (losses, grads, states), (c_losses, c_grads, c_states) in run_workers(_shared_delayed_state_compiled, 2):
        assert all(torch.equal(u, v) for u, v in zip(states, c_states))
        for u, v in [*zip(losses, c_losses), *zip(grads, c_grads)]:
            torch.testing.assert_close(v, u, rtol=1e-5, atol=1e-6)


def _special_shards(device) -> list[torch.Tensor]:
    """fp32 master shards: random, bf16 rounding ties and near-ties, subnormals, NaN, +-inf,
    above bf16's max, empty."""
    g = torch.Generator().manual_seed(0)
    tie = 1 + 2.0 ** -8  # exactly between two bf16 values: rounds to even
    shards = [torch.randn(1000, generator=g) * 3, torch.tensor([tie, -tie * 1.5, 1 + 2.0 ** -9]),
              torch.tensor([1e-40, -3e-39]), torch.tensor([1.0, float("nan"), 2.0]),
              torch.tensor([-float("inf"), 0.0]), torch.tensor([3.4e38, -1.0]), torch.empty(0),
              torch.zeros(7), (torch.randn(64, 64, generator=g) * 1e4).half()]
    return [t.to(device) for t in shards]


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_precompute_amaxes_are_bitwise_the_hooks(param_dtype):
    """precompute_scales' multi-tensor amax of the masters equals the amax of each shard cast to
    the param dtype (what the pre-all-gather hook casts), bitwise, NaN and inf included."""
    from fp8func.distributed._precompute import shard_amaxes, shard_amaxes_reference

    shards = _special_shards("cpu")
    dtypes = [param_dtype] * len(shards)
    fast, slow = shard_amaxes(shards, dtypes), shard_amaxes_reference(shards, dtypes)
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32)), (fast, slow)
    mixed = [param_dtype, torch.float32] * (len(shards) // 2) + [param_dtype] * (len(shards) % 2)
    assert torch.equal(shard_amaxes(shards, mixed).view(torch.int32),
                       shard_amaxes_reference(shards, mixed).view(torch.int32))


def _kept_after_precompute(rank, world_size):
    from fp8func.distributed._fsdp import Fp8AllGatherWeight, local_tensor

    model, opt = _model_and_opt(world_size)
    ids, labels = batch(0, rank)
    model(input_ids=ids, labels=labels).loss.backward()
    opt.step()
    f8.precompute_scales(model)
    kept = [v for p in model.parameters() if isinstance(local_tensor(p), Fp8AllGatherWeight)
            for v in local_tensor(p)._scales.values()]
    return [(v[1].data_ptr() % 16, tuple(v[1].shape), v[2].dtype, tuple(v[2].shape)) for v in kept]


def _kept_across_steps(rank, world_size):
    """Four steps of a tensorwise model with the fp8 all-gather (the optimizer step precomputes);
    after steps 1-3, per weight: the identity of its kept entry, payload and scale memory, and of
    the all-gather inputs and metadata its hook hands FSDP2, whether the entry is current, and
    whether the payload is the shard in the param dtype cast with the kept scale, bitwise. Then
    ``param.data = ...`` on one weight and a fifth step."""
    from fp8func._ops import quantize_with_scale
    from fp8func.distributed._fsdp import Fp8AllGatherWeight, local_tensor

    model, opt = _model_and_opt(world_size, layers=2)
    weights = [local_tensor(p) for p in model.parameters() if isinstance(local_tensor(p), Fp8AllGatherWeight)]

    def state():
        out = []
        for w in weights:
            [(name, entry)] = w._scales.items()
            fresh = quantize_with_scale(w.hp_values().to(w._param_dtype), entry[1], w._plan.output.b)
            gathers = tuple(id(g.out) for g in w._gathers_kept.values())
            out.append((id(entry), entry[1].data_ptr(), entry[2].data_ptr(), gathers, w._payloads_kept(),
                        torch.equal(entry[2].view(torch.uint8), fresh.data.view(torch.uint8))))
        return out

    states = []
    for step in range(5):
        if step == 4:
            with torch.no_grad():
                weights[3].data = weights[3].hp_values() * 0.5  # new values: new kept buffers
        ids, labels = batch(step, rank)
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        if step:
            states.append(state())
    return states, len(weights)


@pytest.mark.slow
def test_precompute_casts_into_the_same_memory_at_every_step():
    """The optimizer step's precompute writes each tensorwise weight's cast into buffers it keeps:
    the same entry, payload and scale memory, and the same all-gather inputs and metadata handed
    to FSDP2, step after step (no per-weight objects a step for the garbage collector to
    promote), each payload bitwise the current shard's cast and current; a weight given new data
    (``param.data = ...``) drops them, and its mesh's weights are cast into new ones, as current."""
    for states, n in run_workers(_kept_across_steps, 2):
        assert n == 15  # 2 decoder layers x 7, and lm_head
        for step in states:
            assert all(current and bitwise for *_, current, bitwise in step), step
        first, second, third, fifth = states
        assert first == second == third
        assert all(len(gathers) >= 1 for _, _, _, gathers, _, _ in first)
        assert fifth[3][:3] != first[3][:3]


def _counted_steps(model, opt, rank, steps, counts) -> list[float]:
    """``steps`` training steps of ``model``; before each, ``counts`` gets a new entry 0 for the
    caller's counter to raise. Returns the losses."""
    losses = []
    for step in range(steps):
        counts.append(0)
        ids, labels = batch(step, rank)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _model_and_opt(world_size, recipe="tensorwise", layers=1, lr=1e-3, fsdp_fp8_all_gather=True, reshard=None):
    """A tiny Qwen3 converted to ``recipe``, each layer and the root under FSDP2 (fp32 masters,
    bf16 all-gathers; ``reshard``: reshard_after_forward, FSDP2's default where None), and its AdamW."""
    kw = {} if reshard is None else {"reshard_after_forward": reshard}
    mesh = init_device_mesh("cpu", (world_size,))
    model = f8.convert(tiny_qwen3(layers=layers), recipe, fsdp_fp8_all_gather=fsdp_fp8_all_gather)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, **kw)
    fully_shard(model, mesh=mesh, mp_policy=mp, **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


@pytest.mark.slow
def test_precomputed_scales_are_aligned_and_keep_the_fp8_shard():
    """Every precomputed scale starts on a 16-byte boundary (cuBLASLt rejects a scale pointer
    that does not: CUBLAS_STATUS_NOT_SUPPORTED), and its fp8 shard is kept for the all-gathers."""
    [kept] = run_workers(_kept_after_precompute, 1)
    assert len(kept) == 8, kept  # 7 layer weights and lm_head
    for misalign, scale_shape, dtype, shape in kept:
        assert misalign == 0 and scale_shape == (1, 1) and dtype == f8.E4M3 and len(shape) == 2, kept


def test_cast_kept_groups_are_bitwise_each_weights_cast(monkeypatch):
    """precompute_scales' casts, one kernel launch per kind of shard (``kernels.cast_many``; its
    twin on the CPU): bitwise ``cast_with_scale`` per weight, for fp32 masters rounded to bf16,
    bf16 shards, fp32 kept in fp32, E4M3 and E5M2 weights."""
    import fp8func.distributed._precompute as precompute_mod
    from fp8func.distributed import Fp8AllGatherWeight

    monkeypatch.setattr(precompute_mod, "use_kernels", lambda t, spec: True)  # the grouped path, on the CPU
    g = torch.Generator().manual_seed(0)
    e5m2 = f8.Recipe(weight=f8.CastSpec(f8.E5M2), name="e5m2 weights")
    kinds = [(torch.float32, torch.bfloat16, "tensorwise"), (torch.bfloat16, torch.bfloat16, "tensorwise"),
             (torch.float32, torch.float32, "tensorwise"), (torch.float32, torch.bfloat16, e5m2)]
    weights = []
    for i, (dtype, param_dtype, recipe) in enumerate(kinds * 2):
        recipe = f8.Recipe.from_name(recipe) if isinstance(recipe, str) else recipe
        w = Fp8AllGatherWeight((torch.randn(16 + i, 32, generator=g) * 10).to(dtype), recipe)
        w._param_dtype = param_dtype
        weights.append(w)
    scales = torch.rand(len(weights), 4, generator=g) * 0.1 + 1e-3
    precompute_mod._cast_kept(weights, scales)
    for i, w in enumerate(weights):
        version, scale, data = w._scales["w"]
        want = precompute_mod.cast_with_scale(w._tensor, scales[i:i + 1, :1], w._plan.output.b, round_to=w._param_dtype)
        assert version == w.weight_version() and torch.equal(scale, scales[i:i + 1, :1])
        assert data.dtype == w._plan.output.b.dtype and torch.equal(data.view(torch.uint8), want.data.view(torch.uint8))


def _rowwise_shards(device) -> list[tuple[torch.Tensor, torch.dtype]]:
    """Row-wise weight shards and their param dtypes: fp32 masters rounded to bf16 (random, bf16
    rounding ties, NaN, -inf, a zero row, subnormals, above bf16's max, empty), bf16 and fp32
    shards cast as they are, and an fp32 master under an fp16 param dtype."""
    g = torch.Generator().manual_seed(0)
    ties = torch.randn(32, 64, generator=g).bfloat16().float()
    ties.view(-1)[::3] *= 1 + 2.0 ** -8  # exactly between two bf16 values: rounds to even
    specials = torch.randn(16, 64, generator=g) * 100
    specials[3, 5], specials[7, 9], specials[10] = float("nan"), -float("inf"), 0.0
    specials[:, 11], specials[12, 0] = 1e-40, 3.4e38
    shards = [(torch.randn(48, 64, generator=g) * 3, torch.bfloat16), (ties, torch.bfloat16),
              (specials, torch.bfloat16), (torch.empty(0, 64), torch.bfloat16),
              (torch.randn(16, 32, generator=g).bfloat16(), torch.bfloat16),
              (torch.randn(16, 32, generator=g) * 1e-3, torch.float32),
              (torch.randn(16, 32, generator=g), torch.float16)]
    return [(t.to(device), d) for t, d in shards]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_weight_read_in_the_backward_is_its_column_major_copy(device):
    """``fp8func::read_in_backward`` (a row-wise ``w_t`` gathered for the backward) returns the
    weight's bits column-major, as ``t.t().contiguous().t()`` would (on CUDA through the tiled
    ``kernels.transpose``), a fresh tensor for contiguous and strided inputs alike."""
    from fp8func.distributed._dtensor import _read_in_backward

    bits = torch.randint(0, 256, (48, 80), dtype=torch.uint8, device=device)
    for t in (bits.view(f8.E4M3), bits.view(f8.E5M2)[:, :40], bits.view(torch.bfloat16)):
        got = _read_in_backward(t, torch.ones((), device=device))
        want = t.t().contiguous().t()
        assert got.shape == t.shape and got.stride() == (1, t.shape[0]), (t.shape, got.stride())
        assert got.data_ptr() != t.data_ptr()
        assert torch.equal(got.view(torch.uint8) if got.element_size() == 1 else got.view(torch.int16),
                           want.view(torch.uint8) if want.element_size() == 1 else want.view(torch.int16))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_rowwise_casts_from_one_read_are_bitwise_the_hooks_casts(device, monkeypatch):
    """precompute_scales' row-wise casts from two reads of the shard in all (the row and column
    amaxes from one, both casts from the other: ``kernels.amax_rows_cols`` and
    ``kernels.cast_rows_cols``; on the CPU their PyTorch twins, routed as on CUDA) are the casts
    the hook makes itself one at a time (``_keep_casts``, their slow twin): scales and payloads
    bitwise, but for a NaN scale and its group, NaN in both (the NaN's bits are those of the
    reduction that made it, which differ between PyTorch's row and column amaxes on the CPU).
    An fp16 param dtype (which the kernel does not round to) takes the slow path."""
    import fp8func.distributed._precompute as precompute_mod
    import fp8func.kernels as fk
    from fp8func.distributed import Fp8AllGatherWeight

    def weights():
        out = []
        for t, param_dtype in _rowwise_shards(device):
            w = Fp8AllGatherWeight(t.clone(), "rowwise")
            w._param_dtype, w._sharding_kept = param_dtype, (None, None, ())  # as after an all-gather, one rank
            out.append(w)
        return out

    slow, fast = weights(), weights()
    for w in slow:
        w._keep_casts()
    calls, orig = [], fk.cast_rows_cols
    monkeypatch.setattr(fk, "cast_rows_cols", lambda *a, **k: calls.append(a[0].shape) or orig(*a, **k))
    if device == "cpu":
        monkeypatch.setattr(precompute_mod, "use_kernels", lambda t, spec: True)
    assert precompute_mod._precompute_casts(fast) == len(fast)
    assert len(calls) == len(fast) - 1  # all but the fp16 one
    for i, (a, b) in enumerate(zip(fast, slow)):
        assert a._payloads_kept() and sorted(a._scales) == sorted(b._scales) == ["w", "w_t"], i
        for name in ("w", "w_t"):
            (_, sa, da), (_, sb, db) = a._scales[name], b._scales[name]
            assert sa.shape == sb.shape and da.shape == db.shape and da.dtype == db.dtype, (i, name)
            nan = sa.isnan()
            assert torch.equal(nan, sb.isnan()) and bool(nan.any()) == (i == 2), (i, name)
            assert torch.equal(sa.view(torch.int32)[~nan], sb.view(torch.int32)[~nan]), (i, name)
            nan = nan.expand_as(da)  # a NaN scale's group: NaN in both (the sign comes from the scale's bits)
            assert torch.equal(da.view(torch.uint8)[~nan], db.view(torch.uint8)[~nan]), (i, name)
            assert da.float()[nan].isnan().all() and db.float()[nan].isnan().all(), (i, name)


def _gathered_rebuilds(rank, world_size):
    """Three steps with the fp8 all-gather on: how many gathered weights each step rebuilt after
    its all-gathers, the FSDP2 hook signature, the losses, and those of the same steps off."""
    import inspect

    from fp8func._gathered import Fp8GatheredWeight

    out = {}
    for on in (True, False):
        model, opt = _model_and_opt(world_size, lr=1e-2, fsdp_fp8_all_gather=on)
        rebuilds, orig = [], Fp8GatheredWeight.set_casts
        Fp8GatheredWeight.set_casts = lambda self, *a: rebuilds.__setitem__(-1, rebuilds[-1] + 1) or orig(self, *a)
        try:
            losses = _counted_steps(model, opt, rank, 3, rebuilds)
        finally:
            Fp8GatheredWeight.set_casts = orig
        out["on" if on else "off"] = losses
        if on:
            out["rebuilds"] = rebuilds
            weight = model.model.layers[0].mlp.up_proj.weight.to_local()
            out["signature"] = list(inspect.signature(weight.fsdp_pre_all_gather).parameters)
    return out


@pytest.mark.slow
def test_gathered_weights_are_rebuilt_only_when_their_bytes_or_scales_change():
    """FSDP2 refills a weight's all-gather buffers in place: after the first step the gathered
    weight's casts (views of those buffers) stay valid, and fsdp_post_all_gather rebuilds them
    only for new metadata: once, at the first all-gather from the optimizer step's precompute,
    whose scales are then updated in place (tensorwise: ``_KeptCasts``), never again, neither for
    the backward's all-gather of the same bytes nor at later steps. The numbers are bitwise the
    fp8 all-gather off; FSDP2 reads the hook's signature (its calling convention)."""
    for r in run_workers(_gathered_rebuilds, 2):
        assert r["on"] == r["off"], (r["on"], r["off"])
        # step 1: each of the 8 weights rebuilt once, at the forward's gather of the kept casts;
        # step 2: none
        assert r["rebuilds"][1:] == [8, 0], r["rebuilds"]
        assert r["signature"] == ["mesh", "outer_size", "outer_stride", "module", "mp_policy"], r["signature"]


# --------------------------------------------------------------------------------------------
# GPU (the `gpu` mark: skipped with the reason where no FP8-capable CUDA GPU is visible).


@pytest.mark.gpu
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_precompute_amaxes_on_gpu_are_bitwise_the_hooks(param_dtype):
    """The multi-tensor amax of precompute_scales on CUDA (NaN, inf, ties, subnormals, empty):
    bitwise the amax of each shard cast to the param dtype."""
    from fp8func.distributed._precompute import shard_amaxes, shard_amaxes_reference

    shards = _special_shards("cuda")
    dtypes = [param_dtype] * len(shards)
    fast, slow = shard_amaxes(shards, dtypes), shard_amaxes_reference(shards, dtypes)
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32)), (fast, slow)
