"""Benchmark entry points: ``python -m fp8func.bench gemm`` (more in later issues).

Benchmarks print a table and record command, device, torch version and date beside the figures.
They never run in the test suite.
"""
