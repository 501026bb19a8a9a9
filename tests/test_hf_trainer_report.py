"""The FSDP2 report's own ``Trainer`` script with fp8func's one line (examples/hf_trainer_report.py),
CPU/gloo, 2 processes, a tiny Qwen3: the combinations a user meets, each trained with the fp8
all-gather on and then off, with finite losses and bitwise the same losses, gradient norms and
trained weights (the example raises otherwise).

The report's setup: the model built in bf16, ``torch.compile(model)`` before the ``Trainer``, the
report's ``fsdp_config`` with ``fsdp_cpu_ram_efficient_loading`` and ``fsdp_sync_module_states``
(accelerate upcasts the parameters with ``param.data = ...``, moves the model to ``meta``, shards it
there and loads rank 0's values with ``load_state_dict(assign=True)``). The other rows vary one
thing each: the loading keys, the model dtype, how it is compiled, the callback, the recipe."""

import math

import pytest

from .dist_harness import run_workers
from .examples import load_example

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install -e '.[dev]')")

STEPS = 4


def _example():
    return load_example("hf_trainer_report")


def _run(rank, world_size, argv):
    return _example().worker(rank, world_size, argv)


def _check(results, recipe="tensorwise", repeat=1):
    for rank_results in results:
        on, off = rank_results["on"], rank_results["off"]
        assert len(on["repeats"]) == len(off["repeats"]) == repeat
        assert len(on["loss"]) == STEPS and all(map(math.isfinite, on["loss"])), on["loss"]
        assert on["loss"] == off["loss"] and on["grad_norm"] == off["grad_norm"]
        assert on["param_checksum"] == off["param_checksum"] and on["bitwise_off"]
        assert off["fp8_gathers"] == 0
        # delayed scaling casts the gathered weight itself: FSDP2 gathers it in bf16 either way
        assert (on["fp8_gathers"] > 0) == (recipe != "delayed"), on["fp8_gathers"]
    assert results[0]["on"]["loss"] == results[1]["on"]["loss"]  # every rank logs the same mean loss


def _argv(*extra):
    return ["--device", "cpu", "--steps", str(STEPS), "--warmup", "1", "--fp8-all-gather", "both", *extra]


EAGER = [  # (label, flags): the report's bf16 model and loading keys, eager, and one change each
    ("report-eager", ()),
    ("no-loading-keys", ("--no-loading-keys",)),
    ("fp32-model", ("--model-dtype", "fp32")),
    ("callback", ("--callback",)),
    ("rowwise", ("--recipe", "rowwise")),
    ("delayed", ("--recipe", "delayed")),
    ("delayed-callback-no-loading-keys", ("--recipe", "delayed", "--callback", "--no-loading-keys")),
]


@pytest.mark.slow
@pytest.mark.parametrize("flags", [f for _, f in EAGER], ids=[label for label, _ in EAGER])
def test_report_script_eager(flags):
    recipe = flags[flags.index("--recipe") + 1] if "--recipe" in flags else "tensorwise"
    _check(run_workers(_run, 2, _argv("--compile", "none", *flags)), recipe)


COMPILED = [  # compiled as the report does (torch.compile(model)), and through TrainingArguments
    # --repeat 2: on, off, off, on in one process; the second model trains bitwise as the first
    # (the example raises otherwise): nothing of the first run's compiled code, hooks or kept
    # casts carries over.
    ("report", ("--compile", "model", "--repeat", "2")),
    ("report-no-loading-keys", ("--compile", "model", "--no-loading-keys")),
    ("trainer-compile", ("--compile", "trainer")),
]


@pytest.mark.slow
@pytest.mark.parametrize("flags", [f for _, f in COMPILED], ids=[label for label, _ in COMPILED])
def test_report_script_compiled(flags):
    repeat = int(flags[flags.index("--repeat") + 1]) if "--repeat" in flags else 1
    _check(run_workers(_run, 2, _argv(*flags)), repeat=repeat)


def test_phases_summary_per_part_of_a_step():
    """``--phases``' arithmetic on made-up marks (host ms, GPU ms since the step's start): per part
    the host's and the GPU's time between its marks and the GPU's further lag at its end, medians
    over the steps after warm-up; a step missing a mark is left out."""
    phases = _example()._Phases()
    times = {"step": (0, 0), "forward": (1, 0.5), "loss": (20, 15), "backward": (50, 40),
             "optimizer": (80, 80), "optimized": (90, 85), "end": (91, 95)}

    class Marks:
        def __init__(self):
            self.names = []

        def add(self, name):
            self.names.append(name)

        def read(self):
            return [(n, *times[n]) for n in self.names]

    phases._new = Marks
    for complete in (True, True, True, False):
        phases.on_step_begin(None, None, None)
        for name in ("forward", "loss", "backward"):
            phases.add(name)
        phases.on_pre_optimizer_step(None, None, None)
        phases.on_optimizer_step(None, None, None)
        if complete:
            phases.on_step_end(None, None, None)
    out = phases.summary(warmup=1)
    assert list(out) == list(phases.PARTS)
    assert out["forward"] == {"host_ms": 19, "gpu_ms": 14.5, "lag_ms": -5}
    assert out["read-back + clip"] == {"host_ms": 30, "gpu_ms": 40, "lag_ms": 0}
    assert out["rest"] == {"host_ms": 1, "gpu_ms": 10, "lag_ms": 4}
    assert phases.summary(warmup=3) == {}  # only the incomplete step is left


def test_repeat_runs_each_pair_in_both_orders():
    """``--repeat`` with ``both``: on, off, off, on, on, off, ... (neither mode always first in its
    pair); one mode: that mode only. The pair ratio is on's pace over off's (above 1: on faster)."""
    ex = _example()
    order = [on for i in range(4) for on in ex.run_order("both", i)]
    assert order == [True, False, False, True, True, False, False, True]
    assert [ex.run_order(m, i) for m in ("on", "off") for i in (0, 1)] == [(True,), (True,), (False,), (False,)]
    results = {"on": {"repeats": [{"step_ms": 200.0}, {"step_ms": 300.0}]},
               "off": {"repeats": [{"step_ms": 250.0}, {"step_ms": 150.0}]}}
    assert ex.pair_ratios(results) == [1.25, 0.5]


@pytest.mark.parametrize("argv, message", [(["--device", "cpu", "--phases"], "--phases reads CUDA events"),
                                           (["--device", "cpu", "--repeat", "0"], "--repeat 0 must be at least 1")])
def test_diagnostic_flags_refuse_what_cannot_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        _example().parse_args(argv)
    assert message in capsys.readouterr().err
