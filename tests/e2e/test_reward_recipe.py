"""End to end: the reward recipe from a causal LM's directory (as reward/tiny starts from sft/tiny's export), on 2
ranks stopped and resumed and on 1 rank uninterrupted (the same steps: data.microbatches_per_step), its held-out
accuracy logged, its export scored by stock `AutoModelForSequenceClassification`; and with LoRA."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from test_optimizer import warmup_cosine_rates
from test_sft_recipe import read_metrics
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

import conftest
from chattune.config.paths import DEMO_ASSETS
from conftest import free_port

pytestmark = pytest.mark.launch  # every test here starts processes

REWARD_KEYS = {
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "num_pairs",
    "num_tokens",
    "tokens_per_sec",
    "lr",
    "grad_norm",
}
EVAL_PAIRS = 24
CENTER = 0.01  # loss.center_rewards_coefficient of the resumed runs


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory) -> Path:
    """The first demo held-out pairs (a short evaluation)."""
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
            "recipes/reward.py",
            f"output_dir={output_dir}",
            *overrides,
        ]
    )


def stock_scores(hf_dir: Path, pairs: list[dict]) -> list[tuple[float, float]]:
    """(chosen, rejected) scores of each pair by transformers alone, as a stock pipeline scores a conversation: the
    export's tokenizer renders each side with its chat template (`apply_chat_template`, tokenized) and the model's
    own forward reads it at its last token."""
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForSequenceClassification.from_pretrained(hf_dir).eval()
    scores = []
    with torch.no_grad():
        for pair in pairs:
            sides = []
            for reply in (pair["chosen"], pair["rejected"]):
                ids = tokenizer.apply_chat_template(pair["prompt"] + reply, tokenize=True, return_dict=False)
                ids = ids["input_ids"] if isinstance(ids, dict) else ids
                sides.append(float(model(input_ids=torch.tensor([list(ids)])).logits[0, 0]))
            scores.append((sides[0], sides[1]))
    return scores


def held_out_pairs() -> list[dict]:
    lines = (DEMO_ASSETS / "preference_eval.jsonl").read_text().splitlines()[:EVAL_PAIRS]
    return [json.loads(line) for line in lines]


def assert_export_scores_as_logged(run_dir: Path, logged: dict, center: float = 0.0) -> None:
    """The export, scored by transformers alone, gives the held-out figures the run logged at its last step (the
    packed model's rewards of the same pairs; `center`: loss.center_rewards_coefficient)."""
    config = AutoConfig.from_pretrained(run_dir / "hf")
    assert config.architectures == ["LlamaForSequenceClassification"] and config.num_labels == 1
    assert config.pad_token_id is not None
    scores = stock_scores(run_dir / "hf", held_out_pairs())
    n = len(scores)
    assert logged["eval_num_pairs"] == n
    want = {
        "eval_rewards/chosen": sum(c for c, _ in scores) / n,
        "eval_rewards/rejected": sum(r for _, r in scores) / n,
        "eval_rewards/accuracies": sum(c > r for c, r in scores) / n,
        "eval_loss": sum(-math.log(1 / (1 + math.exp(r - c))) + center * (c + r) ** 2 for c, r in scores) / n,
    }
    for key, value in want.items():
        assert math.isclose(logged[key], value, rel_tol=1e-5, abs_tol=1e-5), (key, logged[key], value)


def test_reward_recipe_trains_resumes_on_any_ranks_and_exports_a_stock_sequence_classifier(
    tmp_path, base_dir, eval_file
):
    common = [
        f"model.path={base_dir}",
        f"tokenizer.path={DEMO_ASSETS / 'tokenizer'}",
        f"data.eval=[{{path: {eval_file}, format: preference}}]",
        "data.microbatches_per_step=2",
        "data.max_tokens_per_microbatch=1024",
        "data.report_records=0",
        f"data.cache={tmp_path / 'cache'}",
        "max_steps=8",
        "eval_every=4",
        "save_every=4",
        "log_every=1",
        "optimizer.lr=3e-3",
        f"loss.center_rewards_coefficient={CENTER}",
    ]
    two = tmp_path / "two_ranks"
    launch(two, 2, [*common, "stop_after_step=4"])
    assert not (two / "hf").exists()
    launch(two, 2, common)  # resumes from step 4
    one = tmp_path / "one_rank"
    launch(one, 1, common)

    resumed, whole = read_metrics(two, include_start=True), read_metrics(one, include_start=True)
    assert [m["step"] for m in resumed] == [m["step"] for m in whole] == list(range(9))
    assert whole[0]["eval_num_pairs"] == EVAL_PAIRS and "eval_rewards/accuracies" in whole[0]
    for a, b in zip(resumed, whole):
        for key in a:
            if key.startswith(("loss", "rewards/", "eval_", "grad_norm", "num_")):
                # 1e-4: one rank runs 2 CPU threads, each of 2 ranks 1 (chattune.distributed), and on an AVX-512
                # CPU the matmuls round with the thread count: 1.7e-5 apart after 6 steps (rewards, grad_norm). A
                # batch's mean reward is a difference of scores near 1 (0.0085 at step 8): 2.4e-6 apart absolutely.
                abs_tol = 1e-5 if key.startswith("rewards/") else 1e-6
                assert math.isclose(a[key], b[key], rel_tol=1e-4, abs_tol=abs_tol), (a["step"], key, a[key], b[key])
    assert all(REWARD_KEYS <= m.keys() for m in whole[1:])
    for run in (resumed, whole):  # step k at the schedule's value at k (reward/tiny: 5 warm-up steps)
        assert [m["lr"] for m in run[1:]] == pytest.approx(warmup_cosine_rates(3e-3, 5, 8), abs=1e-12)
    assert whole[-1]["eval_loss"] < whole[0]["eval_loss"]  # it learns something on the held-out pairs
    assert_export_scores_as_logged(two, whole[-1], CENTER)
    assert_export_scores_as_logged(one, whole[-1], CENTER)


def test_reward_recipe_with_lora_trains_the_score_head_and_exports_adapter_and_merged_model(
    tmp_path, base_dir, eval_file
):
    from peft import PeftModel

    out = tmp_path / "lora"
    launch(
        out,
        1,
        [
            f"model.path={base_dir}",
            f"tokenizer.path={DEMO_ASSETS / 'tokenizer'}",
            f"data.eval=[{{path: {eval_file}, format: preference}}]",
            "data.report_records=0",
            f"data.cache={tmp_path / 'cache'}",
            "max_steps=4",
            "eval_every=4",
            "save_every=0",
            "log_every=1",
            "optimizer.lr=1e-2",
            "peft=lora",
            "peft.rank=4",
            "export.merge=true",
        ],
    )
    metrics = read_metrics(out, include_start=True)
    assert metrics[-1]["step"] == 4 and "eval_rewards/accuracies" in metrics[-1]
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["task_type"] == "SEQ_CLS" and "score" in adapter_config["modules_to_save"]
    # The merged export scores as the run logged it; so does the base with the adapter (and the trained head) on it.
    assert_export_scores_as_logged(out, metrics[-1])
    merged = AutoModelForSequenceClassification.from_pretrained(out / "hf").eval()
    base = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=1)
    with_adapter = PeftModel.from_pretrained(base, out / "adapter").eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(out / "hf")("<|im_start|>user\nhi<|im_end|>")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(with_adapter(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    assert metrics[-1]["eval_loss"] != metrics[0]["eval_loss"]  # adapters and head trained (peft's B starts at 0)
