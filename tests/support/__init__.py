"""What the tests share besides fixtures, as one package (``tests/support``).

The test modules import it as ``support`` (``from support.helpers import run_in``): pytest puts
``tests/`` on ``sys.path`` (the directory of the rootmost ``conftest.py``), and every process the
tests start that imports test code (Ray workers, the MPI oracle under ``mpiexec``, the multi-node
cluster script) gets ``tests/`` and the repository on its ``PYTHONPATH`` from
:func:`support.paths.python_path`. Functions of these modules run inside Ray actors are pickled
by reference, so a worker imports them by the same name.

- ``paths``: the repository's directories and the ``PYTHONPATH`` of the processes tests start.
- ``reference``: reductions as numpy computes them, and the rounding bound of a float
  reduction, derived from its dtype.
- ``helpers``: small integer inputs, member actors and running code inside them, acting while
  a transport waits, running a script or a benchmark in a subprocess.
- ``contract``: every collective against numpy, written once and bound to every backend.
- ``oracle_cases``, ``mpi_oracle``: the MPI oracle's cases and its mpi4py side.
- ``nccl_standin`` (with ``nccl_standin_moves``), ``nccl_ranks``: a stand-in for CuPy and NCCL
  no kinder than NCCL, and NCCL ranks as threads.
- ``gpu_world_one``: the GPU tests at world size 1, for real GPUs and the stand-in alike.
- ``compat_members``: an actor written for ``ray.util.collective``.
- ``multinode_cluster``, ``abandoned_job``: scripts the tests run in processes of their own.
- ``kinds``, ``extras``: the markers each test gets, and the test extras a run requires.
"""
