"""``gemm``: FP8 matrix product on the hardware path where one exists, emulated elsewhere.

Hardware paths (``torch._scaled_mm`` / ``torch.nn.functional.scaled_mm``):

* ``tensorwise``  a, b TensorWise (CUDA sm89+, and the CPU build)
* ``rowwise``     a one scale per row, b one per column, both reduced along K; a TensorWise
                  operand, or one whose scale groups span K in blocks of rows (columns), is
                  broadcast to that form (CUDA sm89+, and the CPU build)
* ``blockwise``   a BlockWise((1, 128)), b BlockWise((128, 128)) or BlockWise((128, 1))
                  (CUDA sm90, torch with F.scaled_mm)

Operands whose scales are constant over chunks of the contraction (each chunk spanning the other
dim whole, as in the grad_weight GEMM of an operand gathered with one scale per rank's chunk of
tokens) run one GEMM per chunk, in fp32, summed in chunk order and rounded to ``out_dtype`` once
(``contraction_chunk``); each chunk's GEMM takes the path a tensorwise pair takes.

Everything else (MX on Hopper, odd shapes, e5m2 x e5m2, CPU by default) runs the emulated
path: dequantize to fp32 and matmul. Same answer up to accumulation order. ``gemm_path`` tells
which path a call takes; a fallback to emulation on a GPU is logged once per reason.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from ._formats import E4M3, E5M2, tracing
from ._log import warn_once
from ._ops import dequantize
from ._qtensor import Fp8Meta, Fp8Tensor
from ._scaling import MX, AxisWise, BlockWise, TensorWise, canonical_granularity, raw_block_lengths

__all__ = ["contraction_chunk", "gemm", "gemm_path", "hardware_kind"]


def hardware_kind(a: Fp8Tensor, b: Fp8Tensor) -> tuple[str | None, str]:
    """The scaled-mm kind that computes ``a @ b`` from these scales, or (None, why not)."""
    ga, gb = canonical_granularity(a.granularity), canonical_granularity(b.granularity)
    if a.dtype == E5M2 and b.dtype == E5M2:
        return None, "e5m2 x e5m2 has no FP8 tensor-core GEMM"
    k, n = a.shape[1], b.shape[1]
    if k % 16 or n % 16:
        return None, f"scaled_mm needs K and N divisible by 16, got K={k}, N={n}"
    tw = TensorWise()
    if ga == tw and gb == tw:
        return "tensorwise", ""
    if ga == BlockWise((1, 128)) and gb in (BlockWise((128, 128)), BlockWise((128, 1))):
        if a.dtype != E4M3 or b.dtype != E4M3:
            return None, "block-wise scaled_mm takes e4m3 operands only"
        return "blockwise", ""
    if _spans(a, 1) and _spans(b, 0):  # a scale per row of a and per column of b, broadcast
        return "rowwise", ""
    return None, f"no scaled_mm kernel for a={_describe(a.granularity)} x b={_describe(b.granularity)}"


def _spans(q: Fp8Tensor, dim: int) -> bool:
    """Whether every scale group of 2-D ``q`` spans dim ``dim`` whole (MX scales never do: they
    are e8m0 per block, for the MX kernels)."""
    if isinstance(q.granularity, MX):
        return False
    block = raw_block_lengths(q.granularity, tuple(q.shape))[dim]
    return block is None or block == q.shape[dim]


def contraction_chunk(a: Fp8Tensor, b: Fp8Tensor) -> int | None:
    """The chunk length ``c`` when ``a [M, K]`` and ``b [K, N]`` have one scale per chunk of ``c``
    along K (each scale spanning M, resp. N, whole) and some scale splits K: ``gemm`` then runs one
    tensorwise GEMM per chunk. None otherwise, and for chunks no FP8 GEMM takes (c % 16)."""
    if not (_spans(a, 0) and _spans(b, 1)) or _spans(a, 1) and _spans(b, 0):
        return None
    k = a.shape[1]
    ca = raw_block_lengths(a.granularity, tuple(a.shape))[1]
    cb = raw_block_lengths(b.granularity, tuple(b.shape))[0]
    chunk = math.gcd(ca or k, cb or k)
    return chunk if chunk % 16 == 0 and k % chunk == 0 else None


def _chunk(q: Fp8Tensor, dim: int, i: int, chunk: int) -> Fp8Tensor:
    """Chunk ``i`` (``chunk`` long along ``dim``) of ``q``: a view with its one scale, tensorwise."""
    block = raw_block_lengths(q.granularity, tuple(q.shape))[dim]
    group = 0 if block is None or block == q.shape[dim] else i * chunk // block
    meta = Fp8Meta(q.spec.with_granularity(TensorWise()), q.meta.orig_dtype, None)
    return Fp8Tensor(q.data.narrow(dim, i * chunk, chunk), q.scale.narrow(dim, group, 1), meta)


def _gemm_chunks(a: Fp8Tensor, b: Fp8Tensor, chunk: int, out_dtype: torch.dtype, path: str,
                 fast_accum: bool) -> torch.Tensor:
    """``a @ b`` as the sum, in fp32 and in chunk order, of one GEMM per chunk of the contraction
    (fp32 out), rounded to ``out_dtype`` once. A scale that changes along K cannot be applied by
    a row-wise kernel, which scales the accumulated sum; per chunk it is a tensorwise GEMM."""
    if gemm_path(a, b, path) == "scaled_mm_tensorwise":
        # One opaque op for all chunks: inductor lowers a scaled_mm of a chunk view with its scale
        # a 0-dim view into the gathered scales badly (a LoweringException on CUDA); the op runs
        # the eager code below, compiled or not.
        blocks = [raw_block_lengths(q.granularity, tuple(q.shape))[d] or q.shape[d] for q, d in ((a, 1), (b, 0))]
        run = _scaled_mm_chunks_op if tracing() else _scaled_mm_chunks
        return run(a.data, b.data, a.scale.reshape(-1), b.scale.reshape(-1), chunk, blocks[0], blocks[1],
                   out_dtype, fast_accum)
    total = None
    for i in range(a.shape[1] // chunk):
        y = gemm(_chunk(a, 1, i, chunk), _chunk(b, 0, i, chunk), torch.float32, path=path, fast_accum=fast_accum)
        total = y if total is None else total + y
    return total.to(out_dtype)


def _scaled_mm_chunks(da: torch.Tensor, db: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, chunk: int,
                      a_block: int, b_block: int, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """``_gemm_chunks`` on the tensorwise kernel: ``da [M, K] @ db [K, N]``, chunk ``i`` of K scaled
    by ``sa[i * chunk // a_block]`` and ``sb[i * chunk // b_block]``, each chunk's GEMM in fp32, summed
    in chunk order, rounded to ``out_dtype`` once (the per-chunk ``gemm`` of ``_chunk`` views, bitwise)."""
    # cuBLASLt takes a scale only at a 16-byte aligned address (else CUBLAS_STATUS_NOT_SUPPORTED):
    # one row of 4 per scale, so that each chunk's scale, a view of its row, is aligned.
    sa, sb = (s.reshape(-1, 1).expand(-1, 4).contiguous() for s in (sa, sb))
    total = None
    for i in range(da.shape[1] // chunk):
        part = slice(i * chunk, (i + 1) * chunk)
        y = torch._scaled_mm(_row_major(da[:, part]), col_major(db[part]), scale_a=sa[i * chunk // a_block, 0],
                             scale_b=sb[i * chunk // b_block, 0], out_dtype=torch.float32, use_fast_accum=fast_accum)
        total = y if total is None else total + y
    return total.to(out_dtype)


def _describe(g) -> str:
    """``repr(g)`` spelled out by hand: a dataclass ``__repr__`` calls ``_thread.get_ident``
    (reprlib.recursive_repr), which torch.compile cannot trace, and this string is built at
    trace time when a compiled call falls back to emulation."""
    if isinstance(g, TensorWise):
        return "TensorWise()"
    if isinstance(g, AxisWise):
        return f"AxisWise(axis={g.axis})"
    if isinstance(g, BlockWise):
        return "BlockWise(block=(" + ", ".join([str(b) for b in g.block]) + ("," if len(g.block) == 1 else "") + "))"
    if isinstance(g, MX):
        return f"MX(block={g.block}, axis={g.axis})"
    return type(g).__name__


def _device_supports(kind: str, device: torch.device) -> tuple[bool, str]:
    if device.type == "cpu":
        ok = kind in ("tensorwise", "rowwise")
        return ok, "" if ok else f"the CPU build has no {kind} scaled_mm"
    if device.type != "cuda":
        return False, f"no scaled_mm on device {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return False, f"FP8 GEMMs need compute capability >= 8.9, this GPU has {cap}"
    if kind == "blockwise" and (cap != (9, 0) or not hasattr(F, "scaled_mm")):
        return False, f"block-wise scaled_mm needs sm90 and torch.nn.functional.scaled_mm (cap={cap})"
    return True, ""


@torch._dynamo.assume_constant_result
def log_fallback(reason: str) -> bool:
    # Runs eagerly even under torch.compile (its result is a trace-time constant), so the log
    # line is emitted once per reason per process, compiled or not.
    warn_once(("emulated gemm", reason), "fp8func: emulated FP8 GEMM on a GPU (%s); expect no FP8 speedup.", reason)
    return True


def gemm_path(a: Fp8Tensor, b: Fp8Tensor, path: str = "auto") -> str:
    """Which path ``gemm(a, b, path=path)`` runs: ``"scaled_mm_<kind>"`` or ``"emulated"``.

    Raises when ``path="hardware"`` and no hardware kernel applies, saying why. Operands scaled
    per chunk of the contraction run one GEMM per chunk: the path of the first chunk's.
    """
    _check_operands(a, b)
    chunk = contraction_chunk(a, b)
    if chunk is not None:
        return gemm_path(_chunk(a, 1, 0, chunk), _chunk(b, 0, 0, chunk), path)
    if path == "emulated":
        return "emulated"
    kind, why = hardware_kind(a, b)
    ok = kind is not None
    if ok:
        ok, why = _device_supports(kind, a.device)
    if path == "hardware":
        if not ok:
            raise ValueError(f"gemm(path='hardware'): {why}. Use path='auto' to fall back to emulation.")
        return f"scaled_mm_{kind}"
    if path != "auto":
        raise ValueError(f"gemm: path={path!r}; expected 'auto', 'hardware' or 'emulated'.")
    if a.device.type == "cpu":
        return "emulated"  # the CPU scaled_mm is itself an emulation; the fp32 path is the reference
    if not ok:
        log_fallback(why)
        return "emulated"
    return f"scaled_mm_{kind}"


def _check_operands(a: Fp8Tensor, b: Fp8Tensor) -> None:
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Fp8Tensor):
            raise TypeError(f"gemm: {name} is a {type(t).__name__}; expected an Fp8Tensor (from fp8func.quantize).")
        if t.ndim != 2:
            raise ValueError(f"gemm: {name} has shape {tuple(t.shape)}; expected 2 dims ([M, K] and [K, N]).")
    if a.shape[1] != b.shape[0]:
        raise ValueError(
            f"gemm: a is {tuple(a.shape)} and b is {tuple(b.shape)}; inner dims must match (a: [M, K], b: [K, N])."
        )


def _aligned(t: torch.Tensor, leading: int) -> bool:
    """Whether cuBLASLt takes ``t``'s layout: a leading dimension of a multiple of 16 bytes, and,
    eagerly, a 16-byte aligned start (a view into a packed buffer, such as the casts of an FP8
    sequence gather, can have neither). Traced by AOTAutograd or on a CPU, the storage offset
    stands in for the address; dynamo, which cannot read either, checks the pitch alone."""
    size = t.element_size()
    if leading * size % 16:
        return False
    if torch.compiler.is_compiling():
        return True
    if tracing() or not t.is_cuda:
        return t.storage_offset() * size % 16 == 0
    return t.data_ptr() % 16 == 0


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) row-major with a 16-byte aligned start and row pitch: itself where it is, else a copy."""
    return t if t.stride(-1) == 1 and _aligned(t, t.stride(-2) if t.ndim > 1 else 0) else t.contiguous()


def col_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` (2-D) column-major with a 16-byte aligned start and column pitch: itself where it is, else a copy."""
    return t if t.ndim == 2 and t.stride(0) == 1 and _aligned(t, t.stride(1)) else t.t().contiguous().t()


def _rowwise_scales(a: Fp8Tensor, b: Fp8Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row of ``a`` ``[M, 1]`` and per column of ``b`` ``[1, N]``: a scale that
    spans all rows (columns) broadcast, one per block of rows (columns) repeated over its block."""
    m, n = a.shape[0], b.shape[1]
    sa, sb = a.scale, b.scale
    if sa.shape[0] not in (1, m):
        sa = sa.repeat_interleave(m // sa.shape[0], dim=0)
    if sb.shape[1] not in (1, n):
        sb = sb.repeat_interleave(n // sb.shape[1], dim=1)
    return sa.expand(m, 1).contiguous(), sb.expand(1, n).contiguous()


def _rowwise_out_dtype_ok(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether row-wise ``torch._scaled_mm`` writes ``out_dtype`` itself.

    On sm90 with cuBLAS >= 12.9, torch runs row-wise scaling in cuBLAS, which writes fp32 too
    (H200, torch 2.11+cu130). Elsewhere (sm89, sm100 with row-wise scales, older
    CUDA) torch uses CUTLASS kernels that write bf16/fp16 only.
    """
    if device.type != "cuda" or out_dtype in (torch.bfloat16, torch.float16):
        return True
    cuda = tuple(int(v) for v in (torch.version.cuda or "0.0").split(".")[:2])
    return torch.cuda.get_device_capability(device)[0] == 9 and cuda >= (12, 9)


def _scaled_mm(kind: str, a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    if kind == "blockwise":  # lays out its own operands (inside the custom op when compiling)
        b_128x128 = canonical_granularity(b.granularity) == BlockWise((128, 128))
        if tracing():
            # torch 2.11's dynamo cannot trace F.scaled_mm (torch._scaled_mm_v2 is not in its trace
            # rules); an opaque custom op with a fake implementation keeps fullgraph=True working.
            return _blockwise_scaled_mm_op(a.data, b.data, a.scale, b.scale, b_128x128, out_dtype)
        return _blockwise_scaled_mm(a.data, b.data, a.scale, b.scale, b_128x128, out_dtype)
    da, db = _row_major(a.data), col_major(b.data)
    if kind == "tensorwise":
        return torch._scaled_mm(da, db, scale_a=a.scale.reshape(()), scale_b=b.scale.reshape(()),
                                out_dtype=out_dtype, use_fast_accum=fast_accum)
    sa, sb = _rowwise_scales(a, b)  # kind == "rowwise"
    if not _rowwise_out_dtype_ok(a.device, out_dtype):
        # CUTLASS row-wise kernels write bf16 only; the cast is the one extra rounding.
        return torch._scaled_mm(da, db, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                use_fast_accum=fast_accum).to(out_dtype)
    return torch._scaled_mm(da, db, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast_accum)


def _blockwise_scaled_mm(da: torch.Tensor, db: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor,
                         b_128x128: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``F.scaled_mm`` for a 1x128 blocks [M, K] and b 128x128 or (128, 1) blocks [K, N].

    Layouts cuBLASLt wants: a row-major, b column-major; a scales [M, K/128] outer-dim-major
    (M contiguous); 128x128 b scales [K/128, N/128] K-major with the K-blocks padded to a
    multiple of 4; (128, 1) b scales [K/128, N] given as [N, K/128] with N contiguous.
    """
    S = F.ScalingType
    da, db, sa = _row_major(da), col_major(db), col_major(sa)
    if b_128x128:
        sb, recipe_b = _pad_k_blocks(sb), S.BlockWise128x128
    else:
        sb, recipe_b = sb.contiguous().t(), S.BlockWise1x128
    return F.scaled_mm(da, db, sa, S.BlockWise1x128, sb, recipe_b, output_dtype=out_dtype)


# An opaque op for compiled code, registered with the dispatcher directly: torch.library.custom_op's
# Python wrapper (autograd and aliasing checks at every call) costs ~0.2 ms of host time per GEMM,
# three per linear step. No autograd kernel: the op runs inside _LinearFn, on fp8 payloads only.
_LIB = torch.library.Library("fp8func", "FRAGMENT")
_LIB.define("blockwise_scaled_mm(Tensor da, Tensor db, Tensor sa, Tensor sb, bool b_128x128, "
            "ScalarType out_dtype) -> Tensor")
_LIB.impl("blockwise_scaled_mm", _blockwise_scaled_mm, "CompositeExplicitAutograd")
_blockwise_scaled_mm_op = torch.ops.fp8func.blockwise_scaled_mm
_LIB.define("scaled_mm_chunks(Tensor da, Tensor db, Tensor sa, Tensor sb, int chunk, int a_block, int b_block, "
            "ScalarType out_dtype, bool fast_accum) -> Tensor")
_LIB.impl("scaled_mm_chunks", _scaled_mm_chunks, "CompositeExplicitAutograd")
_scaled_mm_chunks_op = torch.ops.fp8func.scaled_mm_chunks


@torch.library.register_fake("fp8func::blockwise_scaled_mm")
def _(da, db, sa, sb, b_128x128, out_dtype):
    return da.new_empty((da.shape[0], db.shape[1]), dtype=out_dtype)


@torch.library.register_fake("fp8func::scaled_mm_chunks")
def _(da, db, sa, sb, chunk, a_block, b_block, out_dtype, fast_accum):
    return da.new_empty((da.shape[0], db.shape[1]), dtype=out_dtype)


def _pad_k_blocks(scale: torch.Tensor) -> torch.Tensor:
    kb, nb = scale.shape
    kb_pad = (kb + 3) // 4 * 4
    if kb_pad == kb:
        return col_major(scale)
    padded = scale.new_ones((nb, kb_pad)).t()  # K-major storage, as cuBLASLt's layout wants
    padded[:kb] = scale
    return padded


def gemm(
    a: Fp8Tensor,
    b: Fp8Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    bias: torch.Tensor | None = None,
    path: str = "auto",
    fast_accum: bool = False,
) -> torch.Tensor:
    """``a @ b`` for FP8 operands ``a [M, K]`` and ``b [K, N]``, returned in ``out_dtype``.

    ``path``: "auto" (hardware where it exists, else emulated, logged once on a GPU),
    "hardware" (raise if none) or "emulated" (fp32 dequantize + matmul). See ``gemm_path``.
    ``fast_accum``: let a tensorwise / row-wise hardware kernel skip the periodic promotion of its
    accumulator to fp32 (``use_fast_accum``; see ``Recipe.fast_accum``); ignored elsewhere.

    Example:
        >>> import torch, fp8func as f8
        >>> a = f8.quantize(torch.randn(32, 64), f8.CastSpec())
        >>> b = f8.quantize(torch.randn(16, 64), f8.CastSpec()).t()
        >>> f8.gemm(a, b, out_dtype=torch.float32).shape
        torch.Size([32, 16])
    """
    if isinstance(a.data, DTensor) or isinstance(b.data, DTensor):
        y = _gemm_sharded(a, b, out_dtype, path, fast_accum)
        return y if bias is None else y + bias.to(out_dtype)
    _check_operands(a, b)
    chunk = contraction_chunk(a, b)
    if chunk is not None:
        y = _gemm_chunks(a, b, chunk, out_dtype, path, fast_accum)
        return y if bias is None else y + bias.to(out_dtype)
    chosen = gemm_path(a, b, path)
    if chosen == "emulated":
        # Canonical layouts (a row-major, b column-major, as scaled_mm takes them), so the result
        # depends on the values alone, not on how a caller happened to lay them out.
        a_hp = dequantize(a, torch.float32).contiguous()
        b_hp = col_major(dequantize(b, torch.float32))
        y = (a_hp @ b_hp).to(out_dtype)
    else:
        y = _scaled_mm(chosen.removeprefix("scaled_mm_"), a, b, out_dtype, fast_accum)
    return y if bias is None else y + bias.to(out_dtype)


def _local(q: Fp8Tensor) -> tuple[Fp8Tensor, tuple]:
    """The local shard of a DTensor-backed Fp8Tensor, with its data placements.

    A scale still holding partial maxima (``Partial("max")``, from an amax over a sharded dim) is
    reduced first: every shard must be cast and multiplied with the logical tensor's scale.
    """
    data, scale = q.data, q.scale
    if not isinstance(scale, DTensor):
        scale = DTensor.from_local(scale, data.device_mesh, [Replicate()] * data.device_mesh.ndim, run_check=False)
    if any(p.is_partial() for p in scale.placements):
        scale = scale.redistribute(scale.device_mesh, [Replicate() if p.is_partial() else p for p in scale.placements])
    return Fp8Tensor(data.to_local(), scale.to_local(), q.meta), tuple(data.placements)


def _gemm_sharded(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype, path: str,
                  fast_accum: bool = False) -> torch.Tensor:
    """``gemm`` of DTensor operands: the local GEMM on each rank's shards, placed explicitly.

    Per mesh dim: (Replicate, Replicate) -> Replicate; (Shard(0), Replicate) -> Shard(0);
    (Replicate, Shard(1)) -> Shard(1); (Shard(1), Shard(0)) -> Partial (the contraction dim is
    split: partial sums). Local shards are laid out for scaled_mm here, not by DTensor, whose
    redistributions produce layouts cuBLASLt rejects.
    """
    if not (isinstance(a.data, DTensor) and isinstance(b.data, DTensor)) or a.data.device_mesh != b.data.device_mesh:
        raise ValueError(
            "gemm: one operand is a DTensor and the other is not (or they live on different meshes); "
            "make both DTensors on one mesh (DTensor.from_local with their placements)."
        )
    mesh = a.data.device_mesh
    la, pa = _local(a)
    lb, pb = _local(b)
    out = []
    for i, (x, y) in enumerate(zip(pa, pb)):
        rule = {(Replicate(), Replicate()): Replicate(), (Shard(0), Replicate()): Shard(0),
                (Replicate(), Shard(1)): Shard(1), (Shard(1), Shard(0)): Partial()}.get((x, y))
        if rule is None:
            raise ValueError(
                f"gemm: operands placed {x} (a) and {y} (b) on mesh dim {i}; supported pairs are "
                "(Replicate, Replicate), (Shard(0), Replicate), (Replicate, Shard(1)) and (Shard(1), Shard(0)). "
                "Redistribute the high-precision tensor before quantizing it."
            )
        out.append(rule)
    if tracing() and la.data.ndim == 2:
        # Traced, a DTensor's local tensor can claim strides the real one lacks (torch 2.11: a
        # column-major local of a transposed cast can trace as row-major, so _row_major would keep
        # it and scaled_mm's meta check fail in the lazily compiled backward). Copies fix the
        # layouts whatever the trace believes; eager reads the real strides instead.
        la = Fp8Tensor(la.data.clone(memory_format=torch.contiguous_format), la.scale, la.meta)
        lb = Fp8Tensor(lb.data.t().clone(memory_format=torch.contiguous_format).t(), lb.scale, lb.meta)
    local = gemm(la, lb, out_dtype, path=path, fast_accum=fast_accum)
    return DTensor.from_local(local, mesh, out, run_check=False)
