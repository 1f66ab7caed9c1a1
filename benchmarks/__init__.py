"""Benchmarks of ray_collective against the libraries a user would pick instead.

``python -m benchmarks`` times collectives on Ray actors over this library and its peers
(``torch.distributed``'s own Gloo group, Gloo through ``ray.util.collective``, plain Ray with a
central actor, mpi4py under ``mpiexec``) in one run, interleaved, back to back or with a barrier
before every call, and prints latency, nccl-tests bandwidths, processes and memory side by side
(the method: docs/benchmarking.md); ``make bench`` reruns the results page,
benchmarks/README.md.

Modules: ``cli`` (the command line), ``harness`` (actors, interleaved sweep, rows),
``worker`` (the rank that times calls), ``peers`` (one class per library), ``plain_ray`` (the
plain-Ray central actor), ``mpi_job`` and ``mpi_worker`` (the mpiexec job and its channel),
``collectives`` (sizes and bus factors), ``stats`` (percentiles, bandwidths), ``report``
(table, progress bar, JSON), ``plots`` (PNGs), ``report_page`` (a sweep's tables), ``page`` (the
results page, every table of it made from benchmarks/results/).
``scale_real`` (with its rank actor, ``scale_rank``) runs real groups of up to 400 ranks
(``make bench-400``); ``scale_memory`` (with its actor, ``memory_probe``) measures where a
rank's memory goes and what Ray's settings change of it. ``minimal_loop`` is the loop a user writes (this library beside Ray's
Gloo group, call by call, in the same plain actors); ``agent_observer`` (with
``agent_observer_rpc``) serves a policy to observers over this library, plain actor calls and
``torch.distributed.rpc``. ``netbed`` is the network bed (Ray nodes in network namespaces of their own behind
rate-limited links), ``netbed_bench`` the sweep on it and ``netbed_faults`` its cut cables.
``nccl_overhead`` is a separate tool: the ``nccl`` backend's per-call
cost against raw ``cupy.cuda.nccl``, one GPU per rank, without Ray.
"""
