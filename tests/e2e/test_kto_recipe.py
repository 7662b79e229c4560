"""End to end: the KTO recipe on 2 ranks stopped and resumed equals 1 rank uninterrupted (the same steps:
data.microbatches_per_step), through the token cache, from preference pairs read as unpaired examples; and on an
unpaired file with LoRA (the reference is the base with the adapters off) and the reference log-probs cached."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from test_optimizer import warmup_cosine_rates
from test_sft_recipe import read_metrics

import conftest
from chattune.config.paths import DEMO_ASSETS
from conftest import free_port

pytestmark = pytest.mark.launch  # every test here starts processes

KTO_KEYS = {
    "loss",
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "num_examples",
    "num_desirable",
    "num_tokens",
    "grad_norm",
    "lr",
}
EVAL_PAIRS = 12


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory) -> Path:
    """The first demo held-out pairs (a short evaluation: two examples each)."""
    path = tmp_path_factory.mktemp("eval") / "pairs.jsonl"
    lines = (DEMO_ASSETS / "preference_eval.jsonl").read_text().splitlines()[:EVAL_PAIRS]
    path.write_text("\n".join(lines) + "\n")
    return path


def launch(output_dir: Path, ranks: int, overrides: list[str]) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
    conftest.launch(
        [
            *torchrun,
            "--master_port",
            str(free_port()),
            "recipes/kto.py",
            f"output_dir={output_dir}",
            *overrides,
        ]
    )


def test_kto_recipe_trains_and_resumes_on_any_ranks(tmp_path, base_dir, eval_file):
    common = [
        f"model.path={base_dir}",
        f"tokenizer.path={DEMO_ASSETS / 'tokenizer'}",
        f"data.eval=[{{path: {eval_file}, format: preference}}]",
        "data.microbatches_per_step=2",
        "data.max_tokens_per_microbatch=1024",
        "data.report_records=0",
        f"data.cache={tmp_path / 'cache'}",
        "eval.samples=0",
        "max_steps=6",
        "eval_every=3",
        "save_every=3",
        "log_every=1",
        "optimizer.lr=3e-3",
        "loss.undesirable_weight=1.5",
    ]
    two = tmp_path / "two_ranks"
    launch(two, 2, [*common, "stop_after_step=3"])
    assert not (two / "hf").exists()
    launch(two, 2, common)  # resumes from step 3
    one = tmp_path / "one_rank"
    launch(one, 1, common)

    resumed, whole = read_metrics(two, include_start=True), read_metrics(one, include_start=True)
    assert [m["step"] for m in resumed] == [m["step"] for m in whole] == list(range(7))
    assert whole[0]["eval_num_examples"] == 2 * EVAL_PAIRS and whole[0]["eval_num_desirable"] == EVAL_PAIRS
    # 1 and 2 ranks sum gradients in another order, so the weights part in their last bits; z and the rewards are
    # small differences of log-prob sums of ~70 nats, where that shows as ~1e-5 absolute.
    for a, b in zip(resumed, whole):
        for key in a:
            if key.startswith(("loss", "kl", "rewards/", "logps/", "eval_", "grad_norm", "num_")):
                assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=2e-5), (a["step"], key, a[key], b[key])
    assert all(KTO_KEYS <= m.keys() for m in whole[1:])
    # Step k at the schedule's value at k (kto/tiny's 5 warm-up steps): the first step updates, the resumed ones
    # continue the same rates.
    for run in (resumed, whole):
        assert [m["lr"] for m in run[1:]] == pytest.approx(warmup_cosine_rates(3e-3, 5, 6), abs=1e-12)
    assert whole[0]["eval_kl"] == 0.0 and whole[0]["eval_rewards/margins"] == 0.0  # the policy is its reference
    # It learns on the held-out examples: their KTO loss falls (0.625 to 0.607 here). (Their reward margin, within
    # 0.004 of 0 after 6 steps of this random tiny base, changes sign with the schedule's rates: not a claim.)
    assert whole[-1]["eval_loss"] < whole[0]["eval_loss"] - 0.01
    assert (one / "hf" / "config.json").is_file()


def test_kto_recipe_on_unpaired_examples_with_lora_and_a_cached_reference(tmp_path, base_dir):
    pairs = [json.loads(line) for line in (DEMO_ASSETS / "preference_train.jsonl").read_text().splitlines()[:40]]
    unpaired = tmp_path / "unpaired.jsonl"
    with unpaired.open("w") as f:
        for i, pair in enumerate(pairs):  # one example per pair, alternately desirable and undesirable
            side = "chosen" if i % 2 == 0 else "rejected"
            f.write(json.dumps({"prompt": pair["prompt"], "completion": pair[side], "label": i % 2 == 0}) + "\n")
    out = tmp_path / "lora"
    launch(
        out,
        1,
        [
            f"model.path={base_dir}",
            f"tokenizer.path={DEMO_ASSETS / 'tokenizer'}",
            f"data.train=[{{path: {unpaired}, format: unpaired}}]",
            "data.eval=null",
            "data.report_records=0",
            "eval.samples=0",
            "max_steps=3",
            "save_every=0",
            "log_every=1",
            "optimizer.lr=1e-2",
            "peft=lora",
            "peft.rank=4",
            "reference.cache=true",
            f"reference.cache_dir={tmp_path / 'reference_cache'}",
        ],
    )
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(KTO_KEYS <= m.keys() for m in metrics)
    # Step 1: the adapters are off (peft's B starts at 0), so the policy is the reference: every log-ratio, hence
    # z and every reward, is 0 whatever the cache holds, unless the cache is not the reference's.
    assert abs(metrics[0]["kl"]) < 1e-4 and abs(metrics[0]["rewards/chosen"]) < 1e-4
    assert metrics[-1]["loss"] != metrics[0]["loss"]
    assert (out / "adapter" / "adapter_config.json").is_file()


def test_kto_recipe_mixes_unpaired_and_paired_sources_online_and_holds_out_whole_pairs(tmp_path, base_dir):
    pairs = [json.loads(line) for line in (DEMO_ASSETS / "preference_train.jsonl").read_text().splitlines()[:30]]
    unpaired = tmp_path / "unpaired.jsonl"
    with unpaired.open("w") as f:
        for i, pair in enumerate(pairs):
            f.write(json.dumps({"prompt": pair["prompt"], "completion": pair["chosen"], "label": i % 3 != 0}) + "\n")
    paired = tmp_path / "pairs.jsonl"
    paired.write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    out = tmp_path / "mixed"
    launch(
        out,
        1,
        [
            f"model.path={base_dir}",
            f"tokenizer.path={DEMO_ASSETS / 'tokenizer'}",
            f"data.train=[{{path: {unpaired}, format: unpaired, name: feedback}}, "
            f"{{path: {paired}, format: preference, name: pairs}}]",
            "data.eval=null",
            "data.eval_split=4",
            "data.mixing.mode=online",
            "data.mixing.update_every=2",
            "data.report_records=0",
            "eval.samples=0",
            "max_steps=4",
            "eval_every=4",
            "save_every=0",
            "log_every=1",
        ],
    )
    metrics = read_metrics(out, include_start=True)
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    # eval_split=4 holds out 4 records: those of the pairs source are whole pairs (two examples each)
    held_out = metrics[0]["eval_num_examples"]
    assert 4 < held_out <= 8 and metrics[-1]["eval_num_examples"] == held_out
    assert any(key.startswith("mix/pairs/") for key in metrics[-1]) and any(
        k.startswith("mix/feedback/") for k in metrics[-1]
    )
