"""Benchmarks of ray_collective against the libraries a user would pick instead.

``python -m benchmarks`` times collectives on Ray actors over this library and its peers in one
run, interleaved, and prints latency and nccl-tests bandwidths side by side (see README.md).

Modules: ``cli`` (the command line), ``harness`` (actors, interleaved sweep, rows),
``worker`` (the rank actor that times calls), ``peers`` (one class per library),
``collectives`` (sizes and bus factors), ``stats`` (percentiles, bandwidths), ``report``
(table and JSON). ``nccl_overhead`` is a separate tool: the ``nccl`` backend's per-call cost
against raw ``cupy.cuda.nccl``, one GPU per rank, without Ray.
"""
