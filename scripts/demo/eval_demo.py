"""Accuracy of a trained demo model on the held-out demo chats, per task.

    python scripts/demo/eval_demo.py outputs/sft-tiny/hf [--limit 100]

- token accuracy: teacher-forced, the share of assistant tokens (the trained ones, end of turn included)
  that are the model's top prediction;
- exact match: every assistant turn generated greedily from the true conversation before it, compared
  with the reference reply as a whole.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from chattune.data.documents import IGNORE_INDEX, shifted_labels
from chattune.data.templates.chat_template import probe_template, tokenize_conversation

EVAL_FILE = Path(__file__).resolve().parents[2] / "chattune" / "assets" / "demo" / "chat_eval.jsonl"


def task_of(question: str) -> str:
    if question.startswith(("What is the first", "Reverse", "Write", "Remove")):
        return "string edit"
    if question.startswith(("What is", "Now add", "Now subtract")):
        return "arithmetic"
    if question.startswith(("Sort", "And in descending")):
        return "sorting"
    return "counting"


@dataclass
class TaskAccuracy:
    """One task's figures: trained tokens predicted right (teacher-forced) and replies generated right, of how many."""

    tokens_right: int = 0
    tokens: int = 0
    replies_right: int = 0
    replies: int = 0


def demo_accuracy(model_dir: Path, limit: int = 100) -> dict[str, TaskAccuracy]:
    """Per task, and "all": the accuracy of the model in `model_dir` on the first `limit` held-out demo chats."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    conversations = [json.loads(line)["messages"] for line in EVAL_FILE.read_text().splitlines()[:limit]]
    markers = probe_template(tokenizer)
    tasks: defaultdict[str, TaskAccuracy] = defaultdict(TaskAccuracy)
    for messages in conversations:
        tokenized = tokenize_conversation(tokenizer, messages, markers)
        labels = torch.tensor(shifted_labels(tokenized.input_ids, tokenized.assistant_mask))
        with torch.no_grad():
            predictions = model(input_ids=torch.tensor([tokenized.input_ids])).logits[0].argmax(-1)
        trained = (labels != IGNORE_INDEX).tolist()
        # Contiguous runs of trained positions are the assistant turns, in order.
        turn_starts = [i for i, t in enumerate(trained) if t and (i == 0 or not trained[i - 1])]
        questions = [messages[i - 1]["content"] for i, m in enumerate(messages) if m["role"] == "assistant"]
        for position, is_trained in enumerate(trained):
            if is_trained:
                task = tasks[task_of(questions[sum(start <= position for start in turn_starts) - 1])]
                task.tokens += 1
                task.tokens_right += int(predictions[position] == labels[position])

    for messages in conversations:
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, return_tensors="pt")
            with torch.no_grad():
                output = model.generate(
                    **prompt, max_new_tokens=48, do_sample=False, eos_token_id=tokenizer.eos_token_id
                )
            reply = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
            task = tasks[task_of(messages[i - 1]["content"])]
            task.replies += 1
            task.replies_right += reply.strip() == message["content"].strip()
    every = TaskAccuracy(*(sum(getattr(t, f.name) for t in tasks.values()) for f in fields(TaskAccuracy)))
    return {**dict(sorted(tasks.items())), "all": every}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--limit", type=int, default=100, help="held-out conversations to use")
    args = parser.parse_args()
    print(f"{'task':12s} {'token accuracy':>16s} {'exact match':>20s}")
    for name, task in demo_accuracy(args.model_dir, args.limit).items():
        tc, tt, ec, et = task.tokens_right, task.tokens, task.replies_right, task.replies
        print(f"{name:12s} {tc / tt:8.1%} ({tc:>5d}/{tt:<5d}) {ec / et:8.1%} ({ec:>4d}/{et:<4d})")


if __name__ == "__main__":
    main()
