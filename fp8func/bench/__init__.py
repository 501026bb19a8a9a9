"""Benchmark entry points: ``python -m fp8func.bench {all,gemm,quantize,linear,...}`` (``--help``).

Benchmarks print a table and record command, device, torch version and date beside the figures
(docs/benchmarks.md). They need a CUDA GPU and never run in the test suite.
"""
