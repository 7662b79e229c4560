"""The on-disk reference cache: its numbers against plain HF forwards, reuse, invalidation, and the DPO
recipe with it (against a live reference, and resumed exactly)."""

from __future__ import annotations

import re

import pytest
import torch
from test_dpo_step import NUM_PAIRS, pair_documents, sequence_logps
from test_optimizer import warmup_cosine_rates
from test_sft_recipe import read_metrics

from chattune.config.paths import DEMO_ASSETS
from chattune.data.stream import PackedStream, PackingBudget, StreamLayout
from chattune.distributed import ParallelDims
from chattune.model.causal_lm import PackedCausalLM
from chattune.objectives import reference_cache
from conftest import SMALL_MODEL, TIMING_METRICS, ListSource, launch, tiny_model, torchrun

CPU = torch.device("cpu")


def build_tables(cache_dir, fingerprint: dict, make_reference) -> dict[str, torch.Tensor]:
    documents = ListSource(pair_documents())
    return reference_cache.load_or_build(
        cache_dir,
        {"train": fingerprint},
        {"train": len(documents)},
        make_reference,
        lambda split: PackedStream(
            documents, StreamLayout(shuffle=False, num_epochs=1), 0, PackingBudget(400, 0, buffer_records=3)
        ),
        ParallelDims.one_rank(CPU),
        0,
    )


def test_table_matches_plain_forwards_and_is_reused_until_its_fingerprint_changes(tmp_path):
    built = []

    def make_reference():
        built.append(1)
        return PackedCausalLM(tiny_model(seed=1), loss_chunk_size=16)

    table = build_tables(tmp_path, {"data": "a"}, make_reference)["train"]
    want = torch.tensor(
        [[float(c), float(r)] for c, r, _, _ in sequence_logps(tiny_model(seed=1), pair_documents())],
        dtype=torch.float64,
    )
    assert table.shape == (NUM_PAIRS, 2) and len(built) == 1
    assert torch.allclose(table, want, rtol=1e-5, atol=1e-4), (table, want)

    def must_not_build():
        raise AssertionError("a valid cache must be loaded, not recomputed")

    assert torch.equal(build_tables(tmp_path, {"data": "a"}, must_not_build)["train"], table)
    build_tables(tmp_path, {"data": "b"}, make_reference)  # another fingerprint: another table
    assert len(built) == 2 and len(list(tmp_path.glob("train-*.pt"))) == 2


def test_weights_fingerprint_sees_a_change_inside_a_file_of_the_same_size(tmp_path):
    model_dir, memo = tmp_path / "model", tmp_path / "cache" / "weight_hashes.json"
    model_dir.mkdir()
    weights = model_dir / "model.safetensors"
    weights.write_bytes(bytes(3 << 20))
    first = reference_cache.weights_fingerprint(model_dir, memo)
    assert reference_cache.weights_fingerprint(model_dir, memo) == first and memo.is_file()
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] = 1  # the middle: outside the first and last MiB
    weights.write_bytes(bytes(data))
    assert reference_cache.weights_fingerprint(model_dir, memo) != first


def test_the_reference_fingerprint_follows_the_chat_template_text(tmp_path):
    """A template renders the pairs' tokens: another template, or a template file edited in place, is another table."""
    from test_validate import compose_config

    template = tmp_path / "mine.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )

    def fingerprint(*overrides: str) -> dict:
        return reference_cache.cache_fingerprint(
            compose_config("dpo/tiny", ["model.path=null", *overrides]), "train", "cpu", 1
        )

    own, mine = fingerprint(), fingerprint(f"tokenizer.chat_template={template}")
    assert (
        "chat_template" not in own
    )  # null: the tokenizer's own template, among its files (earlier tables still match)
    assert mine != own and mine != fingerprint("tokenizer.chat_template=chatml")
    assert fingerprint(f"tokenizer.chat_template={template}") == mine
    template.write_text(template.read_text() + "{# edited #}")
    assert fingerprint(f"tokenizer.chat_template={template}") != mine


@pytest.mark.parametrize("recipe", ["dpo", "kto"])
def test_the_reference_table_is_kept_in_the_runs_output_dir_unless_a_shared_directory_is_named(tmp_path, recipe):
    """A run writes only into its output_dir: the table goes to output_dir/reference_cache, sharing is asked for by
    naming a directory, and a resume into another output_dir accepts the table's place moving with it (as
    output_dir itself: where a table is kept is not what it holds)."""
    from test_validate import compose_config

    from chattune.checkpoint.resume import differences, run_fingerprint
    from chattune.launch.recipe_kinds import DPO, KTO
    from chattune.launch.validate import checked_config

    def config(*overrides: str):
        kind = DPO if recipe == "dpo" else KTO
        return checked_config(compose_config(f"{recipe}/tiny", ["model.path=null", *overrides]), kind)[0]

    run = config(f"output_dir={tmp_path / 'run'}")
    assert run.reference.cache_dir == str(tmp_path / "run" / "reference_cache")
    shared = config(f"output_dir={tmp_path / 'run'}", f"reference.cache_dir={tmp_path / 'shared'}")
    assert shared.reference.cache_dir == str(tmp_path / "shared")
    moved = config(f"output_dir={tmp_path / 'moved'}")
    assert differences(run_fingerprint(run), run_fingerprint(moved)) == []


def dpo(out, cache_dir, *overrides: str) -> str:
    """A short DPO run into `out`; its reference table in `cache_dir` (None: the default, out/reference_cache)."""
    result = launch(
        torchrun(
            "recipes/dpo.py",
            *SMALL_MODEL,
            f"output_dir={out}",
            "model.path=null",
            "max_steps=4",
            "log_every=1",
            "eval_every=4",
            "save_every=0",
            "data.report_records=0",
            "optimizer.lr=3e-3",
            *([f"reference.cache_dir={cache_dir}"] if cache_dir is not None else []),
            *overrides,
            nproc=2,
        )
    )
    return result.stdout + result.stderr


def logged_skips(log: str) -> list[tuple[str, int]]:
    """The (file, record) of every "skipped (overlong): FILE record N ..." line of a run's log, in order."""
    return [(file, int(record)) for file, record in re.findall(r"skipped \(overlong\): (\S+) record (\d+) ", log)]


def skipped_over_the_run(log: str) -> int:
    """The end-of-run figure: the overlong records skipped over all ranks and epochs."""
    return int(re.search(r"over all ranks and epochs: skipped \{'overlong': (\d+)", log)[1])


# Pairs of up to 300 tokens: 82 of the 2,000 demo training pairs are longer (41 a rank, more than the 20 each rank
# logs), and 11 of the 200 held-out ones (every one logged, when the held-out batches are packed).
BUDGET = "data.max_tokens_per_microbatch=300"


@pytest.mark.launch
def test_cached_reference_run_matches_the_live_one_and_resumes_exactly(tmp_path):
    cache = tmp_path / "cache"
    live_log = dpo(tmp_path / "live", cache, BUDGET)
    live = read_metrics(tmp_path / "live")
    # dpo/tiny's 5 warm-up steps, step k at k: the first step updates (at 3e-3 / 5)
    assert [m["lr"] for m in live] == pytest.approx(warmup_cosine_rates(3e-3, 5, 4), abs=1e-12)
    log = dpo(tmp_path / "cached", cache, BUDGET, "reference.cache=true")
    assert "computing" in log and sorted(p.name.split("-")[0] for p in cache.glob("*.pt")) == ["eval", "train"]
    # The reference pass reads the records that training and the held-out batches read: each skipped one is logged
    # once (by those), as without the pass, and counted once in the end-of-run figures.
    skips = logged_skips(log)
    assert len(set(skips)) == len(skips) and sorted(skips) == sorted(logged_skips(live_log))
    assert any("eval" in file for file, _ in skips) and any("train" in file for file, _ in skips)
    assert skipped_over_the_run(log) == skipped_over_the_run(live_log) > 0
    cached = read_metrics(tmp_path / "cached")
    for a, b in zip(live, cached, strict=True):  # the same numbers, from other packings of the reference pass
        for key in ("loss", "rewards/margins", "eval_loss", "eval_rewards/accuracies"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a, b)

    # Resumed, with the table in the run's own output_dir (the default): computed there by the first launch, loaded
    # by the one that resumes.
    resumed = tmp_path / "resumed"
    log = dpo(resumed, None, BUDGET, "reference.cache=true", "stop_after_step=2")
    assert f"into {resumed / 'reference_cache'}" in log and sorted(
        p.name.split("-")[0] for p in (resumed / "reference_cache").glob("*.pt")
    ) == ["eval", "train"]
    log = dpo(resumed, None, BUDGET, "reference.cache=true")
    assert "resumed from" in log and f"loaded from {resumed / 'reference_cache'}" in log and "computing" not in log
    assert untimed(read_metrics(resumed)) == untimed(cached)  # exactly


def untimed(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMING_METRICS} for m in metrics]


@pytest.mark.launch
def test_reference_free_simpo_builds_no_reference(tmp_path):
    log = dpo(tmp_path / "simpo", tmp_path / "cache", "loss.type=simpo", "loss.beta=2.0", "reference.cache=true")
    assert "reference log-probs" not in log and not (tmp_path / "cache").exists()
    metrics = read_metrics(tmp_path / "simpo")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(torch.isfinite(torch.tensor(m["loss"])) and m["num_pairs"] > 0 for m in metrics)


@pytest.mark.launch
def test_dpo_on_a_two_source_mixture_with_the_reference_cached(tmp_path):
    """Pairs of two sources behind one record index: the cache rows are found by that index (at step 1 the
    policy is its own reference: loss log 2, margins 0) and the mixer reports each source."""
    lines = (DEMO_ASSETS / "preference_train.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "a.jsonl").write_text("".join(lines[:60]))
    (tmp_path / "b.jsonl").write_text("".join(lines[60:100]))
    sources = (
        f"data.train=[{{path: {tmp_path / 'a.jsonl'}, format: preference, weight: 3}}, "
        f"{{path: {tmp_path / 'b.jsonl'}, format: preference, weight: 1}}]"
    )
    dpo(
        tmp_path / "mixed",
        tmp_path / "cache",
        sources,
        "data.mixing.mode=static",
        "reference.cache=true",
        "optimizer.lr=0",
    )  # lr 0: the policy stays its own reference, so every step must give log 2
    metrics = read_metrics(tmp_path / "mixed")
    assert all(m["loss"] == pytest.approx(0.693147, abs=1e-5) and abs(m["rewards/margins"]) < 1e-5 for m in metrics)
    assert metrics[-1]["mix/a/target"] == 0.75 and metrics[-1]["mix/a/documents"] + metrics[-1]["mix/b/documents"] > 0
