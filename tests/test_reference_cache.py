"""The on-disk reference cache: its numbers against plain HF forwards, reuse, invalidation, and the DPO
recipe with it (against a live reference, and resumed exactly)."""

from __future__ import annotations

import pytest
import torch
from test_dpo_step import NUM_PAIRS, pair_documents, sequence_logps
from test_sft_recipe import read_metrics

from chattune.config.paths import DEMO_ASSETS
from chattune.data.stream import PackedStream, PackingBudget, StreamLayout
from chattune.model.causal_lm import PackedCausalLM
from chattune.objectives import reference_cache
from conftest import ListSource, launch, tiny_model, torchrun

CPU = torch.device("cpu")
TIMINGS = ("step_time_s", "tokens_per_sec", "all_tokens_per_sec", "all_tokens_per_sec_per_device", "mfu")


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
        CPU,
        0,
        is_main=True,
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


def dpo(out, cache_dir, *overrides: str) -> str:
    result = launch(
        torchrun(
            "recipes/dpo.py",
            f"output_dir={out}",
            "model.path=null",
            "max_steps=4",
            "log_every=1",
            "eval_every=4",
            "save_every=0",
            "data.report_records=0",
            "optimizer.lr=3e-3",
            f"reference.cache_dir={cache_dir}",
            *overrides,
            nproc=2,
        )
    )
    return result.stdout + result.stderr


@pytest.mark.launch
def test_cached_reference_run_matches_the_live_one_and_resumes_exactly(tmp_path):
    cache = tmp_path / "cache"
    dpo(tmp_path / "live", cache)
    live = read_metrics(tmp_path / "live")
    log = dpo(tmp_path / "cached", cache, "reference.cache=true")
    assert "computing" in log and sorted(p.name.split("-")[0] for p in cache.glob("*.pt")) == ["eval", "train"]
    cached = read_metrics(tmp_path / "cached")
    for a, b in zip(live, cached, strict=True):  # the same numbers, from other packings of the reference pass
        for key in ("loss", "rewards/margins", "eval_loss", "eval_rewards/accuracies"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a, b)

    log = dpo(tmp_path / "resumed", cache, "reference.cache=true", "stop_after_step=2")
    assert "loaded from" in log and "computing" not in log
    log = dpo(tmp_path / "resumed", cache, "reference.cache=true")
    assert "resumed from" in log and "computing" not in log
    assert untimed(read_metrics(tmp_path / "resumed")) == untimed(cached)  # exactly


def untimed(metrics: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if k not in TIMINGS} for m in metrics]


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
