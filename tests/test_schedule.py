"""PrecisionSchedule: bf16 -> fp8 -> bf16 in one run, by step; eager, compiled, FSDP2."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fp8func as f8
from fp8func.nn._schedule import PrecisionSchedule

from .dist_harness import run_workers
from .models import batch, tiny_qwen3

PHASES = [(0, "bf16"), (2, "fp8"), (4, "bf16")]


def _train(model, steps, schedule=None, rank=0, compiled=False):
    fn = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        if schedule is not None:
            schedule.apply(model, step)
        ids, labels = batch(step, rank)
        loss = fn(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_schedule_switches_precisions_by_step():
    plain = _train(tiny_qwen3(layers=1), 6)
    fp8_all = _train(f8.convert(tiny_qwen3(layers=1), "rowwise"), 6)
    scheduled = _train(f8.convert(tiny_qwen3(layers=1), "rowwise"), 6, PrecisionSchedule(PHASES))
    assert scheduled[:2] == plain[:2]  # the bf16 warm-up is plain F.linear, bit for bit
    assert scheduled[2] != plain[2] and all(torch.isfinite(torch.tensor(scheduled)))
    assert scheduled[:2] != fp8_all[:2]


@pytest.mark.slow
def test_schedule_costs_one_graph_per_precision_under_compile():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model = f8.convert(tiny_qwen3(layers=1), "rowwise")
    losses = _train(model, 6, PrecisionSchedule(PHASES), compiled=True)
    assert all(torch.isfinite(torch.tensor(losses)))
    # a bf16 graph, one recompile for fp8, and the return to bf16 reuses the first graph
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def test_schedule_validates():
    with pytest.raises(ValueError, match="must start at step 0"):
        PrecisionSchedule([(5, "fp8")])
    with pytest.raises(ValueError, match="must increase strictly"):
        PrecisionSchedule([(0, "bf16"), (3, "fp8"), (3, "bf16")])
    with pytest.raises(ValueError, match="expected one of"):
        PrecisionSchedule([(0, "fp16")])
    with pytest.raises(ValueError, match="no Fp8Linear layers"):
        PrecisionSchedule([(0, "fp8")]).apply(torch.nn.Linear(4, 4), 0)


def _fsdp(rank, world_size, scheduled, fp8_gather):
    mesh = init_device_mesh("cpu", (world_size,))
    model = tiny_qwen3(layers=1)
    if scheduled:
        f8.convert(model, "rowwise", fsdp_fp8_all_gather=fp8_gather)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    try:
        return _train(model, 6, PrecisionSchedule(PHASES) if scheduled else None, rank)
    except ValueError as e:
        return str(e)


@pytest.mark.slow
def test_schedule_under_fsdp2():
    plain = run_workers(_fsdp, 2, False, False)
    sched = run_workers(_fsdp, 2, True, False)
    for p, s in zip(plain, sched):
        assert s[:2] == p[:2] and s[2] != p[2], (s[:3], p[:3])
    refused = run_workers(_fsdp, 2, True, True)[0]
    assert "all-gather their weights in FP8 under FSDP2" in refused, refused
