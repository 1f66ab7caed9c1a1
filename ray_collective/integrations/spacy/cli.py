"""``python -m spacy ray-collective ...``: the commands spaCy's CLI gains with this extra.

spaCy imports every ``spacy_cli`` entry point when its CLI starts (setup.cfg registers
``ray-collective`` here), and importing this module adds the ``ray-collective`` group to
spaCy's own typer app. The name leaves ``ray`` to spacy-ray. Importing it must stay cheap,
since every ``python -m spacy`` command pays for it: Ray and the training code are imported by
the commands themselves.

- ``train CONFIG --n-workers N [--strategy ...] [--output DIR] [--address ...]``: ``spacy
  train`` on N Ray actors, config overrides (``--training.max_steps 1000``) as there;
- ``corpus OUTPUT_DIR [--train N] [--dev N] [--seed S]``: the generated NER corpus.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer
from spacy import util
from spacy.cli._util import (Arg, Opt, app, import_code, parse_config_overrides, setup_gpu,
                             show_validation_error)
from wasabi import msg

from .settings import LIBRARIES, STRATEGIES, RunSettings

NAME = "ray-collective"
HELP = """Train spaCy pipelines on Ray actors whose gradients go through ray_collective's
collectives (allreduce, or reduce-scatter and all-gather), or through spacy-ray's sharded
parameter server, to compare."""

ray_collective_cli = typer.Typer(name=NAME, help=HELP, no_args_is_help=True)
app.add_typer(ray_collective_cli)


@ray_collective_cli.command(
    "train", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train_cli(
    # fmt: off
    ctx: typer.Context,  # the config overrides, as `spacy train` reads them
    config_path: Path = Arg(..., help="Path to config file", exists=True, allow_dash=True),
    n_workers: int = Opt(1, "--n-workers", "-n", help="Number of Ray workers"),
    strategy: str = Opt("allreduce", "--strategy", "-s",
                        help=f"How gradients meet: {', '.join(STRATEGIES)}"),
    output_path: Optional[Path] = Opt(None, "--output", "--output-path", "-o",
                                      help="Output directory to store trained pipeline in"),
    address: Optional[str] = Opt(None, "--address", "-a",
                                 help="Address of the Ray cluster (default: a local one)"),
    code_path: Optional[Path] = Opt(None, "--code", "-c",
                                    help="Path to Python file with additional code "
                                         "(registered functions) to be imported"),
    library: str = Opt("ray_collective", "--library",
                       help=f"Who moves a collective strategy's bytes: {', '.join(LIBRARIES)}"),
    use_gpu: int = Opt(-1, "--gpu-id", "-g",
                       help="GPU ID or -1 for CPU: each worker takes one GPU, and the "
                            "collectives run on the nccl backend"),
    verbose: bool = Opt(False, "--verbose", "-V", help="Display more information for debugging"),
    # fmt: on
):
    """Train a spaCy pipeline on Ray workers, each on its shard of the corpus, with the
    gradients summed through ray_collective. The config is `spacy train`'s, and so are the
    overrides (e.g. --training.max_steps 1000), the progress table and the saved pipeline
    (OUTPUT/model-last, OUTPUT/model-best)."""
    from .driver import train
    if verbose:
        util.logger.setLevel(logging.DEBUG)
    overrides = parse_config_overrides(ctx.args)
    import_code(code_path)
    try:
        settings = RunSettings(strategy=strategy, workers=n_workers, library=library,
                               backend="nccl" if use_gpu >= 0 else "ray", gpu_id=use_gpu,
                               output_path=str(output_path) if output_path else None,
                               code_path=str(code_path) if code_path else None)
    except ValueError as err:
        msg.fail(str(err), exits=1)
    if output_path is not None:
        output_path.mkdir(parents=True, exist_ok=True)
        msg.info(f"Saving to output directory: {output_path}")
    else:
        msg.info("No output directory provided")
    setup_gpu(use_gpu)
    with show_validation_error(config_path):
        config = util.load_config(config_path, overrides=overrides, interpolate=False)
    msg.divider("Initializing pipeline")
    with show_validation_error(config_path, hint_fill=False):
        train(config, settings, address=address)


@ray_collective_cli.command("corpus")
def corpus_cli(
    # fmt: off
    output_dir: Path = Arg(..., help="Directory to write train.spacy and dev.spacy to"),
    train: int = Opt(2000, "--train", help="Sentences in the training part"),
    dev: int = Opt(500, "--dev", help="Sentences in the dev part"),
    seed: int = Opt(0, "--seed", help="The corpus's seed: the same seed, the same files"),
    lang: str = Opt("en", "--lang", help="Language of the blank tokenizer"),
    # fmt: on
):
    """Write a generated NER corpus (PERSON, GPE, ORG, DATE, MONEY), made from Faker's word
    lists without any download, as spaCy DocBin files."""
    from .corpus import write_corpus
    try:
        train_path, dev_path = write_corpus(output_dir, train, dev, seed, lang)
    except ValueError as err:
        msg.fail(str(err), exits=1)
    msg.good(f"Wrote {train} training sentences to {train_path} and {dev} to {dev_path}")
