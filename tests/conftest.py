"""Shared fixtures: the demo tokenizer, a tiny random Llama, and real demo documents."""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

# torch.compile's cache (inductor's default is /tmp/torchinductor_$USER, which the user's runs fill and read): one
# per test session, made by the process that starts xdist's workers (they inherit the variable), so that the
# session's launches share their compiled kernels as a user's runs do, and no test finds a user's.
if "CHATTUNE_TEST_SESSION_CACHES" not in os.environ:
    os.environ["CHATTUNE_TEST_SESSION_CACHES"] = tempfile.mkdtemp(prefix="chattune-test-session-")
    atexit.register(shutil.rmtree, os.environ["CHATTUNE_TEST_SESSION_CACHES"], ignore_errors=True)
# The user's caches are not the tests': Hugging Face's (read when huggingface_hub is imported, below) and those that
# follow XDG or matplotlib's variable go to a directory of this test process, removed at its end. It lies in the
# session's directory: a process a test spawns (multiprocessing imports conftest there) ends by os._exit, past
# atexit, and would leave its own in /tmp otherwise.
_CACHES = tempfile.mkdtemp(prefix="caches-", dir=os.environ["CHATTUNE_TEST_SESSION_CACHES"])
atexit.register(shutil.rmtree, _CACHES, ignore_errors=True)
os.environ.update(
    HF_HOME=os.path.join(_CACHES, "huggingface"),
    XDG_CACHE_HOME=os.path.join(_CACHES, "xdg"),
    MPLCONFIGDIR=os.path.join(_CACHES, "matplotlib"),
)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.environ["CHATTUNE_TEST_SESSION_CACHES"], "inductor")

import pytest  # noqa: E402  (after the caches are set)
import torch  # noqa: E402
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig  # noqa: E402

from chattune.config.paths import DEMO_ASSETS  # noqa: E402
from chattune.data.documents import IGNORE_INDEX, Document, shifted_labels  # noqa: E402
from chattune.data.templates.chat_template import probe_template, tokenize_conversation  # noqa: E402
from chattune.distributed import ParallelDims, free_port  # noqa: E402, F401  (free_port: re-exported for the tests)
from chattune.launch.torchrun import TORCHRUN, torchrun_command  # noqa: E402
from chattune.model.causal_lm import build_hf_model  # noqa: E402

# One torch thread per pytest-xdist worker: the workers already fill the cores, and each worker's default threads
# (one per core) would only wait for each other's (the tiny models' small matmuls: a subset of the architecture
# walk took 205 s on 2 cores with 2 threads per worker, 28 s with 1). Launched ranks set their own threads.
# The processes a test starts inherit the same (ranks through chattune's CHATTUNE_CPU_THREADS, other scripts through
# OpenMP's own variable): on two cores beside other workers' processes, 2 threads ran a tiny model's steps 1.5-3x
# slower than 1 (scripts/bench/bench_shared_cores.py; BENCHMARKS.md).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("CHATTUNE_CPU_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

PROJECT_ROOT = Path(__file__).resolve().parents[1]
SHARED_ASSETS = PROJECT_ROOT.parent / "shared" / "assets"

# The tree mirrors the package (tests/unit/<package>/, tests/distributed/ for spawned gloo ranks, tests/e2e/ for
# launches, tests/docs/, tests/scripts/; docs/install.md). A test module imports another's helpers by its name
# (`from test_sft_recipe import read_metrics`) wherever either lives, and so do the ranks it spawns (the forkserver
# hands them this path), so every folder of tests is on the path, not only the one pytest puts there.
for _folder in sorted({path.parent for path in Path(__file__).parent.rglob("test_*.py")}):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))


# --- the user's state: a test never sees what a user's own runs leave in the checkout (outputs/, Hydra's multirun/,
# wandb/), nor the user's caches. Each test runs from its own working directory, a copy of the checkout made of
# links to its files without that state, so that relative paths (recipes/sft.py, sft/tiny's outputs/sft-tiny,
# dpo/tiny's outputs/sft-tiny/hf) mean there what they mean in a fresh clone; a test that writes into the
# checkout's state anyway, or starts a process in the checkout itself, fails. ---

USER_STATE = ("outputs", "multirun", "wandb")  # what runs launched from the checkout write there (README's job)


# A step's metrics that time it (host and device clocks): two runs of the same steps differ in these alone
TIMING_METRICS = (
    "step_time_s",
    "tokens_per_sec",
    "all_tokens_per_sec",
    "all_tokens_per_sec_per_device",
    "mfu",
    "data_wait_s",
    "gc_s",
)


def checkout_copy(directory: Path, root: Path = PROJECT_ROOT) -> Path:
    """`directory` made a copy of the checkout at `root`: a link to each of its entries but the user's state."""
    directory.mkdir(parents=True, exist_ok=True)
    for entry in root.iterdir():
        if entry.name not in USER_STATE:
            (directory / entry.name).symlink_to(entry)
    return directory


def state_fingerprint(root: Path = PROJECT_ROOT) -> list[tuple[str, int, int]]:
    """Every file and folder of the user's state under `root` with its size and modification time."""
    found = []
    for name in USER_STATE:
        top = root / name
        paths = [top, *top.rglob("*")] if top.exists() else []
        for path in paths:
            stat = path.lstat()
            found.append((str(path.relative_to(root)), stat.st_size, stat.st_mtime_ns))
    return sorted(found)


def touched_state(before: list, after: list) -> list[str]:
    """The paths of the user's state that appeared, changed or went between two fingerprints."""
    return sorted({entry[0] for entry in set(before) ^ set(after)})


def _refuse_the_checkout(cwd) -> None:
    where = Path(cwd if cwd is not None else os.getcwd()).resolve()
    if where == PROJECT_ROOT or PROJECT_ROOT / "outputs" in (where, *where.parents):
        raise AssertionError(
            f"this test starts a process in {where}, where a user's runs leave their state: run it from the test's "
            "working directory (the default; conftest.checkout_copy)"
        )


@pytest.fixture(scope="session", autouse=True)
def _font_cache():
    """matplotlib's font list, built in this process's fresh cache before any test (building it runs fc-list)."""
    if importlib.util.find_spec("matplotlib") is not None:
        import matplotlib.font_manager  # noqa: F401


@pytest.fixture(scope="session", autouse=True)
def _session_work_dir(tmp_path_factory):
    """The working directory of what runs outside a test (module and session fixtures that launch): a copy of the
    checkout of its own, as each test has (`work_dir`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(checkout_copy(tmp_path_factory.mktemp("session_checkout")))
        yield


@pytest.fixture(autouse=True)
def work_dir(tmp_path_factory, monkeypatch) -> Path:
    """The test's working directory (its current directory): a copy of the checkout without the user's state."""
    directory = checkout_copy(tmp_path_factory.mktemp("checkout"))
    monkeypatch.chdir(directory)
    before = state_fingerprint()
    yield directory
    touched = touched_state(before, state_fingerprint())
    if touched:
        pytest.fail(f"this test wrote into the checkout's own state (tests never do): {', '.join(touched[:5])}")


# --- launches: the tests that start processes carry the `launch` marker (`pytest -m "not launch"` is the quick
# loop); a test without it that starts one fails, so the quick loop never pays for one by accident. ---


def _refuse_processes(*args, **kwargs):
    raise AssertionError("this test starts a process: mark it (or its module) with @pytest.mark.launch")


@pytest.fixture(autouse=True)
def _logging_as_it_was():
    """Each test leaves logging as it found it: a test of chattune.log's set-up (its basicConfig, the rank filter
    it adds to the handlers of the moment, which under pytest are pytest's own capture handlers, tqdm's redirect)
    made every later `caplog` of its xdist worker empty."""
    loggers = [logging.getLogger(), logging.getLogger("transformers")]
    saved = [(lg, lg.handlers, list(lg.handlers), lg.level, lg.propagate) for lg in loggers]
    filters = {handler: list(handler.filters) for lg in loggers for handler in lg.handlers}
    yield
    for lg, listed, handlers, level, propagate in saved:
        lg.handlers = listed  # the list object pytest's own capture adds to and removes from
        listed[:] = handlers
        lg.level, lg.propagate = level, propagate
    for handler, kept in filters.items():
        handler.filters[:] = kept


@pytest.fixture(autouse=True)
def _launches_are_marked(request, monkeypatch):
    if request.node.get_closest_marker("launch") is None:
        monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse_processes)
        monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse_processes)
    else:
        popen = subprocess.Popen.__init__

        def popen_elsewhere(self, *args, **kwargs):
            _refuse_the_checkout(kwargs.get("cwd"))
            popen(self, *args, **kwargs)

        monkeypatch.setattr(subprocess.Popen, "__init__", popen_elsewhere)
    yield


def torchrun(recipe: str, *overrides: str, nproc: int = 2) -> list[str]:
    """The command line `torchrun --nproc_per_node NPROC RECIPE OVERRIDES...` (recipe: `sft` or a path)."""
    path = recipe if recipe.endswith(".py") else f"recipes/{recipe}.py"
    return torchrun_command(path, *overrides, nproc=nproc, port=free_port())


def _warm_launch(command: list[str]) -> tuple[str, list[str], int | None] | None:
    """(recipe, its arguments, ranks) of a plain torchrun command (`torchrun(...)`'s form), or (recipe, its
    arguments, None) of `python RECIPE ...`; else None."""
    if len(command) > 1 and command[0] == sys.executable and command[1].endswith(".py"):
        return command[1], command[2:], None
    if tuple(command[:3]) != TORCHRUN or command[3] != "--nproc_per_node" or command[5] != "--master_port":
        return None
    recipe, arguments = command[7], command[8:]
    return (recipe, arguments, int(command[4])) if recipe.endswith(".py") else None


# The model a test launch trains, written in its command (`torchrun("sft", *SMALL_MODEL, ...)`): the recipes' tiny
# default (192 wide, 4 layers) steps 4x slower on CI's 2 cores, and a launch test checks what a run does (resumes,
# invariance, stops, files), which this one shows as well. A test whose figures were measured on the default, or
# that compares with a run started otherwise, keeps the default and says so (`launch(..., default_model=True)`).
SMALL_MODEL = (
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "model.config.num_attention_heads=4",
)
RECIPE_FILES = {"sft.py", "dpo.py", "kto.py", "reward.py", "grpo.py"}
OWN_MODEL = ("model.config._target_=", "model.config={", "--config-name", "-cn")  # (after any leading + or ~)


def names_a_model(command: list[str]) -> bool:
    """Whether `command` says which model it trains: it runs none of the four recipes, or it holds SMALL_MODEL's
    keys, another model class or whole model config, another config, or a model directory."""
    command = [str(a) for a in command]  # (subprocess takes paths too)
    if not any(Path(a).name in RECIPE_FILES for a in command):
        return True
    paths = [a.split("=", 1)[1] for a in command if a.startswith("model.path=")]
    own = any(a.lstrip("+~").startswith(OWN_MODEL) for a in command) or bool(paths and paths[-1] != "null")
    return own or set(SMALL_MODEL) <= set(command)


def refuse_a_default_model(command: list[str]) -> None:
    """Fail a launch that would train the recipe's own default model without saying so (4x slower steps)."""
    if not names_a_model(command):
        raise AssertionError(
            f"this launch trains its recipe's default model, which steps 4x slower: write *SMALL_MODEL into its "
            f"overrides, or pass default_model=True where the default is what the test checks: {' '.join(map(str, command))}"
        )


LAUNCH_LOG = "CHATTUNE_TEST_LAUNCH_LOG"  # a file: every launch's test, command and seconds, one JSON line each


def _log_launch(command: list[str], seconds: float, warm: bool) -> None:
    """With $CHATTUNE_TEST_LAUNCH_LOG set: which launches the suite repeats and what they cost (docs/install.md)."""
    if path := os.environ.get(LAUNCH_LOG):
        line = {"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "seconds": round(seconds, 2), "warm": warm}
        with open(path, "a") as log:
            log.write(json.dumps({**line, "command": command}) + "\n")


def launch(
    command: list[str],
    env_extra: dict | None = None,
    timeout: int = 600,
    check: bool = True,
    real_torchrun: bool = False,
    cwd: Path | None = None,
    default_model: bool = False,
) -> subprocess.CompletedProcess:
    """Run `command` from `cwd` (the test's working directory, `work_dir`) with the hub offline; with `check`, fail the test (its output
    shown) unless it succeeds. A `torchrun(...)` command, or `python RECIPE ...`, runs its ranks (its process)
    forked from a process with the imports done (`warm_ranks`: seconds per launch instead of about 10) unless
    `real_torchrun` (what a test of the launcher itself, signals or torchrun's reports needs) or `env_extra`
    changes what is read at import. The command names its model (SMALL_MODEL, most often) unless `default_model`:
    nothing is added to it, what runs is what the test wrote."""
    import warm_ranks

    cwd = Path(cwd if cwd is not None else os.getcwd())
    _refuse_the_checkout(cwd)
    command = [str(a) for a in command]  # (paths too: its log, its failure message)
    if not default_model:
        refuse_a_default_model(command)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **(env_extra or {})}
    warm = None if real_torchrun or not warm_ranks.can_launch(env_extra or {}) else _warm_launch(command)
    started = time.monotonic()
    if warm is None:
        result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    else:
        recipe, arguments, nproc = warm
        with tempfile.TemporaryDirectory(prefix="chattune-ranks-") as logs:
            code, stdout, stderr = warm_ranks.launch(recipe, arguments, nproc, env, cwd, Path(logs), timeout)
        result = subprocess.CompletedProcess(command, code, stdout, stderr)
    _log_launch(command, time.monotonic() - started, warm is not None)
    if check:
        assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def spawn(fn, args: tuple = (), nprocs: int = 1) -> None:
    """`torch.multiprocessing.spawn(fn, args, nprocs)`: `fn(rank, *args)` in `nprocs` processes, a worker's
    exception raised here with its traceback; the processes forked from `warm_ranks`' server, which has
    imported torch, transformers and chattune (a spawned process imports them again: about 5 s each on CI's 2
    cores, and the suite starts about a hundred). `fn` is a module-level function of a test module."""
    import warm_ranks
    from torch.multiprocessing import start_processes

    warm_ranks.context()  # the server, started once per test process
    start_processes(
        warm_ranks.with_environment, (dict(os.environ), fn, *args), nprocs=nprocs, join=True, start_method="forkserver"
    )


def made_once(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """A directory `make` fills once for the whole session, whichever xdist worker asks first; a worker that asks
    while another is making it waits, and every one gets the same directory. (A module fixture is made once per
    worker: the suite's 4-rank reference runs were launched twice when a module's tests ran on both workers.) A
    `make` that fails leaves nothing behind, so the next to ask makes it again (and fails the same way)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # (the workers' basetemps' common parent)
    directory = root / f"made-once-{name}"
    with FileLock(f"{directory}.lock"):
        if not (directory / ".made").exists():
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir()
            make(directory)
            (directory / ".made").touch()
    return directory


def mesh_dims() -> ParallelDims:
    """Plain FSDP2 over this test process's live group (made by `init_worker_process_group` or `one_rank_group`) on
    the CPU: what `shard_model` takes. Collective: every rank calls it, in the same order."""
    return ParallelDims.build(torch.device("cpu"))


def demo_tokenizer():
    return AutoTokenizer.from_pretrained(DEMO_ASSETS / "tokenizer")


def tiny_config(model_type: str = "llama", **overrides) -> PretrainedConfig:
    settings = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    settings.update(overrides)
    return AutoConfig.for_model(model_type, **settings)


def tiny_model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return build_hf_model(demo_tokenizer(), config=tiny_config(**overrides))


def exported_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded HF export, read with safetensors through its index (not chattune's code)."""
    from safetensors.torch import load_file

    weight_map = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    weights = {}
    for file in sorted(set(weight_map.values())):
        weights.update(load_file(hf_dir / file))
    assert sorted(weights) == sorted(weight_map), "the index and the shards disagree"
    return weights


def plain_mean_token_loss(model, count: int) -> torch.Tensor:
    """An HF model's mean loss over the trained tokens of the first `count` demo conversations, one plain
    unpacked forward per conversation (the independent reference of the packed, sharded computation)."""
    import torch.nn.functional as F

    total, tokens = 0.0, 0
    for doc in demo_documents(count):
        logits = model(input_ids=torch.tensor([doc.input_ids.tolist()]), use_cache=False).logits[0]
        labels = torch.tensor(doc.labels.tolist())
        total = total + F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
        tokens += int((labels != IGNORE_INDEX).sum())
    return total / tokens


def demo_documents(count: int, start: int = 0) -> list[Document]:
    """Real demo conversations, tokenized with assistant-only labels."""
    tokenizer = demo_tokenizer()
    markers = probe_template(tokenizer)
    lines = (DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines()[start : start + count]
    docs = []
    for i, line in enumerate(lines):
        tokenized = tokenize_conversation(tokenizer, json.loads(line)["messages"], markers)
        docs.append(
            Document(start + i, tokenized.input_ids, shifted_labels(tokenized.input_ids, tokenized.assistant_mask))
        )
    return docs


class ListSource:
    """A document source over a list of ready documents (the stream's DocumentSource protocol)."""

    def __init__(self, docs):
        self.docs = docs

    def __len__(self):
        return len(self.docs)

    def get(self, index):
        return self.docs[index]


def trained_runs(mask: list[bool]) -> list[tuple[int, int]]:
    """Maximal runs [start, end) of True."""
    runs, start = [], None
    for i, flag in enumerate([*mask, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


def decode_exactly(tokenizer, ids: list[int]) -> str:
    """The tokens' text as written (special tokens kept, no clean-up of spaces)."""
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def relative_error(got: torch.Tensor | dict, want: torch.Tensor | dict) -> float:
    """||got - want|| / ||want||; for dicts of tensors, the worst entry."""
    if isinstance(want, dict):
        assert got.keys() == want.keys()
        return max(relative_error(got[k], want[k]) for k in want)
    return float((got - want).norm() / want.norm())


def init_worker_process_group(rank: int, world_size: int, port: int) -> None:
    """For torch.multiprocessing workers: a gloo group on loopback, one thread per rank."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)


@pytest.fixture
def one_rank_group(monkeypatch):
    """A one-rank gloo group in the test's own process. Its environment variables are set with monkeypatch,
    which takes them away again: recipes that later tests launch must not inherit a finished group's
    RANK and MASTER_PORT."""
    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }.items():
        monkeypatch.setenv(name, value)
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny base model directory with the demo tokenizer (what a user's model.path holds)."""
    directory = tmp_path_factory.mktemp("base")
    tiny_model(seed=3).save_pretrained(directory)
    demo_tokenizer().save_pretrained(directory)
    return directory


CHAT_MODEL_DOCS = 6  # the demo chats the chat model learns (their last replies, at least in form)
CHAT_MODEL_LEARNED = 3  # of them whose last reply it gives word for word (greedy) when trained
CHAT_MODEL_FIRST_LEARNED = 2  # ... of which among the first 3 (the sample prompts of test_eval_samples)
CHAT_MODEL_MAX_STEPS = 1000


def _learned_replies(model) -> list[bool]:
    """Which of the CHAT_MODEL_DOCS demo chats' last replies `model` gives word for word, greedy."""
    tokenizer = demo_tokenizer()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    learned = []
    model.eval()
    for line in (DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines()[:CHAT_MODEL_DOCS]:
        messages = json.loads(line)["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        inputs = tokenizer.apply_chat_template(
            messages[:last], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=48, eos_token_id=end, pad_token_id=end, do_sample=False)
        new = output[0, inputs["input_ids"].shape[1] :].tolist()
        learned.append(end in new and tokenizer.decode(new[: new.index(end)]) == messages[last]["content"])
    model.train()
    return learned


@pytest.fixture(scope="session")
def chat_model_dir(tmp_path_factory) -> Path:
    """A tiny chat model that answers: the tiny Llama trained (plain HF, full batch, a few seconds) on the first
    CHAT_MODEL_DOCS demo chats until its greedy replies to their prompts are replies that end with the
    end-of-turn token; saved with the demo tokenizer and its chat template, as a run's hf/ export is."""
    import torch.nn.functional as F

    directory = tmp_path_factory.mktemp("chat_model")
    model = tiny_model(seed=0)
    model.set_attn_implementation("sdpa")  # a padded batch; the saved model is a stock one
    documents = demo_documents(CHAT_MODEL_DOCS)
    length = max(len(d.input_ids) for d in documents)
    ids = torch.zeros(len(documents), length, dtype=torch.long)
    labels = torch.full((len(documents), length), IGNORE_INDEX)
    mask = torch.zeros(len(documents), length, dtype=torch.long)
    for row, doc in enumerate(documents):
        n = len(doc.input_ids)
        ids[row, :n] = torch.tensor(doc.input_ids.tolist())
        labels[row, :n] = torch.tensor(doc.labels.tolist())
        mask[row, :n] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: more threads on shared cores only wait for each other (20x slower)
    try:
        # Until it has learned: a fixed number of steps learns more or fewer replies on different CPUs (their
        # float rounding differs and 200 steps of lr 1e-2 amplify it), which tests of its replies then see.
        for step in range(1, CHAT_MODEL_MAX_STEPS + 1):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
            F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX).backward()
            optimizer.step()
            optimizer.zero_grad()
            if step >= 150 and step % 25 == 0:
                learned = _learned_replies(model)
                if sum(learned) >= CHAT_MODEL_LEARNED and sum(learned[:3]) >= CHAT_MODEL_FIRST_LEARNED:
                    break
        else:
            raise AssertionError(
                f"the chat model learned fewer than {CHAT_MODEL_LEARNED} replies ({CHAT_MODEL_FIRST_LEARNED} of the "
                "first 3)"
            )
    finally:
        torch.set_num_threads(threads)
    model.config.use_cache = True
    model.save_pretrained(directory)
    demo_tokenizer().save_pretrained(directory)
    return directory


def demo_chat_prompts(count: int = CHAT_MODEL_DOCS) -> list[list[dict]]:
    """The messages before the last reply of the first `count` demo chats (those `chat_model_dir` learned)."""
    prompts = []
    for line in (DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines()[:count]:
        messages = json.loads(line)["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompts.append(messages[:last])
    return prompts


@pytest.fixture(scope="session")
def tokenizer():
    return demo_tokenizer()


@pytest.fixture(scope="session", autouse=True)
def token_cache_dir(tmp_path_factory) -> Path:
    """Token caches (data.cache=auto) of this test process and the launches it starts, not the user's
    ~/.cache: one directory per xdist worker, shared by its tests (a cache is found by its key)."""
    from chattune.data.token_cache import CACHE_DIR_ENV

    directory = tmp_path_factory.mktemp("token_cache")
    os.environ[CACHE_DIR_ENV] = str(directory)
    return directory


# --- the values the KTO and reward templates declare on their documents (`Document.doc_values`) ---


def kto_label(document) -> bool | None:
    """A KTO example's label (its declared value `desirable`: 1 desirable, 0 not); None for a document without."""
    value = document.doc_values.get("desirable")
    return None if value is None else value == 1.0


def pair_margin_of(document) -> float | None:
    """A reward pair's declared margin; None for a document that declares none (a DPO pair's)."""
    return document.doc_values.get("margin")


def with_values(document, **values):
    """`document` with these declared values in place of its own (a value None: not declared)."""
    from dataclasses import replace

    declared = {name: float(value) for name, value in values.items() if value is not None}
    return replace(document, doc_values=declared)
