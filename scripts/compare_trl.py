"""Compare chattune's ORPO and reward-model objectives with TRL's, numerically, on the same tiny model and records.

    python scripts/compare_trl.py [--trl-path DIR] [--records N]

TRL is never a dependency of chattune. The script imports it from a folder of its own, appended to `sys.path` after
the project's packages (so it shadows none of them): `--trl-path`, else the environment variable CHATTUNE_TRL_PATH,
else /work/trl-pkgs. Install it there without its dependencies (accelerate and datasets come from the project's
environment):

    pip install --target /work/trl-pkgs "trl==1.16.0" --no-deps

A tiny random-init Llama (fp32, seed 0) and the first N demo preference pairs (chattune/assets/demo) go through
chattune's own path (PairDocuments, collate_packed, PackedCausalLM / PackedSequenceScorer, the objective, evaluate)
and through TRL's trainer code (ORPOTrainer.get_batch_loss_metrics, RewardTrainer.compute_loss) on a batch TRL's
collator built. Each figure is printed from both sides with its relative difference.

"aligned" rows feed TRL token ids and labels made from chattune's documents, so both score the same tokens; they
must agree to 1e-4 relative. "TRL tokenisation" rows let TRL render and tokenise the records itself: informational,
they show how much its conventions move the figures. Every alignment made is printed.

Exit status: 0 when every aligned figure agrees to 1e-4 relative, 1 when one does not, 77 when TRL cannot be
imported from the folder (tests/test_trl_parity.py skips then).

A comparison is one function `compare_<name>(setup) -> Comparison` listed in COMPARISONS (KTO can be one more).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from chattune.config.paths import DEMO_ASSETS
from chattune.data.documents import IGNORE_INDEX, Document, shifted_labels
from chattune.data.formats import SourceSpec
from chattune.data.packing import collate_packed
from chattune.data.pair_documents import PairDocuments, RewardPairDocuments
from chattune.data.records import RecordSource
from chattune.model.causal_lm import PackedCausalLM, build_hf_model
from chattune.model.heads import SCORE_HEAD
from chattune.model.sequence_score import PackedSequenceScorer
from chattune.objectives.dpo import PreferenceObjective
from chattune.objectives.pair_losses import PreferenceLoss
from chattune.objectives.reward import RewardObjective
from chattune.train.evaluation import evaluate

DEFAULT_TRL_PATH = "/work/trl-pkgs"
TOLERANCE = 1e-4  # relative, on every aligned figure
TRL_ABSENT = 77
CPU = torch.device("cpu")
PAIRS_FILE = DEMO_ASSETS / "preference_train.jsonl"
ORPO_BETA = 0.1  # TRL's one `beta` is both ORPO's lambda and the rewards' scale: chattune's orpo_lambda and beta
CENTER = 0.01  # center_rewards_coefficient, on both sides
# Random-init logits are near uniform (every token's NLL ~ ln vocab, wherever it is): the tied embeddings scaled, which
# tokens are scored moves the figures visibly, so a convention the alignment missed would show.
LOGIT_SCALE = 5.0
HEAD_SCALE = 50.0  # random-init scores are ~1e-2: scaled, the rewards differ enough for the accuracy to say something


@dataclass
class Row:
    name: str
    chattune: float
    trl: float
    checked: bool  # aligned: must agree to TOLERANCE; else informational

    @property
    def relative(self) -> float:
        scale = max(abs(self.chattune), abs(self.trl))
        return 0.0 if scale == 0 else abs(self.chattune - self.trl) / scale


@dataclass
class Comparison:
    title: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was aligned, what differs

    def add(self, variant: str, figures: dict[str, tuple[float, float]], checked: bool) -> None:
        for name, (ours, theirs) in figures.items():
            self.rows.append(Row(f"{variant}: {name}", float(ours), float(theirs), checked))


@dataclass
class Setup:
    tokenizer_dir: Path
    records: int
    output_dir: str

    def tokenizer(self):
        return AutoTokenizer.from_pretrained(self.tokenizer_dir)  # a fresh one: TRL's trainers set pad tokens

    def source(self) -> RecordSource:
        return RecordSource([SourceSpec(str(PAIRS_FILE), format="preference")])

    def records_as_dicts(self) -> list[dict]:
        lines = PAIRS_FILE.read_text().splitlines()[: self.records]
        return [{k: v for k, v in json.loads(line).items() if k in ("prompt", "chosen", "rejected")} for line in lines]


def tiny_model(tokenizer, seed: int = 0, head: str | None = None):
    """The tests' tiny Llama (tests/conftest.py), fp32, random init from `seed`."""
    config = AutoConfig.for_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    kwargs = {"head": head} if head else {}
    return build_hf_model(tokenizer, config=config, **kwargs).float()


def sides(doc: Document) -> list[tuple[list[int], list[int]]]:
    """A pair document's (input ids, shifted labels) per side: chosen, then rejected."""
    n = doc.segments[0]
    ids, labels = doc.input_ids.tolist(), doc.labels.tolist()
    return [(ids[:n], labels[:n]), (ids[n:], labels[n:])]


def unshifted(ids: list[int], labels: list[int]) -> list[int]:
    """chattune's shifted labels (labels[i] is the target of position i) as TRL's (labels[j] is token j or -100)."""
    out = [IGNORE_INDEX] * len(ids)
    for i, label in enumerate(labels):
        if label != IGNORE_INDEX:
            assert label == ids[i + 1]
            out[i + 1] = label
    return out


def every_token_trained(doc: Document) -> Document:
    """The same pair with every token of each side trained but its first, which no position predicts (the tokens
    TRL ORPO's NLL term scores)."""
    labels = []
    for ids, _ in sides(doc):
        labels += shifted_labels(ids, [True] * len(ids))
    return Document(doc.doc_id, doc.input_ids, labels, segments=doc.segments)


def relative_text(value: float) -> str:
    return f"{value:.2e}"


# --- ORPO --------------------------------------------------------------------------------------------------------


def chattune_orpo(model, documents: list[Document]) -> dict[str, float]:
    loss = PreferenceLoss(loss_type="orpo", beta=ORPO_BETA, orpo_lambda=ORPO_BETA)
    packed = PackedCausalLM(copy.deepcopy(model), loss_chunk_size=16)
    metrics = evaluate(packed, PreferenceObjective(loss, None), [collate_packed(documents)], CPU, pad_token_id=0)
    return {name.removeprefix("eval_"): value for name, value in metrics.items()}


def trl_orpo_row(doc: Document) -> dict[str, list[int]]:
    """TRL's tokenised ORPO row (tokenize_row's keys) holding chattune's tokens and trained positions."""
    row = {}
    for name, (ids, labels) in zip(("chosen", "rejected"), sides(doc)):
        row[f"{name}_input_ids"] = ids
        row[f"{name}_attention_mask"] = [1] * len(ids)
        row[f"{name}_labels"] = unshifted(ids, labels)
    chosen_labels = row["chosen_labels"]
    prompt_end = next(j for j, label in enumerate(chosen_labels) if label != IGNORE_INDEX)
    row["prompt_input_ids"] = row["chosen_input_ids"][:prompt_end]
    row["prompt_attention_mask"] = [1] * prompt_end
    return row


ORPO_KEYS = [f"{s}_{k}" for s in ("chosen", "rejected") for k in ("input_ids", "attention_mask", "labels")] + [
    "prompt_input_ids",
    "prompt_attention_mask",
]


def trl_orpo(trainer, model, rows: list[dict]) -> dict[str, float]:
    batch = trainer.data_collator([{k: row[k] for k in ORPO_KEYS} for row in rows])
    with torch.no_grad():
        loss, metrics = trainer.get_batch_loss_metrics(model, batch, train_eval="eval")
    metrics = {name.removeprefix("eval_"): value for name, value in metrics.items()}
    metrics["loss"] = float(loss)
    metrics["odds_ratio_loss"] = -trainer.beta * metrics["log_odds_ratio"]  # loss - nll_loss, as TRL adds them
    return metrics


def orpo_figures(ours: dict, theirs: dict, pairs: int) -> dict:
    return {
        "loss": (ours["loss"], theirs["loss"]),
        "nll_loss": (ours["nll_loss"], theirs["nll_loss"]),
        "odds_ratio_loss": (ours["odds_ratio_loss"], theirs["odds_ratio_loss"]),
        "rewards/chosen": (ours["rewards/chosen"], theirs["rewards/chosen"]),
        "rewards/rejected": (ours["rewards/rejected"], theirs["rewards/rejected"]),
        "rewards/accuracies": (ours["rewards/accuracies"], theirs["rewards/accuracies"]),
        # chattune logs a reply's summed log-prob, TRL's ORPO the mean per trained token: made per token here
        "logps/chosen (per token)": (ours["rewards/chosen"] / ORPO_BETA, theirs["logps/chosen"]),
        "logps/rejected (per token)": (ours["rewards/rejected"] / ORPO_BETA, theirs["logps/rejected"]),
        "pairs": (ours["num_pairs"], pairs),
    }


def compare_orpo(setup: Setup) -> Comparison:
    from datasets import Dataset
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    result = Comparison("ORPO (loss.type=orpo vs trl.experimental.orpo.ORPOTrainer)")
    tokenizer = setup.tokenizer()
    documents = PairDocuments(setup.source(), tokenizer, max_tokens=1 << 16).get_many(range(setup.records))
    model = tiny_model(tokenizer)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(LOGIT_SCALE)
    trl_model = copy.deepcopy(model)
    trl_model.set_attn_implementation("sdpa")
    trl_model.eval()
    trl_tokenizer = setup.tokenizer()
    args = ORPOConfig(
        output_dir=setup.output_dir,
        beta=ORPO_BETA,
        max_length=4096,
        remove_unused_columns=False,
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        disable_tqdm=True,
    )
    # Built on the records in TRL's conversational format: it renders and tokenises them itself (its own rows are
    # the "TRL tokenisation" variant); the aligned variants hand its collator rows made of chattune's tokens.
    trainer = ORPOTrainer(
        model=trl_model,
        args=args,
        processing_class=trl_tokenizer,
        train_dataset=Dataset.from_list(setup.records_as_dicts()),
    )

    # Aligned, chattune's convention: both score each side's final reply and its end-of-turn token.
    ours = chattune_orpo(model, documents)
    rows = [trl_orpo_row(doc) for doc in documents]
    theirs = trl_orpo(trainer, trl_model, rows)
    figures = orpo_figures(ours, theirs, len(rows))
    nll = figures.pop("nll_loss")
    total = figures.pop("loss")
    result.add("aligned (reply tokens)", figures, checked=True)
    result.add("aligned (reply tokens)", {"nll_loss [TRL: prompt too]": nll, "loss [TRL: prompt too]": total}, False)
    result.notes.append(
        "aligned: TRL gets chattune's token ids (the whole conversation rendered by the chat template, "
        "tokenised once) and labels on the same tokens (the final reply and its <|im_end|>; the template's "
        "'\\n' after it and the prompt unlabelled); the odds ratio, rewards and per-token log-probs then agree"
    )
    result.notes.append(
        "TRL ORPO's NLL term scores every non-padding token of the chosen sequence after the first (the prompt "
        "and the '\\n' after <|im_end|> too: concatenated_forward, 'computed over the full prompt and response'); "
        "chattune's scores the chosen reply's trained tokens only (those the odds ratio reads)"
    )

    result.notes.append(
        f"TRL's one `beta` is both ORPO's lambda (the odds-ratio term's weight) and the rewards' scale; chattune has "
        f"loss.orpo_lambda and loss.beta (both {ORPO_BETA} here). chattune logs logps/* summed over a reply's "
        "tokens, TRL ORPO the mean per token (compared per token here)"
    )

    # Aligned, TRL's NLL convention: every token of each side trained on both sides, so the NLL agrees too.
    everything = [every_token_trained(doc) for doc in documents]
    ours = chattune_orpo(model, everything)
    theirs = trl_orpo(trainer, trl_model, [trl_orpo_row(doc) for doc in everything])
    result.add("aligned (every token)", orpo_figures(ours, theirs, len(everything)), checked=True)
    result.notes.append(
        "aligned (every token): chattune's documents relabelled to train every token of each side, TRL's labels "
        "likewise: TRL's NLL then reads the tokens chattune's does, and loss = nll_loss + odds_ratio_loss agree"
    )

    # TRL's own tokenisation (informational): its rows as ORPOTrainer built them from the records.
    own = [trainer.train_dataset[i] for i in range(setup.records)]
    theirs = trl_orpo(trainer, trl_model, own)
    ours = chattune_orpo(model, documents)
    figures = orpo_figures(ours, theirs, len(own))
    result.add("TRL tokenisation", figures, checked=False)
    first, doc = own[0], documents[0]
    trained = [t for t, label in zip(first["chosen_input_ids"], first["chosen_labels"]) if label != IGNORE_INDEX]
    ours_trained = [label for label in sides(doc)[0][1] if label != IGNORE_INDEX]
    result.notes.append(
        f"TRL tokenisation, record 0, chosen side: TRL scores {trailing(trl_tokenizer, trained)} "
        f"({len(trained)} tokens), chattune {trailing(tokenizer, ours_trained)} ({len(ours_trained)} tokens); "
        f"TRL's sequence is {len(first['chosen_input_ids'])} tokens, chattune's {doc.segments[0]}"
    )
    result.notes.append(
        "TRL ORPO renders the prompt with the generation prompt and the reply as the rest of the rendered "
        "conversation (maybe_apply_chat_template), tokenises prompt and prompt+reply separately and splits at "
        "the prompt's length, then appends eos (<|im_end|>) to a reply that does not end with it: the template's "
        "'<|im_end|>\\n' becomes '<|im_end|>\\n<|im_end|>', all scored"
    )
    return result


def trailing(tokenizer, ids: list[int], count: int = 4) -> str:
    return repr("..." + tokenizer.decode(ids[-count:]))


# --- reward model ------------------------------------------------------------------------------------------------


def chattune_reward(model, documents: list[Document]) -> dict[str, float]:
    scorer = PackedSequenceScorer(copy.deepcopy(model))
    metrics = evaluate(scorer, RewardObjective(CENTER), [collate_packed(documents)], CPU, pad_token_id=0)
    return {name.removeprefix("eval_"): value for name, value in metrics.items()}


def up_to_reply_end(ids: list[int], labels: list[int]) -> list[int]:
    """A side's tokens up to its reply's end-of-turn token (one past its last trained position), where chattune
    reads the reward; the template's '\\n' after it is dropped, so transformers reads its score there too."""
    last_trained = max(i for i, label in enumerate(labels) if label != IGNORE_INDEX)
    return ids[: last_trained + 2]


def trl_reward(trainer, model, rows: list[dict]) -> dict[str, float]:
    batch = trainer.data_collator([{"chosen_ids": r["chosen_ids"], "rejected_ids": r["rejected_ids"]} for r in rows])
    model.eval()  # compute_loss files its metrics under "eval"
    trainer._metrics["eval"].clear()
    with torch.no_grad():
        loss, outputs = trainer.compute_loss(model, batch, return_outputs=True)
    chosen, rejected = torch.chunk(outputs.logits.squeeze(-1), chunks=2)
    metrics = {name: values[-1] for name, values in trainer._metrics["eval"].items() if values}
    return {
        "loss": float(loss),
        "accuracy": metrics["accuracy"],
        "margin": metrics["margin"],
        "rewards/chosen": float(chosen.mean()),
        "rewards/rejected": float(rejected.mean()),
    }


def reward_figures(ours: dict, theirs: dict) -> dict:
    return {
        "loss": (ours["loss"], theirs["loss"]),
        "accuracy": (ours["rewards/accuracies"], theirs["accuracy"]),
        "margin": (ours["rewards/margins"], theirs["margin"]),
        "rewards/chosen": (ours["rewards/chosen"], theirs["rewards/chosen"]),
        "rewards/rejected": (ours["rewards/rejected"], theirs["rewards/rejected"]),
    }


def compare_reward(setup: Setup) -> Comparison:
    from datasets import Dataset
    from trl import RewardConfig, RewardTrainer

    result = Comparison("reward model (RewardObjective vs trl.RewardTrainer)")
    tokenizer = setup.tokenizer()
    documents = RewardPairDocuments(setup.source(), tokenizer, max_tokens=1 << 16).get_many(range(setup.records))
    model = tiny_model(tokenizer, head=SCORE_HEAD)
    with torch.no_grad():
        model.score.weight.mul_(HEAD_SCALE)
    trl_model = copy.deepcopy(model)
    trl_model.set_attn_implementation("sdpa")
    args = RewardConfig(
        output_dir=setup.output_dir,
        center_rewards_coefficient=CENTER,
        max_length=4096,
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        disable_tqdm=True,
    )
    trl_tokenizer = setup.tokenizer()
    trainer = RewardTrainer(
        model=trl_model,
        args=args,
        processing_class=trl_tokenizer,
        train_dataset=Dataset.from_list(setup.records_as_dicts()),
    )
    ours = chattune_reward(model, documents)

    rows = []
    for doc in documents:
        (chosen, chosen_labels), (rejected, rejected_labels) = sides(doc)
        rows.append(
            {
                "chosen_ids": up_to_reply_end(chosen, chosen_labels),
                "rejected_ids": up_to_reply_end(rejected, rejected_labels),
            }
        )
    theirs = trl_reward(trainer, trl_model, rows)
    result.add("aligned (score at <|im_end|>)", reward_figures(ours, theirs), checked=True)
    result.notes.append(
        "aligned: TRL gets chattune's tokens of each side cut after the reply's <|im_end|> (the template's '\\n' "
        "after it dropped), so transformers' sequence classification reads the score at the token chattune reads"
    )

    own = [trainer.train_dataset[i] for i in range(setup.records)]
    theirs = trl_reward(trainer, trl_model, own)
    result.add("TRL tokenisation", reward_figures(ours, theirs), checked=False)
    result.notes.append(
        "TRL tokenisation: RewardTrainer renders prompt + reply with apply_chat_template as one conversation (the "
        f"same tokens as chattune's, trailing '\\n' included: {own[0]['chosen_ids'] == sides(documents[0])[0][0]} for "
        "record 0) and reads the score at the last non-padding token, the '\\n' after <|im_end|>; chattune reads it "
        "at <|im_end|>"
    )
    result.notes.append(
        "TRL logs accuracy, margin and min/mean/max_reward; chattune rewards/accuracies, rewards/margins, "
        "rewards/chosen, rewards/rejected (TRL's chosen and rejected means are read from its outputs here)"
    )
    result.notes.append(
        "both: -log sigmoid(r_chosen - r_rejected) + c (r_chosen + r_rejected)^2, averaged over pairs "
        f"(c = center_rewards_coefficient = {CENTER}); accuracy = fraction of pairs with r_chosen > r_rejected"
    )
    return result


COMPARISONS: list[Callable[[Setup], Comparison]] = [compare_orpo, compare_reward]


def report(comparison: Comparison) -> bool:
    """Print a comparison; whether every checked row agrees."""
    print(f"\n== {comparison.title}")
    width = max(len(r.name) for r in comparison.rows)
    print(f"{'figure':<{width}}  {'chattune':>14}  {'TRL':>14}  {'rel. diff':>9}")
    ok = True
    for r in comparison.rows:
        bad = r.checked and not (r.relative <= TOLERANCE)
        ok &= not bad
        verdict = ("FAIL" if bad else "ok") if r.checked else "info"
        print(f"{r.name:<{width}}  {r.chattune:>14.7g}  {r.trl:>14.7g}  {relative_text(r.relative):>9}  {verdict}")
    for note in comparison.notes:
        print(f"  - {note}")
    return ok


def import_trl(path: str) -> str | None:
    """TRL's version, imported from `path` (appended to sys.path); None where it cannot be imported."""
    if path not in sys.path:
        sys.path.append(path)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        import trl
        from trl import RewardTrainer  # noqa: F401
        from trl.experimental.orpo import ORPOTrainer  # noqa: F401
    except Exception as error:  # absent, or broken against this environment
        print(f"TRL cannot be imported from {path}: {type(error).__name__}: {error}")
        return None
    return trl.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trl-path", default=os.environ.get("CHATTUNE_TRL_PATH", DEFAULT_TRL_PATH))
    parser.add_argument("--records", type=int, default=8)
    args = parser.parse_args(argv)
    version = import_trl(args.trl_path)
    if version is None:
        return TRL_ABSENT
    import datasets
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    print(
        f"TRL {version} (from {args.trl_path}), transformers {transformers.__version__}, torch {torch.__version__}; "
        f"{args.records} pairs of {PAIRS_FILE.name}; tiny Llama fp32 seed 0 (ORPO: embeddings x{LOGIT_SCALE:g}; "
        f"reward: head x{HEAD_SCALE:g}); tolerance {TOLERANCE:g} relative"
    )
    ok = True
    with tempfile.TemporaryDirectory() as output_dir:
        setup = Setup(DEMO_ASSETS / "tokenizer", args.records, output_dir)
        for compare in COMPARISONS:
            ok &= report(compare(setup))
    print("\nall aligned figures agree" if ok else "\nSOME ALIGNED FIGURES DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
