"""The GRPO demo's task under TRL's GRPOTrainer on this machine, beside chattune's recipe: the same SFT demo export, the
same prompts, reward, group size, completion budget, loss (dapo), learning rate and steps; seconds per optimizer step
and the reward each reaches (one run each, BENCHMARKS.md).

    python scripts/bench/bench_grpo_trl.py [--base outputs/sft-tiny/hf] [--steps 20] [--trl-path DIR]

TRL is no dependency of chattune: it is imported from its own folder (--trl-path, else $CHATTUNE_TRL_PATH, else
/work/trl-pkgs; `pip install --target DIR "trl==1.16.0" --no-deps`). TRL runs in this process on every core (one
process: its CPU path), chattune as README launches it (`torchrun --nproc_per_node 2`, one core a rank); each step of
both samples 16 prompts x 8 completions of up to 32 tokens at temperature 1 and takes one optimizer step on them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PROMPTS, GROUP, NEW_TOKENS, LR = 16, 8, 32, 5e-4


def chattune_run(base: Path, steps: int, directory: Path) -> dict:
    out = directory / "chattune"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "recipes/grpo.py"]
    command += [f"model.path={base}", f"output_dir={out}", f"max_steps={steps}", "log_every=1", "save_every=0"]
    started = time.monotonic()
    subprocess.run(command, cwd=PROJECT_ROOT, check=True, capture_output=True)
    wall = time.monotonic() - started
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "step_s": statistics.median(line["step_time_s"] for line in lines[2:]),
        "reward_start": statistics.fmean(line["reward/sorted_numbers"] for line in lines[:3]),
        "reward_end": statistics.fmean(line["reward/sorted_numbers"] for line in lines[-5:]),
        "wall_s": wall,
    }


def trl_run(base: Path, steps: int, directory: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from chattune.config.paths import DEMO_ASSETS
    from chattune.rl.demo_task import sort_score

    records = [json.loads(line) for line in (DEMO_ASSETS / "sort_prompts.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list(
        [{"prompt": r["messages"], "numbers": r["numbers"], "order": r["order"]} for r in records]
    )

    def sorted_numbers(completions, numbers, order, **kwargs):
        return [sort_score(c[-1]["content"], n, o) for c, n, o in zip(completions, numbers, order)]

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.times, self.last = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self.last)

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(directory / "trl"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        disable_tqdm=True,
        logging_steps=1,
        max_steps=steps,
        per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP,
        max_completion_length=NEW_TOKENS,
        temperature=1.0,
        top_k=0,
        loss_type="dapo",
        learning_rate=LR,
        lr_scheduler_type="cosine",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        beta=0.0,
        save_strategy="no",
        seed=42,
    )
    timer = StepTimes()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[sorted_numbers],
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    started = time.monotonic()
    trainer.train()
    wall = time.monotonic() - started
    rewards = [log["reward"] for log in trainer.state.log_history if "reward" in log]
    return {
        "step_s": statistics.median(timer.times[2:]),
        "reward_start": statistics.fmean(rewards[:3]),
        "reward_end": statistics.fmean(rewards[-5:]),
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", default="outputs/sft-tiny/hf")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trl-path", default=os.environ.get("CHATTUNE_TRL_PATH", "/work/trl-pkgs"))
    args = parser.parse_args()
    sys.path.append(args.trl_path)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    base = Path(args.base) if Path(args.base).is_absolute() else PROJECT_ROOT / args.base
    with tempfile.TemporaryDirectory() as directory:
        ours = chattune_run(base, args.steps, Path(directory))
        theirs = trl_run(base, args.steps, Path(directory))
    print(f"\n{args.steps} steps of {PROMPTS} prompts x {GROUP} completions (<= {NEW_TOKENS} tokens), dapo, lr {LR:g}")
    print("| | seconds a step (median) | reward: first 3 -> last 5 steps | wall s |")
    print("|---|---|---|---|")
    for name, f in (("chattune, torchrun 2 ranks", ours), ("TRL 1.16 GRPOTrainer, one process", theirs)):
        print(f"| {name} | {f['step_s']:.2f} | {f['reward_start']:.3f} -> {f['reward_end']:.3f} | {f['wall_s']:.0f} |")
    print(f"\nTRL's step over chattune's: {theirs['step_s'] / ours['step_s']:.2f}x")


if __name__ == "__main__":
    main()
