"""Generate the small synthetic text corpus shipped with hp-trainer.

The corpus is written by this script alone (no third-party text), so it carries the project's own
license (Apache-2.0). It is a deterministic mix of short templated stories, simple facts and
counting/arithmetic lines: varied enough that a small language model's loss falls clearly within a
few hundred steps, small enough to ship (a few hundred KiB gzip-compressed).

Run from the repository root::

    .venv/bin/python packages/hp-trainer/scripts/make_corpus.py
"""

from __future__ import annotations

import argparse
import gzip
import random
from pathlib import Path

_NAMES = [
    "Ada",
    "Ben",
    "Cora",
    "Dev",
    "Elif",
    "Finn",
    "Gia",
    "Hugo",
    "Ines",
    "Jun",
    "Kai",
    "Lena",
    "Milo",
    "Nora",
    "Omar",
    "Pia",
    "Quin",
    "Rosa",
    "Sami",
    "Tara",
    "Uma",
    "Vik",
    "Wren",
    "Yara",
]
_ANIMALS = [
    "fox",
    "owl",
    "cat",
    "dog",
    "hare",
    "bear",
    "wolf",
    "duck",
    "goat",
    "horse",
    "mouse",
    "crow",
    "otter",
    "badger",
    "deer",
    "frog",
    "swan",
    "lamb",
    "seal",
    "whale",
]
_ADJECTIVES = [
    "little",
    "old",
    "brave",
    "quiet",
    "clever",
    "sleepy",
    "tall",
    "small",
    "happy",
    "curious",
    "gentle",
    "loud",
    "young",
    "wise",
    "shy",
    "bright",
    "tired",
    "kind",
    "proud",
    "lonely",
]
_PLACES = [
    "the river",
    "the forest",
    "the market",
    "the hill",
    "the village",
    "the lake",
    "the garden",
    "the library",
    "the harbor",
    "the meadow",
    "the bridge",
    "the old mill",
    "the school",
    "the bakery",
    "the mountain",
    "the station",
    "the beach",
    "the castle",
    "the farm",
    "the cave",
]
_OBJECTS = [
    "a red ball",
    "a blue kite",
    "an old map",
    "a small key",
    "a warm coat",
    "a loaf of bread",
    "a wooden box",
    "a silver coin",
    "a green apple",
    "a paper boat",
    "a long rope",
    "a lamp",
    "a book of songs",
    "a basket of eggs",
    "a broken clock",
    "a yellow hat",
    "a jar of honey",
]
_FEELINGS = ["happy", "sad", "tired", "hungry", "thirsty", "cold", "afraid", "proud", "calm"]
_REASONS = {
    "happy": "the sun was shining",
    "sad": "the rain would not stop",
    "tired": "the road had been long",
    "hungry": "it was time for dinner",
    "thirsty": "the day was hot",
    "cold": "the wind was strong",
    "afraid": "the night was dark",
    "proud": "the work was finished",
    "calm": "the water was still",
}
_WEATHER = ["sunny", "rainy", "windy", "cloudy", "snowy", "foggy", "warm", "cool"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_COLORS = ["red", "blue", "green", "yellow", "white", "black", "brown", "orange", "purple"]
_NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
    "twenty",
]
_FACTS = [
    "Water freezes when it is very cold.",
    "The sun rises in the east and sets in the west.",
    "A week has seven days.",
    "Bees make honey from the flowers they visit.",
    "Fish breathe through their gills.",
    "The moon goes around the earth.",
    "Plants need light and water to grow.",
    "A year has twelve months.",
    "Birds build nests in the spring.",
    "Snow melts when the weather turns warm.",
    "Rivers flow down to the sea.",
    "Owls hunt at night and sleep during the day.",
]


def _story(rng: random.Random) -> str:
    name = rng.choice(_NAMES)
    friend = rng.choice([n for n in _NAMES if n != name])
    adj = rng.choice(_ADJECTIVES)
    animal = rng.choice(_ANIMALS)
    place, place2 = rng.sample(_PLACES, 2)
    obj = rng.choice(_OBJECTS)
    feeling = rng.choice(_FEELINGS)
    day = rng.choice(_DAYS)
    weather = rng.choice(_WEATHER)
    lines = [
        f"On {day} the weather was {weather}.",
        f"{name} walked to {place} with a {adj} {animal}.",
        f"The {animal} was {feeling} because {_REASONS[feeling]}.",
    ]
    middle = [
        f"At {place} they met {friend}, who was carrying {obj}.",
        f'"Where are you going?" asked {friend}. "To {place2}," said {name}.',
        f"{friend} gave {obj} to {name}, and {name} said thank you.",
        f"The {adj} {animal} looked at {obj} and wagged its tail.",
        f"They sat down near {place2} and shared {obj}.",
        f"Later {name} and {friend} walked together to {place2}.",
    ]
    rng.shuffle(middle)
    lines.extend(middle[: rng.randint(2, 4)])
    end = rng.choice(
        [
            f"When the evening came, {name} went home and slept well.",
            f"At the end of the day the {animal} was no longer {feeling}.",
            f"{name} smiled, because it had been a good {day}.",
            f"And so {name} and the {animal} became good friends.",
        ]
    )
    lines.append(end)
    return " ".join(lines)


def _arithmetic(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(3, 6)):
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        if rng.random() < 0.5:
            parts.append(f"{_NUMBER_WORDS[a]} plus {_NUMBER_WORDS[b]} is {_NUMBER_WORDS[a + b]}.")
        else:
            hi, lo = max(a, b), min(a, b)
            parts.append(
                f"{_NUMBER_WORDS[hi]} minus {_NUMBER_WORDS[lo]} is {_NUMBER_WORDS[hi - lo]}."
            )
    return " ".join(parts)


def _counting(rng: random.Random) -> str:
    start = rng.randint(0, 10)
    n = rng.randint(4, 10)
    words = _NUMBER_WORDS[start : min(start + n, len(_NUMBER_WORDS))]
    thing = rng.choice(_ANIMALS)
    return f"Let us count the {thing}s: " + ", ".join(words) + "."


def _facts(rng: random.Random) -> str:
    color = rng.choice(_COLORS)
    obj = rng.choice(_OBJECTS)
    return " ".join(rng.sample(_FACTS, 3)) + f" My favorite color is {color}, so I keep {obj}."


def make_corpus(num_docs: int, seed: int) -> list[str]:
    """Return ``num_docs`` deterministic documents (one per line)."""
    rng = random.Random(seed)
    makers = [_story, _story, _story, _arithmetic, _counting, _facts]
    return [rng.choice(makers)(rng) for _ in range(num_docs)]


def main() -> None:
    """Write the corpus as gzip-compressed text, one document per line."""
    here = Path(__file__).resolve().parent.parent / "src" / "hp_trainer" / "assets"
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-docs", type=int, default=6000)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", type=Path, default=here / "tiny_stories_synth.txt.gz")
    args = parser.parse_args()
    docs = make_corpus(args.num_docs, args.seed)
    with gzip.GzipFile(args.out, "wb", mtime=0) as f:
        f.write(("\n".join(docs) + "\n").encode())
    print(f"wrote {len(docs)} documents to {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
