"""spacy-ray's sharded parameter server against collectives, on a thinc MLP and real data.

The task (``task``): a thinc MLP of about a million parameters learns scikit-learn's bundled
handwritten digits. Every variant trains it from the same initial weights on the same global
batches, each worker taking its own disjoint slice of every global batch:

- ``ps-async`` / ``ps-sync`` (``ray_collective.integrations.thinc.parameter_server``, shared
  with spaCy's integration): spacy-ray's parameter server, re-implemented:
  parameters divided among the workers by model node, a proxy in thinc's parameter-server hook,
  gradients pushed to the owner with fire-and-forget actor calls, stale ones dropped, the owner
  running the optimizer and pushing parameters to every other worker.
- ``allreduce-flat``, ``rs-ag``, ``allreduce-per-array`` (``collective_variants``): one
  allreduce of a flat gradient buffer; reducescatter, sharded update, allgather; one
  allreduce per parameter array (the structure of the original design document). The first two
  also run over ``ray.util.collective``'s Gloo and over ``torch.distributed``'s own Gloo group.

``training`` starts the workers and runs a variant; ``python -m examples.parameter_server``
is its command line, ``python -m benchmarks.param_server`` the benchmark built on it.
"""
