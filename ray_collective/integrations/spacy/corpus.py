"""A corpus for named-entity recognition made here, without downloads: sentences from a seed.

Each sentence is one of ``TEMPLATES`` with its slots filled from Faker's English word lists
(``faker`` is a PyPI package; its lists ship inside it): persons, places, organisations, dates
and amounts, labelled ``PERSON``, ``GPE``, ``ORG``, ``DATE`` and ``MONEY`` as spaCy's English
pipelines label them. spaCy's blank English tokenizer (no model download) splits the text,
and each filled slot becomes an entity span, so the annotation is exact by construction.

The same seed and sizes give the same files, byte for byte, with the same Faker version: the
train and dev parts draw from two generators seeded apart (``"SEED-train"``, ``"SEED-dev"``).
Both are written in spaCy's ``DocBin`` format (``train.spacy``, ``dev.spacy``), which any
spaCy config's ``spacy.Corpus.v1`` reader takes.
"""

from __future__ import annotations

import datetime
import pathlib
import random
import string
from typing import Callable, Dict, List, Tuple

import spacy
from faker import Faker
from spacy.tokens import Doc, DocBin

LABELS = ("PERSON", "GPE", "ORG", "DATE", "MONEY")
"""The entity labels the corpus annotates."""

TEMPLATES = (
    "{PERSON} moved to {GPE} in {DATE} to work for {ORG}.",
    "{ORG} paid {MONEY} for a warehouse near {GPE}.",
    "On {DATE}, {PERSON} signed a contract with {ORG} worth {MONEY}.",
    "{PERSON} and {PERSON} met in {GPE} last week.",
    "The board of {ORG} named {PERSON} chief executive on {DATE}.",
    "Shares of {ORG} fell after it lost {MONEY} in {GPE}.",
    "{PERSON} flew from {GPE} to {GPE} on {DATE}.",
    "A spokesperson for {ORG} said the office in {GPE} will close.",
    "{PERSON} donated {MONEY} to a school in {GPE}.",
    "The report from {ORG} was published on {DATE}.",
    "Rent in {GPE} rose to {MONEY} a month, according to {PERSON}.",
    "{ORG} hired {PERSON} as its lawyer.",
    "Nobody in {GPE} expected the storm on {DATE}.",
    "{PERSON} borrowed {MONEY} from {PERSON} and never paid it back.",
    "Investors valued {ORG} at {MONEY} on {DATE}.",
    "The mayor of {GPE}, {PERSON}, opened the new bridge.",
    "We visited {GPE} and {GPE} before the end of the year.",
    "The weather was mild and the streets were quiet.",
    "{ORG} and {ORG} agreed to merge by {DATE}.",
    "According to {PERSON}, the deal with {ORG} is off.",
)
"""Sentence shapes; ``{LABEL}`` is a slot, and a sentence may have none (a negative example)."""

FIRST_DAY, LAST_DAY = datetime.date(1990, 1, 1), datetime.date(2025, 12, 31)
"""The dates' range: fixed, not relative to today, so a seed gives the same corpus any day."""


def _fillers(fake: Faker, rng: random.Random) -> Dict[str, Callable[[], str]]:
    """What fills each label's slot: Faker's lists, and amounts from the seeded generator."""
    def money() -> str:
        amount = rng.choice([rng.randint(2, 999), rng.randint(1000, 99999) * 10])
        return rng.choice([f"${amount:,}", f"{amount:,} dollars", f"${amount} million"])

    def date() -> str:
        day = fake.date_between(start_date=FIRST_DAY, end_date=LAST_DAY)
        return rng.choice([day.strftime("%B %d, %Y").replace(" 0", " "), day.strftime("%B %Y"),
                           fake.day_of_week(), str(day.year)])

    return {"PERSON": fake.name, "GPE": lambda: rng.choice([fake.city(), fake.country()]),
            "ORG": fake.company, "DATE": date, "MONEY": money}


def _sentence(template: str, fillers: Dict[str, Callable[[], str]]
              ) -> Tuple[str, List[Tuple[int, int, str]]]:
    """A template filled in, with the character span and label of each filled slot."""
    text, spans = "", []
    for literal, label, _, _ in string.Formatter().parse(template):
        text += literal
        if label:
            value = fillers[label]()
            spans.append((len(text), len(text) + len(value), label))
            text += value
    return text, spans


def generate_docs(nlp: "spacy.Language", count: int, seed: str) -> List[Doc]:
    """``count`` annotated sentences, the same for the same seed.

    Args:
        nlp: gives the tokenizer and vocabulary (``spacy.blank("en")``).
        count: sentences to make.
        seed: the generators' seed.

    Returns:
        Docs with their entities set; a sentence whose slot does not fall on token boundaries
        (rare: the tokenizer splits some names oddly) is replaced by the next one drawn.
    """
    fake = Faker("en_US")
    fake.seed_instance(seed)
    rng = random.Random(seed)
    fillers = _fillers(fake, rng)
    docs: List[Doc] = []
    while len(docs) < count:
        text, spans = _sentence(rng.choice(TEMPLATES), fillers)
        doc = nlp.make_doc(text)
        entities = [doc.char_span(start, end, label=label) for start, end, label in spans]
        if all(entity is not None for entity in entities):
            doc.ents = entities
            docs.append(doc)
    return docs


def write_corpus(directory: pathlib.Path, train: int, dev: int, seed: int = 0,
                 lang: str = "en") -> Tuple[pathlib.Path, pathlib.Path]:
    """Write ``train.spacy`` and ``dev.spacy`` into ``directory`` (created if absent).

    Args:
        directory: where the two files go.
        train: sentences of the training part.
        dev: sentences of the dev part.
        seed: the corpus's seed.
        lang: the blank pipeline whose tokenizer splits the text.

    Returns:
        The two paths.

    Raises:
        ValueError: a size below 1.
    """
    if train < 1 or dev < 1:
        raise ValueError(f"the corpus needs at least one sentence in each part, not "
                         f"train={train}, dev={dev}")
    nlp = spacy.blank(lang)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for part, count in (("train", train), ("dev", dev)):
        path = directory / f"{part}.spacy"
        DocBin(docs=generate_docs(nlp, count, f"{seed}-{part}"), store_user_data=False
               ).to_disk(path)
        paths.append(path)
    return paths[0], paths[1]
