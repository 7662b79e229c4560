"""The suite's reference runs: launches that many tests assert on, in one table (as torchtitan's
integration_tests/features.py), each made once per test session by whichever xdist worker asks first
(`conftest.made_once`; another that asks meanwhile waits for it) and only read by the tests (a test that continues
one copies its checkpoint into a directory of its own first).

A run's command is all here: its recipe, ranks and every override (its model's keys among them; `{data:NAME}` is
the path of the data file DATA[NAME] makes, once per session too), the environment it adds, and lines its log must
hold or lack (the layout it ran on, the levers it used), checked when it is made. The tests that interrupt, resume or
relaunch such a run build their own commands from the same overrides (`command_keys`), so what they compare with
is what they would have launched."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chattune.config.paths import DEMO_ASSETS
from conftest import SMALL_MODEL, launch, made_once, torchrun


def _demo_chats(count: int) -> Callable[[Path], None]:
    def write(path: Path) -> None:
        lines = (DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines(keepends=True)[:count]
        path.write_text("".join(lines))

    return write


# Data files the runs read, by name: written once per session, at one path (a run's data fingerprint names it, so a
# resume of a reference run must read the same file).
DATA: dict[str, Callable[[Path], None]] = {"chats-60": _demo_chats(60)}


@dataclass(frozen=True)
class ReferenceRun:
    recipe: str  # sft, dpo, kto, reward
    nproc: int
    overrides: tuple[str, ...]  # every key but output_dir
    what: str  # what the tests read of it
    env: tuple[tuple[str, str], ...] = ()  # variables the launch adds
    log_holds: tuple[str, ...] = ()  # lines its log must hold (stdout and stderr)
    log_lacks: tuple[str, ...] = ()  # and must not
    default_model: bool = False  # it trains the recipe's own model on purpose (conftest.launch)


# The resume tests' run (tests/e2e/test_resume.py): 8 steps over ~3 epochs of 60 chats (epochs end mid-run, with
# ranks waiting for each other), a checkpoint every 3 steps.
RESUME_KEYS = (
    *SMALL_MODEL,
    "max_steps=8",
    "save_every=3",
    "log_every=1",
    "data.train=[{data:chats-60}]",
    "data.eval=[]",
    "grad_accum_steps=2",
    "data.max_tokens_per_microbatch=512",
    "data.buffer_records=16",
    "data.report_records=0",
)

# The layouts' runs (tests/e2e/test_mesh_layouts.py): SFT for 6 steps of 4 microbatches on 4 ranks, world-size
# invariant, checkpointed at steps 3 and 6. Each layout's run's first `log_holds` line is the mesh it ran on.
MESH_STEPS = 6
MESH_KEYS = (
    *SMALL_MODEL,
    f"max_steps={MESH_STEPS}",
    "log_every=1",
    "eval_every=0",
    "save_every=3",
    "data.eval=[]",
    "data.microbatches_per_step=4",
    "data.max_tokens_per_microbatch=512",
    "data.num_workers=0",
)
TP_LOSS = "loss: chunked fp32 head (its vocabulary split over 2 ranks)"  # the compute: line under tensor parallelism

# The low-bit optimizer's runs (tests/unit/train/test_low_bit_optimizer.py): sft/tiny's own model (the documented
# tolerance was measured on it) for 30 steps, stepped eagerly (TORCHDYNAMO_DISABLE: torchao's step uncompiled, the
# same arithmetic to ~1e-6; torchao compiles its step once per shard shape, half of a compiled launch's time).
LOW_BIT_STEPS = 30
LOW_BIT_KEYS = (
    f"max_steps={LOW_BIT_STEPS}",
    "log_every=1",
    "eval_every=0",
    "eval.samples=0",
    "save_every=0",
    "data.microbatches_per_step=2",
    "data.max_tokens_per_microbatch=512",
    "optimizer.lr=1e-3",
)
EAGER = (("TORCHDYNAMO_DISABLE", "1"),)


def _low_bit(optimizer: str, nproc: int, *keys: str) -> ReferenceRun:
    name = optimizer.rsplit(".", 1)[-1]
    levers = (f"; levers: low-bit optimizer states ({name})",) if optimizer.startswith("torchao") else ()
    return ReferenceRun(
        "sft",
        nproc,
        (f"optimizer._target_={optimizer}", *LOW_BIT_KEYS, *keys),
        f"{name}'s {LOW_BIT_STEPS} step losses",
        env=EAGER,
        log_holds=levers,
        default_model=True,
    )


RUNS: dict[str, ReferenceRun] = {
    "resume-1-rank": ReferenceRun(
        "sft", 1, (*RESUME_KEYS, "data.num_workers=2"), "the uninterrupted run every interrupted one must equal"
    ),
    "resume-2-ranks": ReferenceRun(
        "sft", 2, (*RESUME_KEYS, "data.num_workers=2"), "the uninterrupted run every interrupted one must equal"
    ),
    "mesh-fsdp": ReferenceRun(
        "sft",
        4,
        MESH_KEYS,
        "plain FSDP's losses, its checkpoint and export",
        log_holds=("mesh: 4 ranks: dp_shard 4, parameters sharded over 4",),
        log_lacks=(TP_LOSS,),
    ),
    "mesh-hsdp": ReferenceRun(
        "sft",
        4,
        (*MESH_KEYS, "parallel.replicate=2"),
        "HSDP's losses, checkpoint and export",
        log_holds=("mesh: 4 ranks: dp_replicate 2 x dp_shard 2, parameters sharded over 2",),
        log_lacks=(TP_LOSS,),
    ),
    "mesh-tp": ReferenceRun(
        "sft",
        4,
        (*MESH_KEYS, "parallel.tensor=2"),
        "tensor parallelism's losses, checkpoint and export",
        log_holds=("mesh: 4 ranks: dp_shard 2 x tp 2, parameters sharded over 2", TP_LOSS),
    ),
    "mesh-tp-cp": ReferenceRun(
        "sft",
        4,
        (*MESH_KEYS, "parallel.tensor=2", "parallel.context=2", "data.max_tokens_per_microbatch=256"),  # the same rows
        "tensor x context parallelism's losses",
        log_holds=("mesh: 4 ranks: cp 2 x tp 2, parameters sharded over 2", TP_LOSS),
    ),
    "low-bit-fp32": _low_bit("torch.optim.AdamW", 2),
    # its step-5 checkpoint (an async save: DCP's stager cannot copy torchao's states itself,
    # chattune.checkpoint.staging) is what the resumes continue
    "low-bit-AdamW8bit": _low_bit("torchao.optim.AdamW8bit", 2, "save_every=5", "keep_last_n=null", "save_async=true"),
    # on 1 rank (the steps are world-size-invariant: the same data as fp32's 2): torchao compiles its step per shard
    # shape, most of a launch's time, once per rank
    "low-bit-AdamW4bit": _low_bit("torchao.optim.AdamW4bit", 1),
}


def reference_data(tmp_path_factory, name: str) -> Path:
    """The data file DATA[name] (`NAME.jsonl`), written once per session."""
    file = f"{name}.jsonl"
    return made_once(tmp_path_factory, f"data-{name}", lambda directory: DATA[name](directory / file)) / file


def command_keys(tmp_path_factory, keys: tuple[str, ...]) -> list[str]:
    """`keys` with each `{data:NAME}` written as that data file's path."""
    pattern = re.compile(r"\{data:([\w-]+)\}")
    return [pattern.sub(lambda m: str(reference_data(tmp_path_factory, m.group(1))), key) for key in keys]


def reference_run(tmp_path_factory, name: str) -> Path:
    """The output directory of RUNS[name], launched once per session (its log checked for `log_holds`)."""
    run = RUNS[name]

    def make(directory: Path) -> None:
        command = torchrun(
            run.recipe,
            *command_keys(tmp_path_factory, run.overrides),
            f"output_dir={directory / 'run'}",
            nproc=run.nproc,
        )
        result = launch(command, env_extra=dict(run.env), default_model=run.default_model)
        log = result.stdout + result.stderr
        missing, unwanted = [h for h in run.log_holds if h not in log], [h for h in run.log_lacks if h in log]
        assert not missing and not unwanted, f"reference run {name}: its log lacks {missing}, holds {unwanted}"

    return made_once(tmp_path_factory, f"reference-{name}", make) / "run"
