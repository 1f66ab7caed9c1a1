"""Data-parallel training of thinc models, shared by spaCy's integration and the example.

- ``params``: a model's parameters by a key every process agrees on, thinc's parameter-server
  hook, and flat buffers whose views are the model's gradients and parameters.
- ``communicators``: one collective library (this one, ``ray.util.collective``'s Gloo,
  ``torch.distributed``'s Gloo) behind mean-allreduce, mean-reducescatter and allgather.
- ``parameter_server``: spacy-ray's sharded parameter server, re-implemented on that hook.

None of these modules imports thinc: they work on the model objects they are given.
"""
