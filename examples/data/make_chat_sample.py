"""Writes examples/data/chat_sample.jsonl: 200 small made-up conversations in Megatron-LM's SFT format (one JSON object
per line with a "messages" list of system/user/assistant turns; some lines hold two conversations, each starting
with a system turn). Deterministic: `python examples/data/make_chat_sample.py` rewrites the same bytes."""
from __future__ import annotations

import json
import random
from pathlib import Path

SYSTEMS = ["You are a helpful assistant.", "Answer briefly.", "You are a patient math tutor.",
           "Reply in one sentence."]
COLORS = {"grass": "green", "the sky": "blue", "snow": "white", "a ripe banana": "yellow", "coal": "black"}
WORDS = ["apple", "river", "stone", "garden", "window", "planet", "music", "forest", "candle", "bridge"]


def _arithmetic(rng: random.Random) -> list[dict]:
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
    turns = [{"role": "user", "content": f"What is {a} plus {b}?"},
             {"role": "assistant", "content": f"{a} plus {b} is {a + b}."}]
    if rng.random() < 0.6:
        turns += [{"role": "user", "content": f"And times {c}?"},
                  {"role": "assistant", "content": f"{a + b} times {c} is {(a + b) * c}."}]
    return turns


def _color(rng: random.Random) -> list[dict]:
    thing = rng.choice(sorted(COLORS))
    return [{"role": "user", "content": f"What color is {thing}?"},
            {"role": "assistant", "content": f"Usually {thing} is {COLORS[thing]}."}]


def _spell(rng: random.Random) -> list[dict]:
    word = rng.choice(WORDS)
    turns = [{"role": "user", "content": f"Spell the word {word} backwards."},
             {"role": "assistant", "content": f"Backwards, {word} is {word[::-1]}."}]
    if rng.random() < 0.5:
        turns += [{"role": "user", "content": "How many letters does it have?"},
                  {"role": "assistant", "content": f"It has {len(word)} letters."}]
    return turns


def _story(rng: random.Random) -> list[dict]:
    words = rng.sample(WORDS, 4)
    story = " ".join(f"There was a {w} near the {v}." for w, v in zip(words, reversed(words)))
    return [{"role": "user", "content": f"Tell a very short story about a {words[0]}."},
            {"role": "assistant", "content": story * rng.randint(1, 3)}]


def conversation(rng: random.Random) -> list[dict]:
    """One conversation: a system turn, then one or two user/assistant exchanges."""
    kind = rng.choice([_arithmetic, _color, _spell, _story])
    return [{"role": "system", "content": rng.choice(SYSTEMS)}, *kind(rng)]


def main() -> None:
    rng = random.Random(39)
    lines = []
    for _ in range(200):
        messages = conversation(rng)
        if rng.random() < 0.25:  # two conversations on one line
            messages += conversation(rng)
        lines.append(json.dumps({"messages": messages}))
    Path(__file__).with_name("chat_sample.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
