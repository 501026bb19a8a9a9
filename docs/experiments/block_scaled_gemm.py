"""Experiment, not part of the package: a Triton block-scaled FP8 GEMM against cuBLAS.

The blockwise recipe's GEMMs: ``a`` in 1x128 groups times ``b`` in 128x128 groups (forward,
grad input) or 128x1 groups (grad weight). Per 128-long stretch of the contraction the kernel
takes one ``tl.dot`` of the fp8 tiles into a fresh fp32 tile, scales it by the outer product of
the two group scales and adds it to the accumulator (the promotion cuBLASLt and DeepSeek-V3
make). ``--unscaled`` drops the scaling (``acc = tl.dot(a, b, acc)``: Triton's pipeline without
the promotion); ``--defer`` adds stretch k's product while stretch k+1's MMA runs.

    python docs/experiments/block_scaled_gemm.py                     # GPU: TFLOP/s against cuBLAS
    TRITON_INTERPRET=1 python docs/experiments/block_scaled_gemm.py --check   # CPU: indexing only

Its figures on an H200: docs/design.md; why the package keeps cuBLAS's GEMM: docs/kernels.md.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

E4M3 = torch.float8_e4m3fn
TILES = [(128, 128, 4, 3), (128, 128, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 8, 5), (128, 256, 8, 3),
         (128, 256, 8, 4), (256, 128, 8, 3), (64, 256, 4, 4), (64, 128, 4, 5), (128, 64, 4, 5)]  # bm, bn, warps, stages
SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096), (8192, 8192, 8192), (4096, 2048, 2048)]


@triton.jit
def _block_gemm(a_ptr, b_ptr, c_ptr, sa_ptr, sb_ptr, M, N, K, sa_m, sa_k, sb_k, sb_n, B_GROUP_N: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr, SCALED: tl.constexpr, DEFER: tl.constexpr):
    # a [M, K] row-major, b given as bt [N, K] row-major (b column-major), c [M, N];
    # sa [M, K/128], sb [K/128, N / B_GROUP_N] (B_GROUP_N 1: 128x1 groups, 128: 128x128 groups)
    BK: tl.constexpr = 128
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BN)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    rows_in_group = min(tl.cdiv(M, BM) - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows_in_group
    pid_n = (pid % per_group) // rows_in_group
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    mmask, nmask = rm < M, rn < N
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
    b_ptrs = b_ptr + rn.to(tl.int64)[None, :] * K + rk[:, None]
    sa_ptrs = sa_ptr + rm * sa_m
    sb_ptrs = sb_ptr + (rn // B_GROUP_N) * sb_n
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    prev = tl.zeros([BM, BN], dtype=tl.float32)
    sa_p = tl.zeros([BM], dtype=tl.float32)
    sb_p = tl.zeros([BN], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        kmask = rk < K - kb * BK
        a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        sa = tl.load(sa_ptrs + kb * sa_k, mask=mmask, other=0.0)
        sb = tl.load(sb_ptrs + kb * sb_k, mask=nmask, other=0.0)
        if not SCALED:
            acc = tl.dot(a, b, acc)
        elif DEFER:
            cur = tl.dot(a, b)
            acc += prev * (sa_p[:, None] * sb_p[None, :])
            prev, sa_p, sb_p = cur, sa, sb
        else:
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        a_ptrs += BK
        b_ptrs += BK
    if SCALED and DEFER:
        acc += prev * (sa_p[:, None] * sb_p[None, :])
    tl.store(c_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def block_gemm(a, bt, sa, sb, group_n, tile, out_dtype=torch.bfloat16, scaled=True, defer=False):
    m, n = a.shape[0], bt.shape[0]
    bm, bn, warps, stages = tile
    out = torch.empty(m, n, device=a.device, dtype=out_dtype)
    _block_gemm[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        a, bt, out, sa, sb, m, n, a.shape[1], sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1),
        B_GROUP_N=group_n, BM=bm, BN=bn, GROUP_M=8, SCALED=scaled, DEFER=defer, num_warps=warps, num_stages=stages)
    return out


def operands(m, n, k, group_n, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    kb = triton.cdiv(k, 128)
    a = (torch.randn(m, k, generator=g) * 3).to(E4M3).to(device)
    bt = (torch.randn(n, k, generator=g) * 3).to(E4M3).to(device)
    sa = (2.0 ** torch.randint(-6, 2, (m, kb), generator=g).float()).to(device)
    sb = (2.0 ** torch.randint(-6, 2, (kb, n if group_n == 1 else triton.cdiv(n, 128)), generator=g).float()).to(device)
    return a, bt, sa, sb


def emulated(a, bt, sa, sb, group_n):
    k, n = a.shape[1], bt.shape[0]
    sb_full = sb.repeat_interleave(group_n, 1)[:, :n].repeat_interleave(128, 0)[:k]
    return (a.float() * sa.repeat_interleave(128, 1)[:, :k]) @ (bt.float().t() * sb_full)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="indexing check on small shapes (CPU with TRITON_INTERPRET=1)")
    p.add_argument("--unscaled", action="store_true")
    p.add_argument("--defer", action="store_true")
    args = p.parse_args()
    if args.check:
        for m, n, k, g in [(130, 256, 384, 1), (128, 200, 256, 128), (64, 128, 200, 1)]:
            a, bt, sa, sb = operands(m, n, k, g, "cpu")
            for defer in (False, True):
                got = block_gemm(a, bt, sa, sb, g, (64, 64, 4, 1), torch.float32, defer=defer)
                ref = emulated(a, bt, sa, sb, g)
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                print(m, n, k, g, "defer" if defer else "", "max rel err", err)
        return
    from fp8func._gemm import _blockwise_scaled_mm  # cuBLASLt through F.scaled_mm

    def bench(f):
        return triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median")

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; TFLOP/s")
    for M, K, N in SHAPES:
        gemms = {"fwd": (M, N, K, 128), "grad_input": (M, K, N, 128), "grad_weight": (N, K, M, 1)}
        for name, (m, n, k, g) in gemms.items():
            a, bt, sa, sb = operands(m, n, k, g, "cuda")
            flop = 2 * m * n * k
            hb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            t_bf = bench(lambda: hb @ wb.t())
            t_cub = bench(lambda: _blockwise_scaled_mm(a, bt.t(), sa, sb, g == 128, torch.bfloat16))
            ref = emulated(a, bt, sa, sb, g) if not args.unscaled else None
            best = None
            for tile in TILES:
                try:
                    t = bench(lambda: block_gemm(a, bt, sa, sb, g, tile, scaled=not args.unscaled, defer=args.defer))
                except triton.runtime.errors.OutOfResources:
                    continue
                best = min(best or (t, tile), (t, tile))
            err = "" if ref is None else ((block_gemm(a, bt, sa, sb, g, best[1], torch.float32, defer=args.defer) - ref)
                                          .abs().max() / ref.abs().max()).item()
            print(f"{M}x{K}x{N} {name:11s} bf16 {flop / t_bf / 1e9:5.0f}  cuBLAS {flop / t_cub / 1e9:5.0f}  "
                  f"Triton {flop / best[0] / 1e9:5.0f} (tile {best[1]}, max rel err {err})", flush=True)


if __name__ == "__main__":
    main()
