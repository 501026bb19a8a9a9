"""The FSDP2 hook protocol of the fp8 weight types, in one process: how FSDP2 reads the
pre-all-gather hook (bound to the very weight it is read from, with the signature FSDP2 checks),
and when the post-all-gather hook may reuse the casts of the gathered weight it refills."""

import copy
import gc
import inspect
import pickle
import weakref

import pytest
import torch

import fp8func as f8
from fp8func._casts import weight_casts
from fp8func._gathered import Fp8GatheredWeight
from fp8func._ops import quantize
from fp8func.distributed import Fp8AllGatherWeight
from fp8func.distributed._fsdp import add_all_gather_input, finish_all_gather_inputs, gather_metadata

FSDP2_ARGS = ["mesh", "outer_size", "outer_stride", "module", "mp_policy"]  # what FSDP2 passes (5 parameters)


def _weight(fp8_weights: bool = False):
    layer = f8.convert(torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False)), "tensorwise",
                       fp8_weights=fp8_weights)[0]
    return layer, layer.weight


def _bound_to(w) -> bool:
    hook = w.fsdp_pre_all_gather
    return list(inspect.signature(hook).parameters) == FSDP2_ARGS and hook.args == (w,)


@pytest.mark.parametrize("fp8_weights", [False, True], ids=["fp8_all_gather", "fp8_weights"])
def test_the_pre_all_gather_hook_binds_to_the_weight_it_is_read_from(fp8_weights):
    """FSDP2 reads ``fsdp_pre_all_gather`` four times per all-gather; each read binds the hook to
    that very weight, with the signature FSDP2 checks, and stores nothing on it (no reference
    cycle), so copies, ``swap_tensors``, ``param.data = ...`` and pickles never call a stale one."""
    layer, w = _weight(fp8_weights)
    assert _bound_to(w) and "fsdp_pre_all_gather" not in w.__dict__
    twin = copy.deepcopy(w)
    assert _bound_to(twin) and twin.fsdp_pre_all_gather.args[0] is not w
    if not fp8_weights:
        with torch.no_grad():
            w.data = torch.randn(32, 64)
        assert _bound_to(w)
        a, b = Fp8AllGatherWeight(torch.randn(32, 64), "tensorwise"), Fp8AllGatherWeight(torch.randn(16, 64), "rowwise")
        values = b._tensor
        torch.utils.swap_tensors(a, b)
        assert a._tensor is values and _bound_to(a) and _bound_to(b)
    restored = pickle.loads(pickle.dumps(layer))  # unpickled, the layer wraps its weight again
    assert type(restored.weight) is type(w) and _bound_to(restored.weight)
    gc.disable()
    try:
        fresh = copy.deepcopy(twin)  # held by no module
        assert _bound_to(fresh)
        ref = weakref.ref(fresh)
        del fresh
        assert ref() is None  # freed by its reference count: the hook left no cycle behind
    finally:
        gc.enable()


class _TwoRanks:
    """What add_all_gather_input reads of FSDP2's mesh."""

    @staticmethod
    def size():
        return 2


def _metadata(shard, spec, scale=None):
    q = quantize(shard, spec)
    if scale is not None:
        q = type(q)(q.data, scale, q.meta)
    inputs, entries = [], []
    add_all_gather_input(inputs, entries, "w", q, ("w",), [16, 16], _TwoRanks(), torch.bfloat16)
    return inputs, gather_metadata(finish_all_gather_inputs(inputs, entries), ("w",), 32)


def _flattened(casts, valid=None):
    return Fp8GatheredWeight(casts, (32, 64), torch.bfloat16, valid).__tensor_flatten__()


def _reads(view, buffer) -> bool:
    return view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_the_post_all_gather_hook_reuses_its_casts_only_for_the_same_buffers_and_scales():
    """FSDP2 refills the same buffers and hands the hook new views of them at every all-gather:
    the gathered weight keeps its casts (views of those buffers) for the very same metadata, or
    an equal one holding the very same scale tensor; a new scale tensor (even of equal value) or
    another buffer rebuilds them, and ``__tensor_flatten__`` then answers for the new casts."""
    _, w = _weight()
    spec = dict(weight_casts(w.plan))["w"]
    shard = w.hp_values()[:16].to(torch.bfloat16)
    inputs, meta = _metadata(shard, spec)
    buffer = torch.cat([inputs[0], inputs[0]]).view(-1)  # both ranks' bytes, as FSDP2 gathers them

    def outputs(buf=buffer):
        return (buf.view(-1, 64),)  # a new view of the buffer, as FSDP2 passes it

    gathered, _ = w.fsdp_post_all_gather(outputs(), meta, torch.bfloat16)
    assert isinstance(gathered, Fp8GatheredWeight)
    q = gathered.casts["w"]
    assert _reads(q.data, buffer) and q.scale is meta.entries[0][2]
    gathered.__tensor_flatten__()[0].append("changed")  # the caller's own list
    assert gathered.__tensor_flatten__() == _flattened(gathered.casts)

    def refill(metadata, outs=None):
        before = gathered.casts
        assert w.fsdp_post_all_gather(outs or outputs(), metadata, torch.bfloat16, out=gathered) is None
        return gathered.casts is not before

    assert not refill(meta)  # the very same metadata
    assert not refill(gather_metadata(meta.entries, ("w",), 32))  # equal, the same scale tensor
    new_scale = meta.entries[0][2].clone()
    _, meta2 = _metadata(shard, spec, new_scale)
    assert refill(meta2) and gathered.casts["w"].scale is new_scale
    assert gathered.casts["w"].data is q.data  # the view of the same buffer, made once
    other = buffer.clone()
    assert refill(meta2, outputs(other)) and _reads(gathered.casts["w"].data, other)
    assert torch.equal(gathered.casts["w"].data.view(torch.uint8), q.data.view(torch.uint8))
    assert gathered.__tensor_flatten__() == _flattened(gathered.casts)
    gathered.set_casts({"w": q, "w_t": q}, ("w_t",))  # other casts: flattened anew
    assert gathered.__tensor_flatten__() == _flattened(gathered.casts, ("w_t",))
