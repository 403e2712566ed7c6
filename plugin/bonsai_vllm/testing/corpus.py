"""A small, deterministic text corpus for tiny test models.

The tiny models have to be trained on *something*: a byte-level BPE tokenizer needs text to learn merges
from, and a short training run (used where a test wants decisive greedy predictions) needs text whose next
token is easy to predict. The corpus is generated, not downloaded, so it exists offline and is identical on
every machine.
"""

from __future__ import annotations

import random

_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
            "eleven", "twelve"]
_DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
_MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
           "October", "November", "December"]
_COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
_ANIMALS = ["cat", "dog", "bird", "fish", "horse", "rabbit", "fox", "owl"]
_JA_NUMBERS = ["一", "二", "三", "四", "五", "六", "七", "八", "九", "十"]
_JA_DAYS = ["月曜日", "火曜日", "水曜日", "木曜日", "金曜日", "土曜日", "日曜日"]


def _sentences(rng: random.Random) -> list[str]:
    out: list[str] = []
    for i in range(len(_DAYS)):
        out.append(f"After {_DAYS[i]} comes {_DAYS[(i + 1) % 7]}.")
        out.append(f"{_JA_DAYS[i]}の次は{_JA_DAYS[(i + 1) % 7]}です。")
    for i in range(len(_MONTHS)):
        out.append(f"The month after {_MONTHS[i]} is {_MONTHS[(i + 1) % 12]}.")
    for i in range(len(_NUMBERS) - 1):
        out.append(f"{_NUMBERS[i]} plus one is {_NUMBERS[i + 1]}.")
    for i in range(len(_JA_NUMBERS) - 1):
        out.append(f"{_JA_NUMBERS[i]}の次は{_JA_NUMBERS[i + 1]}。")
    for _ in range(64):
        colour, animal = rng.choice(_COLOURS), rng.choice(_ANIMALS)
        out.append(f"The {colour} {animal} sleeps under the {rng.choice(_COLOURS)} tree.")
    out.append("Counting: " + " ".join(_NUMBERS) + ".")
    # A long fixed sequence: a trained tiny model continues it decisively for dozens of tokens.
    out.append("Counting up: " + " ".join(str(i) for i in range(1, 70)) + ".")
    out.append("Days: " + ", ".join(_DAYS) + ".")
    out.append("def add(a, b):\n    return a + b\n")
    out.append('{"model": "bonsai", "messages": [{"role": "user", "content": "hello"}]}')
    return out


def corpus(seed: int = 0, repeats: int = 4) -> list[str]:
    """Lines of text; the same for the same (seed, repeats)."""
    rng = random.Random(seed)
    lines: list[str] = []
    for _ in range(repeats):
        block = _sentences(rng)
        rng.shuffle(block)
        lines.extend(block)
    return lines
