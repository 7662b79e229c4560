"""chattune's SFT step on one GPU, next to TRL's SFTTrainer on the same model, data and token budget.

    python scripts/bench/bench_gpu.py --assets ../shared/assets [--runs short06 short17 long06] [--steps 30]

Builds random-init Qwen3-shaped models (0.6B, 1.7B), and for `--runs gptoss gemma4` a gpt-oss-shaped MoE with
attention sinks (1B, 4 of 16 experts active) and a Gemma-4-shaped model with head size 512 on its global layers
(0.4B) (bf16 safetensors, the shared Qwen3 tokenizer), and the
benchmark corpora from the shared assets (20k short real chats; 200 long deita chats), under --work. Each
run trains `recipes/sft.py` (torchrun, one process) and, when `trl` is importable, TRL's SFTTrainer
(padding-free packing, sdpa) on the same model directory, corpus and per-step token budget. Prints one
markdown row per run and tool, and writes them as JSON to --work/results.json:
- tokens/s: every token fed, per device, over steps --warmup+1..--steps (chattune: its metrics.jsonl,
  `all_tokens_per_sec_per_device`; TRL: tokens counted in `training_step` over that window's wall time);
- MFU: chattune's own (`chattune.model.cost.flops`: matmuls and causal attention per document). TRL's is the
  same model FLOPs per token (same model and data) times its tokens/s;
- peak memory: torch's peak allocated (GiB) in each process.

`--budget SECONDS` (from the start): the runs in priority order (`PRIORITY`: short06 with its TRL run first,
then short17, long06, the other families), each chattune or TRL run only where its estimate (`ESTIMATES`:
start-up plus steps, rough H100 seconds; `--estimate-scale` multiplies them) fits the time left, a launch
stopped with all it started when the budget ends; it returns within SECONDS + 20, every item a row (a
"not run (budget: needs ~N s, M s left)" one where it did not fit) in the table and results.json, and prints
the second call (`--runs` the rest). A failed run is a row too; the exit status is 1 when one failed.
`--set KEY=VALUE` (repeatable) adds an override to the chattune runs. `--device cpu --runs tiny tiny_gptoss tiny_gemma4`
runs the chattune side on tiny models on the CPU (a check of this script).
On a machine without internet: `python scripts/gpu_carry.py` builds the folder of wheels (hydra, torchdata,
datasets, TRL, cut-cross-entropy) and assets to carry there, and prints the command that runs this script.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from chattune.launch.torchrun import torchrun_command

STARTED = time.monotonic()  # the budget counts from here: the process's imports are part of it
ROOT = Path(__file__).resolve().parents[2]  # the project: scripts/bench/ is two below it
SHAPES = {  # hidden, intermediate, layers, heads, kv heads (Qwen3's published configs; head_dim 128, tied)
    "tiny": (64, 128, 2, 4, 2),
    "0.6b": (1024, 3072, 28, 16, 8),
    "1.7b": (2048, 6144, 28, 16, 8),
}
# Other families, shaped like their published models but smaller (transformers' config keywords): gpt-oss (attention
# sinks on every layer, sliding windows of 128 on every other one, 4 of 16 experts with biases) and Gemma 4 (a global
# layer of head size 512 after every five sliding ones of 256: the layers the flash kernels cannot take).
FAMILIES = {
    "gptoss-1b": (
        "GptOssConfig",
        dict(
            hidden_size=1024,
            intermediate_size=1024,
            num_hidden_layers=12,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=16,
            num_experts_per_tok=4,
            sliding_window=128,
            tie_word_embeddings=False,
        ),
    ),
    "gemma4-0.4b": (
        "Gemma4TextConfig",
        dict(
            hidden_size=1024,
            intermediate_size=4096,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            global_head_dim=512,
            sliding_window=512,
            hidden_size_per_layer_input=0,
        ),
    ),
    "tiny-gptoss": (
        "GptOssConfig",
        dict(
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            tie_word_embeddings=False,
        ),
    ),
    "tiny-gemma4": (
        "Gemma4TextConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            global_head_dim=32,
            sliding_window=16,
            hidden_size_per_layer_input=0,
        ),
    ),
}
# name: (model, corpus, per-microbatch budget, grad_accum_steps, activation checkpointing)
RUNS = {
    "short06": ("0.6b", "short", 16384, 2, False),
    "short17": ("1.7b", "short", 16384, 2, True),
    "long06": ("0.6b", "long", 16384, 1, False),
    "gptoss": ("gptoss-1b", "short", 16384, 2, False),
    "gemma4": ("gemma4-0.4b", "long", 16384, 1, False),
    "tiny": ("tiny", "short", 2048, 1, False),
    "tiny_gptoss": ("tiny-gptoss", "short", 2048, 1, False),
    "tiny_gemma4": ("tiny-gemma4", "short", 2048, 1, False),
}


# Rough wall time of each item (seconds on one H100; the H200 is a little faster): (start-up, per step) for
# chattune's launch (model directory, torchrun, tokenizing, compiling the layers) and TRL's (model load,
# tokenizing the whole corpus with datasets, packing). chattune's short06 and long06 are the first GPU run's
# (2026-11-26, one H200: both in about 115 s at 30 steps) with a margin; short17 from gpu_check's 1.7B launch;
# TRL's and the other families' are still guesses from the baseline in ../shared/gpu/README.md. An item runs
# only where start-up + steps x per step is no more than the budget left.
ESTIMATES = {
    "short06": ((50, 1.0), (120, 3.0)),
    "short17": ((70, 2.0), (150, 4.5)),
    "long06": ((50, 1.0), (120, 2.0)),
    "gptoss": ((150, 3.0), (150, 5.0)),
    "gemma4": ((120, 2.0), (150, 3.0)),
    "tiny": ((25, 0.5), (60, 1.0)),
    "tiny_gptoss": ((25, 0.5), (60, 1.0)),
    "tiny_gemma4": ((25, 0.5), (60, 1.0)),
}
# Most valuable first: the 0.6B short run with TRL beside it, then the 1.7B, the long chats, the other families.
PRIORITY = ["short06", "short17", "long06", "gptoss", "gemma4", "tiny", "tiny_gptoss", "tiny_gemma4"]
BUDGET_MARGIN_S = 20  # a budgeted run returns within --budget plus this (a stopped launch's shutdown, the report)


CHILDREN: set[subprocess.Popen] = set()  # the launches running (run_bounded): a watchdog stops them


class OutOfBudget(BaseException):
    """An item stopped because the budget ran out (a BaseException, as KeyboardInterrupt: code that catches
    Exception, torch.compile's fallbacks among it, lets it through)."""


class Budget:
    """A wall-clock budget counted from the process's start (None: unlimited): what is left, whether an
    item's estimate fits in it, and the words of a row that did not run."""

    def __init__(self, seconds: float | None, started: float = STARTED, scale: float = 1.0):
        self.seconds, self.started, self.scale = seconds, started, scale

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (time.monotonic() - self.started)

    def fits(self, estimate: float) -> bool:
        """Never start an item whose estimate exceeds what is left (nor any once nothing is left)."""
        left = self.left()
        return left > 0 and estimate * self.scale <= left

    def not_run(self, estimate: float) -> str:
        return f"not run (budget: needs ~{estimate * self.scale:.0f} s, {max(0.0, self.left()):.0f} s left)"

    def timeout(self) -> float | None:
        """A child launch's timeout: what is left (None without a budget)."""
        return None if self.seconds is None else max(1.0, self.left())


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs (Linux /proc; elsewhere none)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        children = parents.get(queue.pop(), [])
        found += children
        queue += children
    return found


def stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM to a child started in a session of its own and everything in it (torchrun, which stops its
    workers), SIGKILL after 5 s to that group and to every process the child started (torchrun's workers run
    in sessions of their own)."""
    started = descendants(process.pid)
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            pass
        try:
            process.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:
            break
    for pid in started:  # what outlived its launcher
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def add_budget_arguments(parser: argparse.ArgumentParser, order: str) -> None:
    """--budget and --estimate-scale, as this script and gpu_check take them; `order`: what the budget does."""
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help=f"wall-clock budget from the start: {order}; returns within SECONDS + {BUDGET_MARGIN_S}",
    )
    parser.add_argument(
        "--estimate-scale",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="multiply every estimate (a slower card: above 1; 0 starts every item and lets the budget stop it)",
    )


def run_bounded(
    command: list[str], timeout: float | None, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs
) -> subprocess.CompletedProcess:
    """subprocess.run in a session of its own that, at `timeout` seconds, stops the child and all it started
    (subprocess.run's own timeout kills the child alone: torchrun's workers would go on holding the GPU)
    and raises OutOfBudget."""
    with subprocess.Popen(
        command, stdout=stdout, stderr=stderr, text=True, start_new_session=True, **kwargs
    ) as process:
        CHILDREN.add(process)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process_group(process)
            process.communicate()
            raise OutOfBudget(f"stopped by the budget after {timeout:.0f} s") from None
        except BaseException:
            stop_process_group(process)
            raise
        finally:
            CHILDREN.discard(process)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def rerun_command(script: str, argv: list[str], replaced: dict[str, list[str]]) -> str:
    """The command line `argv` with the options in `replaced` (e.g. --runs, --only) given the new values."""
    kept, skipping = [], False
    for argument in argv:
        if argument.startswith("--"):
            skipping = argument.split("=", 1)[0] in replaced
        if not skipping:
            kept.append(argument)
    for option, values in replaced.items():
        kept += [option, *values]
    return shlex.join([sys.executable, script, *kept])


def child_env() -> dict[str, str]:
    """The environment of the runs: this checkout first on PYTHONPATH (chattune need not be installed)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def make_corpora(assets: Path, out: Path) -> dict[str, Path]:
    """short: the FastChat chats replicated 40x (20k); long: the deita chats replicated 40x (200). Copy k
    appends " (#k)" to every user message, so no two conversations are identical."""
    paths = {"short": out / "fastchat_20k.jsonl", "long": out / "deita_long_200.jsonl"}
    if all(p.is_file() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    roles = {"human": "user", "gpt": "assistant", "system": "system", "user": "user", "assistant": "assistant"}
    fastchat = json.loads((assets / "data" / "sharegpt_fastchat_dummy.json").read_text())
    short = [[{"role": roles[m["from"]], "content": m["value"]} for m in c["conversations"]] for c in fastchat]
    import pyarrow.parquet as pq

    rows = pq.read_table(assets / "data" / "messages_deita_long.parquet").to_pylist()
    long = [[{"role": m["role"], "content": m["content"]} for m in r["messages"]] for r in rows]
    for name, conversations in (("short", short), ("long", long)):
        with open(paths[name], "w", encoding="utf-8") as f:
            for k in range(40):
                for messages in conversations:
                    copy = [
                        dict(m, content=f"{m['content']} (#{k})") if k and m["role"] == "user" else m for m in messages
                    ]
                    f.write(json.dumps({"messages": copy}, ensure_ascii=False) + "\n")
    return paths


def make_model(size: str, assets: Path, out: Path) -> Path:
    """A random-init model directory (bf16 safetensors and the shared Qwen3 tokenizer): Qwen3-shaped (SHAPES) or of
    another family (FAMILIES)."""
    directory = out / (f"qwen3-{size}" if size in SHAPES else size)
    if (directory / "config.json").is_file():
        return directory
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    tokens = dict(
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=40960,
        use_cache=False,
    )
    if size in SHAPES:
        hidden, intermediate, layers, heads, kv_heads = SHAPES[size]
        config = Qwen3Config(
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=128 if size != "tiny" else 16,
            tie_word_embeddings=True,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            **tokens,
        )
    else:
        name, settings = FAMILIES[size]
        extra = {"vocab_size_per_layer_input": len(tokenizer)} if name == "Gemma4TextConfig" else {}
        config = getattr(transformers, name)(**settings, **tokens, **extra)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def run_chattune(
    name: str, model_dir: Path, corpus: Path, args: argparse.Namespace, timeout: float | None = None
) -> dict:
    """`timeout`: seconds before the launch is stopped (OutOfBudget)."""
    size, _, budget, accum, checkpointing = RUNS[name]
    output_dir = args.work / f"chattune-{name}"
    command = [
        *torchrun_command(str(ROOT / "recipes" / "sft.py"), nproc=1),
        "--config-name",
        "sft/local_model",
        f"model.path={model_dir}",
        f"data.train=[{corpus}]",
        "data.eval=[]",
        f"output_dir={output_dir}",
        "overwrite=true",
        f"max_steps={args.steps}",
        "log_every=1",
        "save_every=0",
        "eval_every=0",
        f"device={args.device}",
        f"data.max_tokens_per_microbatch={budget}",
        f"grad_accum_steps={accum}",
        "data.num_workers=2",
        f"model.fsdp.activation_checkpointing={str(checkpointing).lower()}",
        "progress=lines",
        "data.report_records=0",
        *args.set,
    ]
    log = args.work / f"chattune-{name}.log"
    with open(log, "w") as out:
        code = run_bounded(command, timeout, stdout=out, stderr=subprocess.STDOUT, env=child_env()).returncode
    if code:
        raise SystemExit(f"chattune run {name} failed ({code}): see {log}")
    records = [json.loads(line) for line in open(output_dir / "metrics.jsonl")]
    steps = [
        r
        for r in records
        if isinstance(r.get("step"), int)
        and args.warmup < r["step"] <= args.steps
        and "all_tokens_per_sec_per_device" in r
    ]
    total_time = sum(r["step_time_s"] for r in steps)
    tokens = sum(r["all_tokens_per_sec_per_device"] * r["step_time_s"] for r in steps)
    mfu = [r["mfu"] for r in steps if "mfu" in r]
    return {
        "run": name,
        "tool": "chattune",
        "tokens_per_s": tokens / total_time,
        "mfu": sum(m * r["step_time_s"] for m, r in zip(mfu, steps)) / total_time if mfu else None,
        "peak_memory_gib": max((r.get("peak_memory_allocated_gib", 0.0) for r in steps), default=None),
        "first_loss": records[0].get("loss"),
        "last_loss": steps[-1].get("loss") if steps else None,
    }


def run_trl(
    name: str, model_dir: Path, corpus: Path, args: argparse.Namespace, timeout: float | None = None
) -> dict | None:
    if importlib.util.find_spec("trl") is None:
        print(f"trl is not importable: no TRL row for {name}", file=sys.stderr)
        return None
    _, _, budget, accum, checkpointing = RUNS[name]
    command = [
        sys.executable,
        __file__,
        "--trl-worker",
        str(model_dir),
        str(corpus),
        str(budget),
        str(accum),
        str(int(checkpointing)),
        str(args.steps),
        str(args.warmup),
    ]
    done = run_bounded(command, timeout, env=child_env())
    (args.work / f"trl-{name}.log").write_text(done.stderr)
    if done.returncode:
        raise SystemExit(f"TRL run {name} failed: see {args.work / f'trl-{name}.log'}")
    return {"run": name, "tool": "trl", **json.loads(done.stdout.strip().splitlines()[-1])}


def trl_worker(
    model_dir: str, corpus: str, budget: str, accum: str, checkpointing: str, steps: str, warmup: str
) -> None:
    """TRL's SFTTrainer: packing (BFD, padding-free), one bin per microbatch, bf16 autocast over fp32
    weights, sdpa attention, no eval or saving. Prints one JSON line."""
    import contextlib
    import tempfile

    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    dataset = datasets.Dataset.from_dict({"messages": [json.loads(line)["messages"] for line in open(corpus)]})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    counted, ends = {"tokens": 0}, {}

    class Clock(TrainerCallback):
        def on_step_end(self, trainer_args, state, control, **kwargs):
            torch.cuda.synchronize()
            ends[state.global_step] = (time.perf_counter(), counted["tokens"])

    class Counting(SFTTrainer):
        def training_step(self, model, inputs, *rest, **kwargs):
            counted["tokens"] += int(inputs["input_ids"].numel())
            return super().training_step(model, inputs, *rest, **kwargs)

    with tempfile.TemporaryDirectory() as tmp:
        config = SFTConfig(
            output_dir=tmp,
            max_length=int(budget),
            packing=True,
            per_device_train_batch_size=1,
            gradient_accumulation_steps=int(accum),
            max_steps=int(steps),
            bf16=True,
            gradient_checkpointing=checkpointing == "1",
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            dataset_num_proc=8,
            dataloader_num_workers=2,
            learning_rate=1e-5,
        )
        trainer = Counting(
            model=model, args=config, train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()]
        )
        torch.cuda.reset_peak_memory_stats()
        with contextlib.redirect_stdout(sys.stderr):
            trainer.train()
    (t0, k0), (t1, k1) = ends[int(warmup)], ends[int(steps)]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    print(
        json.dumps(
            {
                "tokens_per_s": (k1 - k0) / (t1 - t0),
                "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                "first_loss": losses[0] if losses else None,
                "last_loss": losses[-1] if losses else None,
            }
        )
    )


def estimate(name: str, tool: str, steps: int) -> float:
    """An item's estimated seconds (ESTIMATES) at `steps` steps."""
    start_up, per_step = ESTIMATES[name][tool == "trl"]
    return start_up + per_step * steps


def print_row(row: dict) -> None:
    if row["status"] != "ran":
        print(f"| {row['run']} | {row['tool']} | {row['status']} |  |  |  |", flush=True)
        return
    mfu = f"{row['mfu']:.1%}" if row.get("mfu") is not None else "n/a"
    memory = f"{row['peak_memory_gib']:.1f}" if row.get("peak_memory_gib") else "n/a"
    losses = " → ".join(f"{row[k]:.3f}" if row.get(k) is not None else "n/a" for k in ("first_loss", "last_loss"))
    print(f"| {row['run']} | {row['tool']} | {row['tokens_per_s']:,.0f} | {mfu} | {memory} | {losses} |", flush=True)


def main() -> int:
    if sys.argv[1:2] == ["--trl-worker"]:
        trl_worker(*sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assets", type=Path, default=ROOT.parent / "shared" / "assets")
    parser.add_argument("--work", type=Path, default=Path("/tmp/chattune-bench-gpu"))
    parser.add_argument("--runs", nargs="+", default=["short06", "short17", "long06"], choices=sorted(RUNS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the figures (compile, warm-up)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra override for the chattune runs (repeatable), e.g. --set model.compile=false",
    )
    add_budget_arguments(
        parser,
        "runs in priority order (short06 and its TRL run first), each only where its "
        "estimate fits what is left, a launch stopped when the budget runs out",
    )
    args = parser.parse_args()
    if not 1 <= args.warmup < args.steps:
        parser.error("--warmup must be at least 1 and below --steps")
    budget = Budget(args.budget, scale=args.estimate_scale)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.work.mkdir(parents=True, exist_ok=True)
    with_trl = not args.no_trl and args.device != "cpu" and importlib.util.find_spec("trl") is not None
    if not args.no_trl and args.device != "cpu" and not with_trl:
        print("trl is not importable: no TRL rows", file=sys.stderr)
    runs = sorted(dict.fromkeys(args.runs), key=PRIORITY.index)
    items = [(name, tool) for name in runs for tool in (("chattune", "trl") if with_trl else ("chattune",))]
    rows, ours, corpora, not_run = [], {}, None, []
    print(
        "| run | tool | tokens/s per device | MFU | peak memory (GiB) | loss first → last |\n|---|---|---|---|---|---|"
    )
    for name, tool in items:
        needed = estimate(name, tool, args.steps)
        if not budget.fits(needed):
            row = {"run": name, "tool": tool, "status": budget.not_run(needed)}
            not_run.append(name)
        else:
            try:
                size, corpus, *_ = RUNS[name]
                corpora = corpora or make_corpora(args.assets, args.work / "data")
                model_dir = make_model(size, args.assets, args.work / "models")
                run = run_chattune if tool == "chattune" else run_trl
                row = {**run(name, model_dir, corpora[corpus], args, budget.timeout()), "status": "ran"}
                if tool == "trl" and name in ours and ours[name]["mfu"] is not None:  # same model FLOPs per token
                    row["mfu"] = ours[name]["mfu"] * row["tokens_per_s"] / ours[name]["tokens_per_s"]
            except OutOfBudget as stopped:
                row = {"run": name, "tool": tool, "status": f"not finished ({stopped}; estimate ~{needed:.0f} s)"}
                not_run.append(name)
            except (Exception, SystemExit) as error:  # a failed run is a row; the others still run
                row = {"run": name, "tool": tool, "status": f"FAIL: {error}"[:300]}
        rows.append(row)
        print_row(row)
        if row["status"] == "ran" and tool == "chattune":
            ours[name] = row
        elif row["status"] == "ran" and name in ours:
            print(
                f"|  | chattune / TRL | {ours[name]['tokens_per_s'] / row['tokens_per_s']:.2f}× |  |  |  |", flush=True
            )
        (args.work / "results.json").write_text(json.dumps(rows, indent=1))  # after every item
    if not_run:
        print(
            "Not run within the budget; the second call:\n  "
            + rerun_command(__file__, sys.argv[1:], {"--runs": list(dict.fromkeys(not_run))}),
            flush=True,
        )
    return 1 if any(row["status"].startswith("FAIL") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
