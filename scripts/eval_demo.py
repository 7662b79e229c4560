"""Exact-match accuracy of a trained demo model on the held-out demo chats, per task.

    python scripts/eval_demo.py outputs/sft-tiny/hf [--limit 100]

Every assistant turn is generated greedily from the true conversation before it and compared with the
reference reply, so this measures what the model learned, not only that the loss fell.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

EVAL_FILE = Path(__file__).resolve().parent.parent / "chattune" / "assets" / "demo" / "chat_eval.jsonl"


def task_of(question: str) -> str:
    if question.startswith(("What is the first", "Reverse", "Write", "Remove")):
        return "string edit"
    if question.startswith(("What is", "Now add", "Now subtract")):
        return "arithmetic"
    if question.startswith(("Sort", "And in descending")):
        return "sorting"
    return "counting"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--limit", type=int, default=100, help="held-out conversations to use")
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir).eval()
    conversations = [json.loads(line)["messages"] for line in EVAL_FILE.read_text().splitlines()[: args.limit]]
    correct, total = Counter(), Counter()
    for messages in conversations:
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True, return_tensors="pt")
            with torch.no_grad():
                output = model.generate(**prompt, max_new_tokens=48, do_sample=False, eos_token_id=tokenizer.eos_token_id)
            reply = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
            task = task_of(messages[i - 1]["content"])
            total[task] += 1
            correct[task] += reply.strip() == message["content"].strip()
    for task in sorted(total):
        print(f"{task:12s} {correct[task] / total[task]:6.1%}  ({correct[task]}/{total[task]})")
    print(f"{'all':12s} {sum(correct.values()) / sum(total.values()):6.1%}  ({sum(correct.values())}/{sum(total.values())})")


if __name__ == "__main__":
    main()
