"""A pytest-friendly multi-process harness: gloo on CPU, one process per rank.

``run_workers(fn, world_size, *args)`` spawns ``world_size`` processes, initialises a gloo process
group in each (file rendezvous: no ports), calls ``fn(rank, world_size, *args)`` and returns the
per-rank results. A failure in any rank raises in the test with that rank's traceback.
"""

import faulthandler
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, fn, world_size, workdir, args):
    # A rank killed by a signal (SIGABRT from the C library's heap checks, SIGSEGV) prints the Python
    # stack of each of its threads into the test's captured output.
    faulthandler.enable(all_threads=True)
    torch.set_num_threads(1)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world_size)
    trace = os.environ.get("FP8FUNC_HARNESS_TRACE")
    try:
        out = fn(rank, world_size, *args)
        if trace:
            print(f"[harness] rank {rank}: fn returned", flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if trace:
        print(f"[harness] rank {rank}: process group destroyed", flush=True)
    torch.save(out, os.path.join(workdir, f"rank{rank}.pt"))
    if trace:
        print(f"[harness] rank {rank}: saved", flush=True)
    # The rank's work is done, checked and saved. Leave without interpreter teardown: a background
    # thread of torch's collectives can still be joinable then, and its destructor aborts the
    # process ("terminate called without an active exception"), intermittently on gloo after
    # sequence-parallel runs, with every result already saved.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


SPAWN_ALLOWED = True  # tests/conftest.py sets it per test: False unless the test is marked slow


def run_workers(fn, world_size, *args):
    if not SPAWN_ALLOWED:
        raise RuntimeError("run_workers spawns processes, which the quick tier (python -m pytest) does not: mark "
                           "the test @pytest.mark.slow (python -m pytest -m slow runs it).")
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_entry, args=(fn, world_size, workdir, args), nprocs=world_size, join=True)
        return [torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
