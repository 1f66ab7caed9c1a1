"""spaCy pipelines trained on Ray actors over this library's collectives (``[spacy]`` extra).

``python -m spacy ray-collective train CONFIG --n-workers N`` (``cli.py``, registered through
spaCy's ``spacy_cli`` entry point) trains any spaCy 3.8 config as ``spacy train`` does, on N
Ray actors, each running spaCy's own loop on its shard of the corpus:

- ``settings``: a run's options (strategy, workers, library, GPU);
- ``driver``: initializes the pipeline once, starts the workers, prints the progress table;
- ``worker``: the actor: spaCy's loop with an exchange as its optimizer, rank 0 saving;
- ``exchanges``: allreduce, reduce-scatter + shard update + all-gather, and spacy-ray's
  sharded parameter server, as the optimizer spaCy's loop calls;
- ``corpus``: a generated NER corpus (``python -m spacy ray-collective corpus DIR``).
"""
