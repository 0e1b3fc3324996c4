"""Plain English text that benchmark prompts are cut from (no downloads).

Prompts made of random token ids make a model attend to noise; real text gives realistic
attention and sampling behaviour. The paragraphs below were written for this project and are
placed in the public domain; `sentences` extends them with a seeded generator of simple but
grammatical sentences, so a workload can draw as many distinct tokens as it needs.
"""

from __future__ import annotations

import random

PARAGRAPHS = (
    "Twice a day the sea climbs the beach and twice a day it leaves again. The pull of the moon "
    "raises a bulge of water on the side of the earth that faces it, and another on the far side, "
    "and the planet turns beneath both. A harbour master who knows the tables can tell a captain, "
    "weeks ahead, when the channel will be deep enough for a loaded ship.",
    "The old mill stood where the river narrowed between two banks of grey stone. Its wheel had "
    "not turned for forty years, but children still climbed the ladder to the loft, where the "
    "light came through the gaps in the boards and the air smelled of dust and dry grain.",
    "A good loaf needs only flour, water, salt and time. The baker mixes them in the evening, "
    "folds the dough a few times while it rises, and shapes it before dawn. Most of the flavour "
    "comes from the slow hours in between, when yeast and bacteria break the starch into sugars "
    "and acids.",
    "When the first railways crossed the plains, every town kept its own time, set by the sun at "
    "noon. A traveller moving west had to change his watch at each station. The companies agreed "
    "on standard zones so that a timetable printed in one city could be read in another.",
    "An engine that serves many users at once spends most of its effort moving numbers from memory "
    "to the arithmetic units. Grouping requests into a batch lets it reuse each weight it reads, "
    "so the cost of one pass is shared by everyone waiting in the queue.",
    "In the spring the garden is mostly mud and promise. The peas go in first, along a fence of "
    "string, then the beans and the squash once the soil is warm. By midsummer the paths have "
    "vanished under leaves, and the gardener spends the evenings picking rather than planting.",
    "A lighthouse keeper's log from the last century records the weather every four hours: wind, "
    "sea, visibility and the ships that passed. Read in order, the entries show storms arriving "
    "from the southwest, blowing for two days and dying away, as regular as the seasons.",
    "To learn a new language as an adult, listen more than you read at first. The ear learns the "
    "rhythm of a sentence before the mind can explain its grammar, and a phrase heard a hundred "
    "times in context will come to the tongue when it is needed.",
)

_SUBJECTS = (
    "the engineer", "a small boat", "the committee", "my neighbour", "the old clock", "a cold wind",
    "the new library", "every student", "the river", "a tired horse", "the market", "our teacher",
    "the city council", "a young doctor", "the bakery", "the storm", "a curious child", "the orchestra",
)
_VERBS = (
    "repaired", "crossed", "described", "watched", "followed", "measured", "painted", "carried",
    "ignored", "visited", "planned", "explained", "opened", "finished", "remembered", "questioned",
)
_OBJECTS = (
    "the broken bridge", "a long letter", "the northern valley", "the evening train", "a map of the coast",
    "the village square", "an empty field", "the results of the survey", "a basket of apples",
    "the harbour lights", "the final chapter", "a narrow staircase", "the budget for next year",
)
_ENDINGS = (
    "before the sun went down", "with great care", "in the middle of winter", "without saying a word",
    "for the third time", "after a long discussion", "while the others slept", "as the rain began",
    "on the first day of the month", "because nobody else would", "in less than an hour",
)


def sentences(count: int, seed: int = 0) -> list[str]:
    """`count` seeded sentences of the form subject-verb-object-adverbial."""
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."
        out.append(s[0].upper() + s[1:])
    return out


def corpus_text(num_generated_sentences: int = 1500, seed: int = 0) -> str:
    """The hand-written paragraphs followed by generated paragraphs of eight sentences each."""
    gen = sentences(num_generated_sentences, seed)
    generated = [" ".join(gen[i:i + 8]) for i in range(0, len(gen), 8)]
    return "\n\n".join(PARAGRAPHS + tuple(generated))
