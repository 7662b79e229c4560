"""The GRPO demo's verifiable task: sort a few numbers, ascending or (in a second turn) descending, as the SFT demo's
chats ask. Its prompts ship with the demo data (`chattune/assets/demo/sort_prompts.jsonl`, written by `write_prompts`
and checked against it by the tests); `sorted_numbers` is its verifier.

The reward gives partial credit, so that a tiny model that rarely sorts a list whole still sees which of its samples
were better: half for the share of neighbouring numbers in the asked order, half for how much of the prompt's
numbers the reply holds (a multiset F1). It is 1 exactly for the sorted list, 0 for a reply that is no list of
integers. The SFT demo's model writes lists of the right form with the wrong numbers in no particular order; GRPO
raises the reward within the demo's minutes (BENCHMARKS.md).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

INTEGER_LIST = re.compile(r"-?\d+(?:, -?\d+)*")
ORDERS = ("ascending", "descending")


def sort_score(reply: str, numbers: list[int], order: str) -> float:
    """The reward of one reply (the module docstring): 0.5 x ordered neighbours + 0.5 x multiset F1, 0 for no list."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    text = reply.strip()
    if not INTEGER_LIST.fullmatch(text):
        return 0.0
    values = [int(item) for item in text.split(", ")]
    pairs = list(zip(values, values[1:]))
    in_order = sum((a <= b) if order == "ascending" else (a >= b) for a, b in pairs) / len(pairs) if pairs else 0.0
    common = sum((Counter(values) & Counter(numbers)).values())
    f1 = 2 * common / (len(values) + len(numbers))
    return 0.5 * in_order + 0.5 * f1


def sorted_numbers(
    prompts: list, completions: list[str], completion_ids: list | None = None, *, numbers: list, order: list, **fields
) -> list[float]:
    """The demo's reward function: `sort_score` of each completion against its record's `numbers` and `order`."""
    return [sort_score(reply, list(values), how) for reply, values, how in zip(completions, numbers, order)]


def make_prompt(rng: random.Random) -> dict:
    """One record of the task: a user turn asking for the numbers sorted ascending, or that turn answered and a
    second asking for them descending (as the SFT demo's chats do); its `numbers`, `order` and `answer`."""
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
    ask = {"role": "user", "content": "Sort these numbers in ascending order: " + ", ".join(map(str, numbers))}
    ascending = ", ".join(map(str, sorted(numbers)))
    if rng.random() < 0.5:
        return {"messages": [ask], "numbers": numbers, "order": "ascending", "answer": ascending}
    messages = [
        ask,
        {"role": "assistant", "content": ascending},
        {"role": "user", "content": "And in descending order?"},
    ]
    descending = ", ".join(map(str, sorted(numbers, reverse=True)))
    return {"messages": messages, "numbers": numbers, "order": "descending", "answer": descending}


def write_prompts(path: Path, count: int = 1000, seed: int = 0) -> None:
    """The demo's prompts file: `count` records of `make_prompt`, one JSON line each."""
    rng = random.Random(seed)
    Path(path).write_text("".join(json.dumps(make_prompt(rng)) + "\n" for _ in range(count)))


if __name__ == "__main__":  # python -m chattune.rl.demo_task PATH: writes the shipped prompts file again
    import sys

    write_prompts(Path(sys.argv[1]))
