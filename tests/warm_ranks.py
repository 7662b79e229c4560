"""Recipe ranks forked from a process that has already imported torch, transformers and chattune.

A tiny recipe launch on CI's 2 cores spent most of its time importing: torchrun's agent (about 3.5 s) and
then each rank (about 7 s: torch, transformers' modeling code, torch.distributed.tensor, Hydra) before the
first step, for runs whose training takes a few seconds. Here a multiprocessing *forkserver* imports all of
that once per pytest worker, runs no torch computation (so no thread pool exists to be lost in a fork), and
forks one process per rank; each rank sets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR/PORT), its own stdout and stderr, and runs the recipe file as `__main__`, as
`python recipes/sft.py` would. The ranks are real processes joined by a real gloo group.

What it is not: torchrun. The launcher holds the group's key-value store, as torchrun's agent does (so a
rank's error note outlives the rank), but there is no elastic agent, no TORCHELASTIC_* variables beyond the
one that says so, no signal forwarding, no restarts; a rank that fails ends the others as torchrun's agent
does (SIGTERM, then SIGKILL 30 s later). `conftest.launch` uses it for `torchrun(...)` and `python RECIPE`
commands (the latter: one process, no torchrun environment) whose test reads what the run wrote or said;
the README's own torchrun launch, Hydra's multirun, and tests of signals, stops, launchers and their reports
run real torchrun (`real_torchrun=True`, or their own subprocess)."""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import runpy
import sys
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
RECIPES = ("sft", "dpo", "kto", "reward")
# Environment variables read when a module is imported (huggingface_hub's and transformers' constants, the
# cache directories): a rank forked from the preloaded server would not see a change. A launch that changes
# one goes through torchrun.
IMPORT_TIME_ENV_PREFIXES = (
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "TORCH",
    "PYTORCH",
    "XDG_",
    "OMP_",
    "MKL_",
    "PYTHON",
)
# Read when they are used, not at import: torch.compile reads TORCHDYNAMO_DISABLE at each call (torch/_dynamo/
# eval_frame.py's `optimize`), and torchao compiles its optimizer step at the step.
CALL_TIME_ENV = frozenset({"TORCHDYNAMO_DISABLE"})
# What the forkserver's environment holds before it imports anything (tests launch with the hub offline).
SERVER_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

_context: multiprocessing.context.BaseContext | None = None
_preloaded_in: int | None = None  # the pid of the process that ran `preload` (the forkserver)


def preload() -> None:
    """Import what every recipe imports (the recipe files themselves, as modules that do not run `main`), and
    the modeling code of the tests' tiny models. Runs in the forkserver, once."""
    global _preloaded_in
    _preloaded_in = os.getpid()
    for recipe in RECIPES:
        spec = importlib.util.spec_from_file_location(f"_preloaded_{recipe}", PROJECT_ROOT / "recipes" / f"{recipe}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    import peft  # noqa: F401  (transformers.optimization, the schedulers' module, imports it through trainer_utils)
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401
    import transformers.optimization  # noqa: F401
    import transformers.quantizers.auto  # noqa: F401  (imports torchao, where installed: 2 s, at every model build)


if os.environ.get("CHATTUNE_WARM_RANKS_SERVER") == "1":  # imported as the forkserver's preload
    preload()


def context() -> multiprocessing.context.BaseContext:
    """The forkserver context, its server started (once per process) with this module preloaded."""
    global _context
    if _context is None:
        saved = {name: os.environ.get(name) for name in [*SERVER_ENV, "CHATTUNE_WARM_RANKS_SERVER", "PYTHONPATH"]}
        # Python 3.11's forkserver does not apply the sys.path it is given before importing what it preloads, and
        # it passes over a module that does not import: this directory goes on its path through PYTHONPATH.
        path = os.pathsep.join(p for p in (str(Path(__file__).parent), saved["PYTHONPATH"]) if p)
        os.environ.update(SERVER_ENV, CHATTUNE_WARM_RANKS_SERVER="1", PYTHONPATH=path)
        try:
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload([__name__])
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    return _context


def can_launch(env_extra: dict[str, str]) -> bool:
    """Whether a launch with these extra environment variables can run on the preloaded server."""
    return not any(
        name.startswith(IMPORT_TIME_ENV_PREFIXES) and name not in CALL_TIME_ENV and SERVER_ENV.get(name) != value
        for name, value in env_extra.items()
    )


def _rank(recipe: str, argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """One rank, in a process forked from the server: torchrun's environment, its own output files, the
    recipe run as `python RECIPE ARGV...` would run it."""
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    if _preloaded_in in (None, os.getpid()):  # this rank imported everything itself: the server preloaded nothing
        raise RuntimeError("warm_ranks: the forkserver did not preload this module (see `context`)")
    # A forkserver's child has the forkserver start method as its default; a process torchrun starts has the
    # platform's (fork on Linux), which the recipe's loader workers use.
    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [recipe, *argv]
    sys.path[0] = str(Path(recipe).resolve().parent)
    runpy.run_path(recipe, run_name="__main__")


def with_environment(rank: int, env: dict[str, str], fn, *args) -> None:
    """`fn(rank, *args)` in a worker forked from the server, with the environment of the test that started it
    (as a spawned worker inherits it; the server's own is that of the first launch) and fork as the default
    start method (as in a spawned worker)."""
    multiprocessing.set_start_method(None, force=True)
    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def launch(
    recipe: str, argv: list[str], nproc: int | None, env: dict[str, str], cwd: Path, logs: Path, timeout: float
) -> tuple[int, str, str]:
    """Run `recipe` on `nproc` ranks from `cwd` (None: one process without torchrun's environment, as `python
    RECIPE` runs); (exit status, stdout, stderr), each rank's output in rank order (each rank's files under
    `logs`, an existing directory). A rank that fails ends the others, as torchrun's agent does."""
    import torch.distributed as dist

    ctx = context()
    # The group's key-value store lives here, in the launcher, as torchrun's agent holds it: it outlives any rank,
    # so a rank that reports an error and exits leaves its note for the others (chattune.errors).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if nproc else None
    processes, files = [], []
    for rank in range(nproc or 1):
        launcher_env = (
            {}
            if nproc is None
            else {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(store.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
            }
        )
        out, err = logs / f"rank{rank}.out", logs / f"rank{rank}.err"
        files.append((out, err))
        process = ctx.Process(target=_rank, args=(recipe, argv, str(cwd), {**env, **launcher_env}, str(out), str(err)))
        process.start()
        processes.append(process)
    deadline = time.monotonic() + timeout
    status, killed_at, timed_out = 0, None, False
    while any(p.is_alive() for p in processes):
        failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
        if failed and killed_at is None:
            status, killed_at = failed[0], time.monotonic()
            for p in processes:
                p.terminate()  # a no-op on a finished process
        timed_out = time.monotonic() > deadline
        if timed_out or killed_at is not None and time.monotonic() - killed_at > 30:
            for p in processes:
                p.kill()
        time.sleep(0.05)
    for p in processes:
        p.join()
    del store  # its server stops with the last rank
    status = status or next((p.exitcode for p in processes if p.exitcode), 0) or (-9 if timed_out else 0)
    stdout = "".join(out.read_text(errors="replace") for out, _ in files if out.exists())
    stderr = "".join(err.read_text(errors="replace") for _, err in files if err.exists())
    if timed_out:
        stderr += f"\nwarm_ranks: killed after {timeout:.0f} s\n"
    return status, stdout, stderr
