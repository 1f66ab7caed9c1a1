"""Optional integrations of ray_collective with training frameworks, each installed by an extra.

``import ray_collective`` imports none of them, so it never needs their frameworks: a module here
imports its framework (thinc, spaCy, typer) at its top and is imported only by whoever uses it.

- ``thinc``: data-parallel training of any thinc model: the model's parameters and gradients as
  flat buffers, the collective libraries behind one interface, and spacy-ray's sharded
  parameter server on thinc's parameter-server hook (the baseline the collectives replace).
- ``spacy``: ``python -m spacy ray-collective train``: a spaCy pipeline trained on Ray actors
  whose gradients go through this library (``pip install 'ray_collective[spacy]'``).
"""
