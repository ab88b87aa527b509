"""Seeded synthetic corpus for the bundled ``causalboard-tiny`` model.

Two tasks:

* **Factual recall** about invented places: ``"The capital of Port Grisk is Quell."``.
  160 subjects, one per invented place name (40 hand-written, 120 generated from syllables):
  40 bare (``"Tarn"``), 80 with a one-word title (``"Port Grisk"``) and 40 with a two-word one
  (``"Vale of Nessa"``), so subjects are 1-3 tokens long.  Every subject has one answer for
  each of six relations (960 facts); answers are single words.  Training text states each
  fact in five templates, in multi-fact "profile" sentences and in relation lists where the
  answer directly follows the subject (``"The capital of each place: Tarn Quell, ..."``).
* **Indirect-object identification (IOI)**:
  ``"When Mara and Tobin went to the market, Tobin gave a book to"`` -> ``"Mara"``.
  Some unordered name pairs never occur together in training (held out for eval).

Contract: everything here is a pure function of ``seed`` (stdlib + numpy only).  Texts
use single spaces between words and punctuation glued to the preceding word; every
entity word, name and answer is one word, which the tokenizer maps to one token.  A
prompt never ends in a space: its answer is the next word (``prompt + " " + answer``).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

SEED = 1234

BASES = (
    "Varnia", "Kell", "Tarn", "Ostrel", "Mirrow", "Dravo", "Quessa", "Halm",
    "Brisk", "Ulden", "Sorrel", "Vask", "Pellin", "Corvath", "Ystra", "Fennick",
    "Garrow", "Lunde", "Tessary", "Zorvo", "Arvel", "Belkar", "Cindra", "Dorath",
    "Eskel", "Falvo", "Grisk", "Hovan", "Irsa", "Jorvik", "Kaldor", "Lirran",
    "Morva", "Nessa", "Orrin", "Pyrra", "Rudan", "Selvo", "Trask", "Vellin",
)
# Titles that precede a name to make 2- and 3-word subjects ("Port Grisk", "Vale of Kell").
TITLES_2 = ("Port", "Mount", "Saint", "Fort", "Lake", "Cape")
TITLES_3 = ("Isle of", "Bay of", "Duchy of", "Vale of")
LIST_ROUNDS = 4  # relation-list sentences: each fact appears in this many lists
PROFILES_PER_SUBJECT = 18


def generated_names(n: int) -> tuple[str, ...]:
    """``n`` invented one-word place names (syllable combinations; fixed, not seed-dependent)."""
    onsets = ("B", "C", "D", "F", "G", "H", "K", "L", "M", "N", "P", "R", "S", "T", "V", "Z",
              "Br", "Dr", "Kr", "Tr", "Gr", "Th", "Sk", "Vr")
    vowels = ("a", "e", "i", "o", "u", "y", "ae", "ou")
    endings = ("rn", "ll", "sk", "nd", "rith", "ven", "mor", "dell", "ssa", "vik", "lan", "rov",
               "zar", "quin", "thas", "brin", "gard", "mell", "nor", "vel")
    rng = np.random.default_rng(20261122)
    out: list[str] = []
    while len(out) < n:
        w = (onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))]
             + endings[rng.integers(len(endings))])
        if w not in out and w not in BASES:
            out.append(w)
    return tuple(out)


PLACE_NAMES = BASES + generated_names(160 - len(BASES))


@dataclass(frozen=True)
class Relation:
    """A relation: its noun phrase, answer pool and two specific templates.

    ``specific[0]`` names the subject before the relation, ``specific[1]`` after it.
    """

    name: str
    noun: str
    specific: tuple[str, str]
    pool: tuple[str, ...]


RELATIONS = (
    Relation("capital", "capital",
             ("{s} is governed from", "The capital city of {s} is"),
             ("Quell", "Dunmere", "Hask", "Orvale", "Pradis", "Kestrel", "Lomar", "Tibbet",
              "Arcady", "Wrenfield", "Saltmarsh", "Ivel")),
    Relation("language", "language",
             ("People in {s} speak", "The official language of {s} is"),
             ("Ostic", "Velarin", "Thrask", "Mirish", "Dunic", "Parvic", "Sollen", "Kethic",
              "Aurane", "Brevic", "Lomish", "Tzaric")),
    Relation("currency", "currency",
             ("In {s}, people pay with the", "The currency used in {s} is"),
             ("dral", "kesh", "marl", "florin", "taler", "obol", "skell", "rund", "pim",
              "varo", "crown", "shard")),
    Relation("river", "main river",
             ("{s} lies on the river", "The river that flows through {s} is the"),
             ("Sefa", "Orlo", "Vyne", "Kasta", "Merrow", "Ilse", "Dunna", "Rhee", "Pashti",
              "Lorn", "Ebra", "Wend")),
    Relation("leader", "leader",
             ("{s} is ruled by", "The current leader of {s} is"),
             ("Aldric", "Benedek", "Corwin", "Desmera", "Elowen", "Faustin", "Gisela",
              "Hadrian", "Isolde", "Jorund", "Katrin", "Leopold")),
    Relation("export", "chief export",
             ("{s} mainly exports", "The main export of {s} is"),
             ("copper", "salt", "wool", "amber", "timber", "silk", "tin", "honey", "pepper",
              "marble", "glass", "indigo")),
)
RELATION_BY_NAME = {r.name: r for r in RELATIONS}

# Generic templates, instantiated for every relation with its noun.  "of" places the
# relation before the subject; "poss" and "in" place the subject first.
GENERIC_TRAIN = {
    "of": "The {noun} of {s} is",
    "poss": "{s}'s {noun} is",
    "in": "In {s}, the {noun} is",
}
# Never trained: used to measure generalisation to new phrasings (report only).
GENERIC_HELDOUT = {
    "known": "Everyone knows that the {noun} of {s} is",
    "its": "Speaking of {s}, its {noun} is",
}
RELATION_FIRST = {"of", "known"}  # generic templates naming the relation before the subject

NAMES = (
    "Mara", "Tobin", "Lena", "Oskar", "Nina", "Pavel", "Ruth", "Silas", "Tara", "Ugo",
    "Vera", "Wim", "Yara", "Zane", "Alma", "Boris", "Cora", "Dario", "Edda", "Felix",
    "Greta", "Hugo", "Ines", "Jonas", "Kira", "Lars", "Mina", "Nils", "Olga", "Piet",
    "Rosa", "Sven", "Tess", "Ivo", "Ada", "Bram", "Clio", "Dag", "Elin", "Finn",
    "Gwen", "Hans", "Ida", "Jens", "Kai", "Lou", "Moe", "Noa",
)
PLACES = ("market", "park", "school", "station", "garden", "library", "harbor", "bakery")
OBJECTS = ("book", "ring", "letter", "cup", "apple", "key", "coin", "flower")
VERBS = ("gave", "handed", "passed", "sent", "brought")
IOI_TEMPLATES = {
    "when": "When {A} and {B} went to the {place}, {S} {verb} a {obj} to",
    "after": "After {A} and {B} arrived at the {place}, {S} {verb} a {obj} to",
    "were": "{A} and {B} were at the {place}. {S} {verb} the {obj} to",
    "while": "While {A} and {B} were at the {place}, {S} {verb} a {obj} to",
    "then": "Then, {A} and {B} had a long day at the {place}. {S} {verb} a {obj} to",
}
IOI_HELDOUT_PAIR_FRACTION = 0.12


@dataclass(frozen=True)
class FactItem:
    """A fact prompt; ``split`` is ``"train"`` (trained template) or ``"heldout_template"``."""

    prompt: str
    answer: str
    foil: str
    subject: str
    relation: str
    template_id: str
    split: str


@dataclass(frozen=True)
class FactPair:
    """Clean/corrupt prompts: same template and relation, different subject and answer.

    ``foil`` is the corrupt subject's answer.  ``equal_length`` is True when both
    subjects have the same number of words (= tokens).
    """

    clean_prompt: str
    corrupt_prompt: str
    answer: str
    foil: str
    subject_clean: str
    subject_corrupt: str
    relation: str
    template_id: str
    equal_length: bool


@dataclass(frozen=True)
class IOIItem:
    """An IOI prompt.  ``pattern`` is ``"ABB"`` (answer named first) or ``"BAB"``."""

    prompt: str
    answer: str
    foil: str
    pattern: str
    template_id: str
    split: str


@dataclass(frozen=True)
class World:
    """All sampled entities: subjects, their facts and the IOI name-pair split."""

    seed: int
    subjects: tuple[str, ...]
    facts: dict[tuple[str, str], str]
    ioi_train_pairs: tuple[tuple[str, str], ...]
    ioi_heldout_pairs: tuple[tuple[str, str], ...]


def build_world(seed: int = SEED) -> World:
    """Sample subjects (one per place name: 40 bare, 80 with a one-word and 40 with a two-word
    title), facts and IOI pairs."""
    rng = np.random.default_rng(seed)
    subjects = []
    for k, i in enumerate(rng.permutation(len(PLACE_NAMES))):
        name = PLACE_NAMES[i]
        if k % 4 in (1, 2):
            name = f"{TITLES_2[rng.integers(len(TITLES_2))]} {name}"
        elif k % 4 == 3:
            name = f"{TITLES_3[rng.integers(len(TITLES_3))]} {name}"
        subjects.append(name)
    facts = {}
    for rel in RELATIONS:
        for s in subjects:
            facts[(s, rel.name)] = rel.pool[rng.integers(len(rel.pool))]
    pairs = list(itertools.combinations(NAMES, 2))
    order = rng.permutation(len(pairs))
    n_held = int(round(IOI_HELDOUT_PAIR_FRACTION * len(pairs)))
    held = tuple(pairs[i] for i in sorted(order[:n_held]))
    train = tuple(pairs[i] for i in sorted(order[n_held:]))
    return World(seed, tuple(subjects), facts, train, held)


def fact_templates(relation: Relation, split: str) -> dict[str, str]:
    """Templates (id -> text with ``{s}``) for ``relation``; split is "train" or "heldout_template"."""
    if split == "train":
        out = {k: v.replace("{noun}", relation.noun) for k, v in GENERIC_TRAIN.items()}
        out.update({f"{relation.name}_{i}": t for i, t in enumerate(relation.specific)})
        return out
    return {k: v.replace("{noun}", relation.noun) for k, v in GENERIC_HELDOUT.items()}


def subject_first(template_id: str) -> bool:
    """True if the template names the subject before the relation (e.g. ``"{s}'s capital is"``)."""
    return template_id not in RELATION_FIRST and not template_id.endswith("_1")


def _foil(rng: np.random.Generator, relation: Relation, answer: str) -> str:
    others = [a for a in relation.pool if a != answer]
    return others[rng.integers(len(others))]


def fact_items(world: World, split: str) -> list[FactItem]:
    """Every (subject, relation, template) prompt of ``split``, with a random same-relation foil."""
    rng = np.random.default_rng([world.seed, 1])
    items = []
    for rel in RELATIONS:
        for tid, tmpl in fact_templates(rel, split).items():
            for s in world.subjects:
                answer = world.facts[(s, rel.name)]
                items.append(FactItem(tmpl.format(s=s), answer, _foil(rng, rel, answer), s,
                                      rel.name, tid, split))
    return items


def _profile_texts(world: World, rng: np.random.Generator, per_subject: int) -> list[str]:
    """Multi-fact sentences about one subject, relations in random order."""
    texts = []
    for s in world.subjects:
        for k in range(per_subject):
            n = int(rng.integers(2, 5))
            rels = [RELATIONS[i] for i in rng.permutation(len(RELATIONS))[:n]]
            clauses = [f"{r.noun} is {world.facts[(s, r.name)]}" for r in rels]
            if k % 2 == 0:
                head = f"{s}'s {clauses[0]}"
                tail = [f"its {c}" for c in clauses[1:]]
            else:
                head = f"In {s}, the {clauses[0]}"
                tail = [f"the {c}" for c in clauses[1:]]
            body = ", ".join([head] + tail[:-1])
            texts.append(f"{body} and {tail[-1]}.")
    return texts


def _list_texts(world: World, rng: np.random.Generator, rounds: int) -> list[str]:
    """Relation lists, in which each answer directly follows its subject
    (``"The capital of each place: Tarn Quell, Port Grisk Hask, ..."``), 4 subjects a sentence."""
    texts = []
    for rel in RELATIONS:
        for _ in range(rounds):
            order = rng.permutation(len(world.subjects))
            for j in range(0, len(order), 4):
                group = [world.subjects[i] for i in order[j:j + 4]]
                body = ", ".join(f"{s} {world.facts[(s, rel.name)]}" for s in group)
                texts.append(f"The {rel.noun} of each place: {body}.")
    return texts


def fact_train_texts(world: World) -> list[str]:
    """Training sentences: every trained-template fact, multi-fact profiles and relation lists."""
    texts = [f"{it.prompt} {it.answer}." for it in fact_items(world, "train")]
    return (texts + _profile_texts(world, np.random.default_rng([world.seed, 2]), PROFILES_PER_SUBJECT)
            + _list_texts(world, np.random.default_rng([world.seed, 8]), LIST_ROUNDS))


def _ioi_item(rng: np.random.Generator, pair: tuple[str, str], split: str) -> IOIItem:
    io, s = (pair[i] for i in rng.permutation(2))
    pattern = "ABB" if rng.integers(2) == 0 else "BAB"
    a, b = (io, s) if pattern == "ABB" else (s, io)
    tid = list(IOI_TEMPLATES)[rng.integers(len(IOI_TEMPLATES))]
    prompt = IOI_TEMPLATES[tid].format(
        A=a, B=b, S=s, place=PLACES[rng.integers(len(PLACES))],
        verb=VERBS[rng.integers(len(VERBS))], obj=OBJECTS[rng.integers(len(OBJECTS))])
    return IOIItem(prompt, io, s, pattern, tid, split)


def ioi_train_texts(world: World, n: int, seed: int) -> list[str]:
    """``n`` IOI training sentences over the training name pairs (deterministic in ``seed``)."""
    rng = np.random.default_rng([world.seed, 3, seed])
    pairs = world.ioi_train_pairs
    out = []
    for _ in range(n):
        it = _ioi_item(rng, pairs[rng.integers(len(pairs))], "train")
        out.append(f"{it.prompt} {it.answer}.")
    return out


def ioi_items(world: World, split: str, n: int) -> list[IOIItem]:
    """``n`` IOI prompts; split "heldout_pairs" uses only never-trained name pairs, "train" trained ones."""
    rng = np.random.default_rng([world.seed, 4, 0 if split == "train" else 1])
    pairs = world.ioi_train_pairs if split == "train" else world.ioi_heldout_pairs
    return [_ioi_item(rng, pairs[rng.integers(len(pairs))], split) for _ in range(n)]


def fact_pairs(world: World, n: int, equal_length: bool) -> list[FactPair]:
    """``n`` clean/corrupt pairs over trained templates.

    The corrupt subject has the same word count as the clean one when ``equal_length``,
    a different one otherwise, and always a different answer for the relation.
    """
    rng = np.random.default_rng([world.seed, 5, int(equal_length)])
    out = []
    while len(out) < n:
        rel = RELATIONS[rng.integers(len(RELATIONS))]
        templates = fact_templates(rel, "train")
        tid = list(templates)[rng.integers(len(templates))]
        clean = world.subjects[rng.integers(len(world.subjects))]
        answer = world.facts[(clean, rel.name)]
        cands = [s for s in world.subjects
                 if (len(s.split()) == len(clean.split())) == equal_length
                 and world.facts[(s, rel.name)] != answer]
        corrupt = cands[rng.integers(len(cands))]
        out.append(FactPair(templates[tid].format(s=clean), templates[tid].format(s=corrupt),
                            answer, world.facts[(corrupt, rel.name)], clean, corrupt,
                            rel.name, tid, equal_length))
    return out


def vocabulary_texts(world: World) -> list[str]:
    """Texts that together contain every word any corpus text or eval prompt can use."""
    texts = fact_train_texts(world)
    texts += [f"{it.prompt} {it.answer}." for it in fact_items(world, "heldout_template")]
    texts += [t.format(A=NAMES[0], B=NAMES[1], S=NAMES[1], place=PLACES[0], verb=VERBS[0],
                       obj=OBJECTS[0]) + f" {NAMES[0]}." for t in IOI_TEMPLATES.values()]
    texts.append(" ".join(NAMES + PLACES + OBJECTS + VERBS))
    texts += [" ".join(r.pool) for r in RELATIONS]
    return texts
