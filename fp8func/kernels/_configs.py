"""Launch configurations of the Triton kernels: one frozen ``Config`` per route.

A route is one way an entry point launches its kernels (``"cast_t"``: a cast that also writes
the transposed copy). ``CONFIGS`` holds the configuration each route runs, the winners of the
launch-config sweep (``python -m fp8func.bench sweep``, GPU only; docs/kernels.md). The
sweep and the layout tests run other configurations through ``override``, which checks them
first. Plain Python: importing this module imports no Triton.

Example:
    >>> from fp8func.kernels._configs import CONFIGS, Config, config, override
    >>> with override("cast_t", Config(bm=64, bk=128, warps=4, raw_t=True)):
    ...     config("cast_t").raw_t
    True
    >>> config("cast_t") == CONFIGS["cast_t"]
    True
"""

from __future__ import annotations

import contextlib
import logging
import os
import types
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["CONFIGS", "Config", "check", "config", "override", "static_launches"]


@dataclass(frozen=True)
class Config:
    """Launch parameters of one route.

    Attributes:
        bm: tile rows. The one-pass row-wise route: elements per program (whole rows, a power
            of two); the +T block routes: 128, the block.
        bk: tile columns. The flat amax: elements per program and loop step; the one-pass
            row-wise route: 0 (the row padded to a power of two); the +T block routes: the
            width of the slabs the 128x128 tile is walked in.
        warps: ``num_warps``.
        stages: ``num_stages``.
        unroll: the +T block routes only: 0 unrolls the slab walks (``tl.static_range``), else
            they are ``tl.range`` loops unrolled ``unroll`` times.
        raw_t: the transposing routes only: the transposed copy is cast from the loaded tile
            transposed in the input dtype and upcast afterwards (bf16 crosses shared memory in 2
            bytes, not 4; the upcast is exact, so the bits are the same), instead of from the
            transposed fp32 tile.
    """

    bm: int
    bk: int
    warps: int
    stages: int = 1
    unroll: int = 0
    raw_t: bool = False


CONFIGS: types.MappingProxyType[str, Config] = types.MappingProxyType({
    "amax_flat": Config(bm=1, bk=16384, warps=16),
    "amax_2d": Config(bm=8, bk=1024, warps=4),
    "cast": Config(bm=8, bk=1024, warps=8),
    "cast_t": Config(bm=64, bk=256, warps=8),
    "cast_amax": Config(bm=32, bk=256, warps=8),
    "cast_amax_t": Config(bm=64, bk=128, warps=4, raw_t=True),
    "cast_block": Config(bm=16, bk=128, warps=4),
    "cast_block_t": Config(bm=64, bk=64, warps=4, raw_t=True),
    "rowwise": Config(bm=4096, bk=0, warps=4),
    "block_1x128": Config(bm=16, bk=128, warps=4),
    "block_1x128_t": Config(bm=128, bk=64, warps=2, unroll=1),
    "block_128": Config(bm=128, bk=128, warps=16),
    "block_128_t": Config(bm=128, bk=64, warps=4),
})
_TRANSPOSING = ("cast_t", "cast_amax_t", "cast_block_t", "block_1x128_t", "block_128_t")
_SLAB_WALKS = ("block_1x128_t", "block_128_t")
_OVERRIDES: dict[str, Config] = {}


def _pow2(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def _fixed(route: str, cfg: Config) -> str | None:
    """What a route's kernel fixes that ``cfg`` contradicts, or None."""
    if route == "amax_flat" and cfg.bm != 1:
        return "bm=1 (the flat amax walks one row of bk elements)"
    if route == "rowwise" and cfg.bk != 0:
        return "bk=0 (the row is padded to a power of two at launch)"
    if route == "cast_block" and 128 % cfg.bk:
        return "bk dividing 128 (a tile inside one group along K)"
    if route == "cast_block_t" and (128 % cfg.bk or 128 % cfg.bm):
        return "bm and bk dividing 128 (a tile inside one group of x and of x.T)"
    if route == "block_1x128" and cfg.bk != 128:
        return "bk=128 (each tile row is one 1x128 group)"
    if route == "block_128" and (cfg.bm, cfg.bk) != (128, 128):
        return "bm=bk=128 (the tile is the group)"
    if route in _SLAB_WALKS and (cfg.bm != 128 or 128 % cfg.bk):
        return "bm=128 and bk dividing 128 (the 128x128 tile walked in [128, bk] slabs)"
    return None


def check(route: str, cfg: Config) -> None:
    """Raise ``ValueError`` unless ``cfg`` is a configuration ``route``'s kernels can run."""
    if route not in CONFIGS:
        raise ValueError(f"route {route!r}: expected one of {list(CONFIGS)}.")
    if not isinstance(cfg, Config):
        raise TypeError(f"{route}: {cfg!r} is not a Config.")
    sizes = (cfg.bm, cfg.bk) if route != "rowwise" else (cfg.bm,)
    if not all(_pow2(n) for n in (*sizes, cfg.warps)) or cfg.stages < 1 or cfg.unroll < 0:
        raise ValueError(f"{route}: {cfg}: tile sizes and warps must be powers of two (Triton's aranges), "
                         "stages at least 1 and unroll at least 0.")
    if cfg.unroll and route not in _SLAB_WALKS:
        raise ValueError(f"{route}: {cfg}: unroll applies to the slab walks of {_SLAB_WALKS} only; leave it 0.")
    if cfg.raw_t and route not in _TRANSPOSING:
        raise ValueError(f"{route}: {cfg}: raw_t applies to the transposing routes {_TRANSPOSING} only.")
    need = _fixed(route, cfg)
    if need:
        raise ValueError(f"{route}: {cfg}: this route needs {need}.")


def config(route: str) -> Config:
    """The configuration ``route`` runs now: its override if one is active, else ``CONFIGS[route]``."""
    return _OVERRIDES.get(route, CONFIGS[route])


@contextlib.contextmanager
def override(route: str, cfg: Config) -> Iterator[Config]:
    """Run ``route`` with ``cfg`` inside the block (checked first); the previous one after it.

    Only calls launched inside the block see ``cfg``: a ``torch.compile``d graph keeps the
    configuration it was traced with.
    """
    check(route, cfg)
    missing = object()
    prev = _OVERRIDES.get(route, missing)
    _OVERRIDES[route] = cfg
    try:
        yield cfg
    finally:
        if prev is missing:
            del _OVERRIDES[route]
        else:
            _OVERRIDES[route] = prev


_STATIC = "static_launch_user_defined_triton_kernels"
_STATIC_ENV = "TORCHINDUCTOR_" + _STATIC.upper()
_env_written = [False]  # whether os.environ[_STATIC_ENV] holds what static_launches wrote


def static_launches() -> bool:
    """Lets ``torch.compile`` launch these kernels as it launches its own generated ones: through
    inductor's static CUDA launcher, a C call, instead of Triton's launcher, whose Python (launch
    metadata, hooks, allocator) costs the host more per launch. Sets
    ``torch._inductor.config.static_launch_user_defined_triton_kernels`` (off by default in torch)
    unless it was set already, in code or by its environment variable
    ``TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS``: that choice stands.

    Inductor compiles the kernels in worker processes (``compile_threads`` > 1, its default on a
    machine of several cores), which take this setting from their environment, not from this
    process; so the setting in force is also written to that environment variable (unless the
    user set it), and the workers torch starts afterwards (at the first compiled graph) compile
    the kernels for the static launcher too. Called when ``fp8func.kernels`` is imported where
    Triton is installed, and again where the Triton backend is first imported. Inductor checks
    each kernel and launches any that the static launcher cannot take through Triton's launcher
    ("Bypassing StaticallyLaunchedCudaKernel", INFO), so the setting changes host time only: the
    same binaries run. Logged at INFO (``fp8func.kernels``) when it sets the configuration.
    Returns the setting in force.
    """
    from torch._inductor import config as inductor_config

    if not hasattr(inductor_config, _STATIC):
        return False
    users_env = _STATIC_ENV in os.environ and not _env_written[0]
    is_default = getattr(inductor_config, "_is_default", None)
    if not users_env and is_default is not None and is_default(_STATIC):
        setattr(inductor_config, _STATIC, True)
        logging.getLogger("fp8func.kernels").info(
            "fp8func.kernels: set torch._inductor.config.%s = True and %s=1 for inductor's compile workers "
            "(inductor's static launcher for the Triton kernels; set %s yourself to choose)",
            _STATIC, _STATIC_ENV, _STATIC_ENV)
    on = bool(getattr(inductor_config, _STATIC))
    if not users_env:
        os.environ[_STATIC_ENV] = "1" if on else "0"
        _env_written[0] = True
    return on
