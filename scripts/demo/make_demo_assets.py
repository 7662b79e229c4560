"""Generate chattune's demo assets: a synthetic chat dataset, preference pairs and a byte-level BPE tokenizer.

Deterministic (fixed seed): running it twice gives identical files. The outputs are committed under
`chattune/assets/demo/` so the default recipe needs no network and no generation step:

    python scripts/demo/make_demo_assets.py            # rewrites chattune/assets/demo/

The tasks (arithmetic, sorting, counting, string edits, with multi-turn follow-ups) are ones a tiny
model can learn to measurable accuracy in minutes, so a falling loss means something. The preference
pairs (for DPO) share the context of a conversation and differ in its final reply: the correct one is
chosen, a plausibly wrong one (a number off by a little, two characters swapped) rejected.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

DEMO_DIR = Path(__file__).resolve().parents[2] / "chattune" / "assets" / "demo"

# ChatML. Assistant turns end with <|im_end|>, which is also the tokenizer's eos (generation stops there).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a concise assistant. Answer with the result only when you can.",
    "You are a careful tutor who checks every step.",
]
SYLLABLES = ["ka", "lo", "mi", "ta", "ne", "ru", "pi", "so", "de", "fa", "gu", "ber", "lin", "mor", "tes"]


def make_word(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 4)))


def arithmetic_chain(rng: random.Random) -> list[tuple[str, str]]:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    op = rng.choice(["+", "-", "*"])
    if op == "*":
        b = rng.randint(2, 9)
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    turns = [(f"What is {a} {op} {b}?", f"{a} {op} {b} = {result}.")]
    for _ in range(rng.randint(0, 2)):
        n = rng.randint(1, 20)
        if rng.random() < 0.5:
            turns.append((f"Now add {n} to the result.", f"{result} + {n} = {result + n}."))
            result += n
        else:
            turns.append((f"Now subtract {n} from the result.", f"{result} - {n} = {result - n}."))
            result -= n
    return turns


def sorting(rng: random.Random) -> list[tuple[str, str]]:
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 8))]
    turns = [
        (
            f"Sort these numbers in ascending order: {', '.join(map(str, numbers))}",
            ", ".join(map(str, sorted(numbers))),
        )
    ]
    if rng.random() < 0.4:
        turns.append(("And in descending order?", ", ".join(map(str, sorted(numbers, reverse=True)))))
    return turns


def counting(rng: random.Random) -> list[tuple[str, str]]:
    word = make_word(rng)
    letter = rng.choice(sorted(set(word)))
    count = word.count(letter)
    turns = [
        (
            f"How many times does the letter '{letter}' appear in '{word}'?",
            f"The letter '{letter}' appears {count} time{'s' if count != 1 else ''} in '{word}'.",
        )
    ]
    if rng.random() < 0.3:
        turns.append((f"How many letters does '{word}' have?", f"'{word}' has {len(word)} letters."))
    return turns


def string_edit(rng: random.Random) -> list[tuple[str, str]]:
    word = make_word(rng)
    edits = [
        (f"Reverse the word '{word}'.", word[::-1]),
        (f"Write '{word}' in uppercase.", word.upper()),
        (f"Remove the vowels from '{word}'.", "".join(c for c in word if c not in "aeiou")),
        (f"What is the first letter of '{word}'?", f"The first letter of '{word}' is '{word[0]}'."),
    ]
    rng.shuffle(edits)
    return edits[: rng.randint(1, 3)]


TASKS = [arithmetic_chain, sorting, counting, string_edit]


def make_conversation(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
    for _ in range(rng.choice([1, 1, 1, 2])):  # sometimes two tasks in one conversation
        for question, answer in rng.choice(TASKS)(rng):
            messages.append({"role": "user", "content": question})
            messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def corrupt(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: the last number changed a little, or else two characters swapped."""
    digits = [i for i, c in enumerate(answer) if c.isdigit()]
    if digits:
        end = digits[-1] + 1
        start = end
        while start > 0 and answer[start - 1].isdigit():
            start -= 1
        wrong = int(answer[start:end]) + rng.choice([-3, -2, -1, 1, 2, 3])
        return answer[:start] + str(abs(wrong)) + answer[end:] if abs(wrong) != int(answer[start:end]) else answer + "0"
    letters = [i for i in range(len(answer) - 1) if answer[i] != answer[i + 1] and answer[i].isalpha()]
    if not letters:
        return answer + answer[-1:]
    i = rng.choice(letters)
    return answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]


def make_preference_pair(rng: random.Random) -> dict:
    """{prompt: the conversation up to its last user turn, chosen/rejected: one assistant message each}."""
    messages = make_conversation(rng)["messages"]
    answer = messages[-1]["content"]
    return {
        "prompt": messages[:-1],
        "chosen": [{"role": "assistant", "content": answer}],
        "rejected": [{"role": "assistant", "content": corrupt(answer, rng)}],
    }


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    # Digits one by one: arithmetic is learnable when 57 and 75 share their digit tokens.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    return hf_tokenizer


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEMO_DIR)
    parser.add_argument("--num-train", type=int, default=4000)
    parser.add_argument("--num-eval", type=int, default=200)
    parser.add_argument("--num-pairs", type=int, default=2000)
    parser.add_argument("--num-eval-pairs", type=int, default=200)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    train = [make_conversation(rng) for _ in range(args.num_train)]
    # Held out means never seen: short tasks repeat by chance, so skip any conversation already in train.
    seen = {json.dumps(c["messages"]) for c in train}
    held_out = []
    while len(held_out) < args.num_eval:
        conversation = make_conversation(rng)
        if json.dumps(conversation["messages"]) not in seen:
            seen.add(json.dumps(conversation["messages"]))
            held_out.append(conversation)
    for i, conversation in enumerate(train + held_out):
        conversation["id"] = f"demo-{i:05d}"

    args.out.mkdir(parents=True, exist_ok=True)
    write_jsonl(args.out / "chat_train.jsonl", train)
    write_jsonl(args.out / "chat_eval.jsonl", held_out)

    # Preference pairs from their own random stream: adding them left the chat files unchanged.
    pair_rng = random.Random(args.seed + 1)
    pairs = [make_preference_pair(pair_rng) for _ in range(args.num_pairs + args.num_eval_pairs)]
    for i, pair in enumerate(pairs):
        pair["id"] = f"demo-pair-{i:05d}"
    write_jsonl(args.out / "preference_train.jsonl", pairs[: args.num_pairs])
    write_jsonl(args.out / "preference_eval.jsonl", pairs[args.num_pairs :])

    # Train on role-headed turns so the role names ChatML renders become single tokens too.
    texts = [f"{m['role']}\n{m['content']}" for c in train for m in c["messages"]]
    tokenizer = train_tokenizer(texts, args.vocab_size)
    tokenizer.save_pretrained(str(args.out / "tokenizer"))
    print(
        f"wrote {len(train)} train / {len(held_out)} eval conversations and a {len(tokenizer)}-token tokenizer to {args.out}"
    )


if __name__ == "__main__":
    main()
