"""Compare chattune's ORPO, reward-model and KTO objectives with TRL's, numerically, on the same tiny model and records.

    python scripts/parity/compare_trl.py [--trl-path DIR] [--records N]

TRL is never a dependency of chattune. The script imports it from a folder of its own, appended to `sys.path` after
the project's packages (so it shadows none of them): `--trl-path`, else the environment variable CHATTUNE_TRL_PATH,
else /work/trl-pkgs. Install it there without its dependencies (accelerate and datasets come from the project's
environment):

    pip install --target /work/trl-pkgs "trl==1.16.0" --no-deps

A tiny random-init Llama (fp32, seed 0) and the first N demo preference pairs (chattune/assets/demo) go through
chattune's own path (PairDocuments, collate_packed, PackedCausalLM / PackedSequenceScorer, the objective, evaluate)
and through TRL's trainer code (ORPOTrainer.get_batch_loss_metrics, RewardTrainer.compute_loss) on a batch TRL's
collator built. KTO reads the first N/2 pairs as N examples and N unpaired records made of the first N pairs
(KTODocuments, evaluate and a training step against KTOTrainer.compute_loss, z over the same N examples on both
sides, gradients compared too). Each figure is printed from both sides with its relative difference.

"aligned" rows feed TRL token ids and labels made from chattune's documents, so both score the same tokens; they
must agree to 1e-4 relative. "TRL tokenisation" rows let TRL render and tokenise the records itself: informational,
they show how much its conventions move the figures. Every alignment made is printed.

Exit status: 0 when every aligned figure agrees to 1e-4 relative, 1 when one does not, 77 when TRL cannot be
imported from the folder (tests/unit/objectives/test_trl_parity.py skips then).

A comparison is one function `compare_<name>(setup) -> Comparison` listed in COMPARISONS.
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
from chattune.data.feed import StepBatches
from chattune.data.ingest.formats import SourceSpec
from chattune.data.ingest.records import RecordSource
from chattune.data.packing import collate_packed
from chattune.data.templates.kto_documents import KTODocuments
from chattune.data.templates.pair_documents import PairDocuments, RewardPairDocuments
from chattune.distributed import ParallelDims
from chattune.model.causal_lm import PackedCausalLM, build_hf_model
from chattune.model.head.kinds import SCORE_HEAD
from chattune.model.sequence_score import PackedSequenceScorer
from chattune.objectives.dpo import LiveReference, PreferenceObjective
from chattune.objectives.kto import KTOObjective, KTOWeights
from chattune.objectives.pair_losses import PreferenceLoss
from chattune.objectives.reward import RewardObjective
from chattune.parallel.fsdp import Placement
from chattune.train.evaluation import evaluate
from chattune.train.metrics import step_metrics
from chattune.train.step import accumulate_gradients

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
    difference: float | None = None  # the relative difference where it is not that of the two figures (vectors)

    @property
    def relative(self) -> float:
        if self.difference is not None:
            return self.difference
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
    metrics = evaluate(
        packed, PreferenceObjective(loss, None), [collate_packed(documents)], ParallelDims.one_rank(CPU), pad_token_id=0
    )
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
    metrics = evaluate(
        scorer, RewardObjective(CENTER), [collate_packed(documents)], ParallelDims.one_rank(CPU), pad_token_id=0
    )
    return {name.removeprefix("eval_"): value for name, value in metrics.items()}


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

    own = [trainer.train_dataset[i] for i in range(setup.records)]
    same = all(
        own[i]["chosen_ids"] == sides(doc)[0][0] and own[i]["rejected_ids"] == sides(doc)[1][0]
        for i, doc in enumerate(documents)
    )
    theirs = trl_reward(trainer, trl_model, own)
    result.add("TRL's own tokenisation", reward_figures(ours, theirs), checked=True)
    result.notes.append(
        "TRL's own tokenisation: RewardTrainer renders prompt + reply with apply_chat_template as one conversation and "
        f"reads the score at its last non-padding token (ChatML's '\\n' after <|im_end|>); chattune's sides are the "
        f"same tokens ({same} for every record) and it reads each side at its last token too"
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


# --- KTO -----------------------------------------------------------------------------------------------------------

KTO_WEIGHTS = KTOWeights(beta=0.1, desirable=1.0, undesirable=1.5)  # unequal: a swapped weight would show
KTO_POLICY_SEED, KTO_REFERENCE_SEED = 0, 1  # two random inits: every log-ratio, z included, is away from 0
# The reference's tied embeddings scaled: its logits are peakier, its log-probs of these tokens lower, so the log-ratios
# (and z) are positive and large enough (rewards ~0.3-0.5, z ~4) for fp32 rounding to stay well below the tolerance.
KTO_REFERENCE_SCALE = 3.0
KTO_STEP_MICROBATCHES = 2  # the training step's split: z must still be the step's, as TRL's one batch's
KTO_FIGURES = (
    "loss",
    "kl",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
)


def kto_unpaired_desirable(index: int) -> bool:
    return index % 3 != 2  # as tests/distributed/test_kto_step.py: unbalanced, as real KTO data often is


def kto_unpaired_records(setup: Setup) -> list[dict]:
    """N unpaired records made of the first N demo pairs: pair i's prompt with its chosen reply (desirable) or, every
    third record, its rejected one (undesirable)."""
    records = []
    for i, pair in enumerate(setup.records_as_dicts()):
        label = kto_unpaired_desirable(i)
        records.append(
            {"prompt": pair["prompt"], "completion": pair["chosen" if label else "rejected"], "label": label}
        )
    return records


def chattune_kto(policy, reference, documents: list[Document]) -> dict[str, float]:
    """chattune's held-out KTO metrics of `documents`, one microbatch: z is the set's (the same as a step's)."""
    objective = KTOObjective(KTO_WEIGHTS, LiveReference(PackedCausalLM(copy.deepcopy(reference))))
    packed = PackedCausalLM(copy.deepcopy(policy), loss_chunk_size=16)
    metrics = evaluate(packed, objective, [collate_packed(documents)], ParallelDims.one_rank(CPU), pad_token_id=0)
    return {name.removeprefix("eval_"): value for name, value in metrics.items()}


def prompt_and_reply(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """A KTO segment's (prompt ids, scored reply ids): the tokens before its first trained token, and its trained
    tokens (the reply and its end-of-turn token), which must be contiguous; what follows them (the template's '\\n'
    after the end-of-turn token) is dropped: no scored position reads it."""
    scored = [j for j, label in enumerate(unshifted(ids, labels)) if label != IGNORE_INDEX]
    first, last = scored[0], scored[-1]
    assert scored == list(range(first, last + 1)), "a segment's trained tokens are one span"
    return ids[:first], ids[first : last + 1]


def first_segment(doc: Document) -> tuple[list[int], list[int]]:
    """A KTO document's example: (input ids, shifted labels) of its first segment."""
    n = doc.segments[0]
    return doc.input_ids.tolist()[:n], doc.labels.tolist()[:n]


def trl_kto_row(doc: Document) -> dict:
    """TRL's tokenised KTO row (prompt_ids, completion_ids, KL_completion_ids, label) holding chattune's tokens: the
    example's prompt and scored reply, and the scored reply of its mismatched sequence as the KL completion."""
    n = doc.segments[0]
    ids, labels = doc.input_ids.tolist(), doc.labels.tolist()
    prompt, reply = prompt_and_reply(ids[:n], labels[:n])
    kl_prompt, kl_reply = prompt_and_reply(ids[n:], labels[n:])
    assert kl_prompt == prompt, "chattune's mismatched sequence starts with its example's prompt tokens"
    return {
        "prompt_ids": prompt,
        "completion_ids": reply,
        "KL_completion_ids": kl_reply,
        "label": doc.doc_values["desirable"] == 1.0,
    }


def trl_kto(trainer, model, rows: list[dict]) -> dict[str, float]:
    """TRL's loss and metrics of `rows` as one batch (its z is the batch's: the whole set's here)."""
    keys = ("prompt_ids", "completion_ids", "KL_completion_ids", "label")
    batch = trainer.data_collator([{k: row[k] for k in keys} for row in rows])
    model.eval()  # compute_loss files its metrics under "eval"
    trainer._metrics["eval"].clear()
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
    metrics = {name: values[-1] for name, values in trainer._metrics["eval"].items() if values}
    metrics["loss"] = float(loss)
    metrics["num_desirable"] = sum(bool(row["label"]) for row in rows)
    return metrics


def kto_figures(ours: dict, theirs: dict) -> dict:
    figures = {name: (ours[name], theirs[name]) for name in KTO_FIGURES}
    figures["desirable examples"] = (ours["num_desirable"], theirs["num_desirable"])
    return figures


def chattune_kto_step(policy, reference, documents: list[Document]) -> tuple[dict[str, float], dict]:
    """One training step of `documents` in KTO_STEP_MICROBATCHES microbatches (accumulate_gradients, one rank): its
    metrics and the policy's gradients."""
    model = PackedCausalLM(copy.deepcopy(policy), loss_chunk_size=16)
    model.train()
    objective = KTOObjective(KTO_WEIGHTS, LiveReference(PackedCausalLM(copy.deepcopy(reference))))
    size = -(-len(documents) // KTO_STEP_MICROBATCHES)
    microbatches = [collate_packed(documents[i : i + size]) for i in range(0, len(documents), size)]
    result = accumulate_gradients(model, objective, StepBatches(microbatches), Placement.one_rank(CPU))
    metrics = step_metrics(1, result, objective, grad_norm=0.0, lr=0.0, step_time_s=1.0, device=CPU)
    grads = {name.removeprefix("hf_model."): p.grad.clone() for name, p in model.named_parameters()}
    return metrics, grads


def trl_kto_step(trainer, model, rows: list[dict]) -> tuple[dict[str, float], dict]:
    """TRL's compute_loss of `rows` as one training batch, backward: its loss, kl and the policy's gradients."""
    keys = ("prompt_ids", "completion_ids", "KL_completion_ids", "label")
    batch = trainer.data_collator([{k: row[k] for k in keys} for row in rows])
    model.train()
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    metrics = {name: values[-1] for name, values in trainer._metrics["train"].items() if values}
    metrics["loss"] = float(loss.detach())
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.eval()
    return metrics, grads


def gradient_difference(ours: dict, theirs: dict) -> float:
    """|g_chattune - g_TRL| / max(|g_chattune|, |g_TRL|) over all the policy's gradients (one flat vector each): the
    gradient rows' relative difference."""
    assert sorted(ours) == sorted(theirs), (sorted(ours), sorted(theirs))
    a = torch.cat([ours[name].flatten() for name in sorted(ours)])
    b = torch.cat([theirs[name].flatten() for name in sorted(ours)])
    return float((a - b).norm() / max(a.norm(), b.norm()))


def rotated_kl(rows: list[dict]) -> list[dict]:
    """TRL's pairing on the same rows: example i's KL completion is example i-1's completion (cyclic in the batch)."""
    return [{**row, "KL_completion_ids": rows[i - 1]["completion_ids"]} for i, row in enumerate(rows)]


def kl_sources(rows: list[dict]) -> list[int | None]:
    """Which row's completion each row's KL completion is (None: none of the batch's)."""
    completions = [row["completion_ids"] for row in rows]
    return [
        completions.index(row["KL_completion_ids"]) if row["KL_completion_ids"] in completions else None for row in rows
    ]


def compare_kto(setup: Setup) -> Comparison:
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    result = Comparison("KTO (KTOObjective vs trl.KTOTrainer)")
    tokenizer = setup.tokenizer()
    pairs = max(setup.records // 2, 1)  # read as 2 examples each: as many examples as the unpaired variant's records
    paired_data = KTODocuments(setup.source(), tokenizer, max_tokens=1 << 16)
    paired_docs = paired_data.get_many(range(2 * pairs))
    unpaired = kto_unpaired_records(setup)
    unpaired_file = Path(setup.output_dir) / "kto_unpaired.jsonl"
    unpaired_file.write_text("".join(json.dumps(record) + "\n" for record in unpaired))
    unpaired_source = RecordSource([SourceSpec(str(unpaired_file), format="unpaired")])
    unpaired_data = KTODocuments(unpaired_source, tokenizer, max_tokens=1 << 16)
    unpaired_docs = unpaired_data.get_many(range(len(unpaired)))

    policy = tiny_model(tokenizer, seed=KTO_POLICY_SEED)
    reference = tiny_model(tokenizer, seed=KTO_REFERENCE_SEED)
    with torch.no_grad():
        reference.get_input_embeddings().weight.mul_(KTO_REFERENCE_SCALE)
    trl_policy, trl_reference = copy.deepcopy(policy), copy.deepcopy(reference)
    for model in (trl_policy, trl_reference):
        model.set_attn_implementation("sdpa")
    batch_size = max(len(paired_docs), len(unpaired_docs))
    args = KTOConfig(
        output_dir=setup.output_dir,
        beta=KTO_WEIGHTS.beta,
        desirable_weight=KTO_WEIGHTS.desirable,
        undesirable_weight=KTO_WEIGHTS.undesirable,
        max_length=4096,
        per_device_train_batch_size=batch_size,  # TRL rotates KL completions within chunks of this size
        per_device_eval_batch_size=batch_size,
        remove_unused_columns=False,
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        disable_tqdm=True,
    )
    trl_tokenizer = setup.tokenizer()
    # Built on the unpaired records (conversational): TRL tokenises them and adds their KL completions itself (the
    # "TRL's own" variant); the aligned variants hand its collator rows made of chattune's tokens.
    trainer = KTOTrainer(
        model=trl_policy,
        ref_model=trl_reference,
        args=args,
        processing_class=trl_tokenizer,
        train_dataset=Dataset.from_list(unpaired),
    )
    trl_pairs = trainer._prepare_dataset(
        Dataset.from_list(setup.records_as_dicts()[:pairs]), trl_tokenizer, args, "pairs"
    )

    zs = {}
    for name, data, documents, own in (
        (f"{pairs} pairs as {2 * pairs} examples", paired_data, paired_docs, trl_pairs),
        (f"{len(unpaired)} unpaired records", unpaired_data, unpaired_docs, trainer.train_dataset),
    ):
        ours = chattune_kto(policy, reference, documents)
        rows = [trl_kto_row(doc) for doc in documents]
        theirs = trl_kto(trainer, trl_policy, rows)
        result.add(f"{name}, aligned", kto_figures(ours, theirs), checked=True)
        result.add(f"{name}, aligned", {"rewards/margins": (ours["rewards/margins"], theirs["rewards/margins"])}, False)
        zs[name] = ours["kl"]

        # A training step: chattune's in microbatches (the step's z), TRL's on one batch, gradients compared
        step, grads = chattune_kto_step(policy, reference, documents)
        trl_step, trl_grads = trl_kto_step(trainer, trl_policy, rows)
        gradient = gradient_difference(grads, trl_grads)
        step_figures = {"loss": (step["loss"], trl_step["loss"]), "kl": (step["kl"], trl_step["kl"])}
        result.add(f"{name}, aligned, training step", step_figures, checked=True)
        norms = (
            float(torch.cat([g.flatten() for g in grads.values()]).norm()),
            float(torch.cat([g.flatten() for g in trl_grads.values()]).norm()),
        )
        result.rows.append(Row(f"{name}, aligned, training step: gradient norm", *norms, True, difference=gradient))

        # TRL's pairing on chattune's tokens (informational): each KL completion is the previous example's
        rotated = trl_kto(trainer, trl_policy, rotated_kl(rows))
        result.add(f"{name}, TRL pairing", {n: (ours[n], rotated[n]) for n in ("loss", "kl")}, checked=False)

        # TRL's own tokenisation, example order and pairing (informational)
        own_rows = [own[i] for i in range(len(own))]
        theirs_own = trl_kto(trainer, trl_policy, own_rows)
        result.add(f"{name}, TRL's own rows", kto_figures(ours, theirs_own), checked=False)
        order = "".join("d" if row["label"] else "u" for row in own_rows)
        ours_order = "".join("d" if d.doc_values["desirable"] == 1.0 else "u" for d in documents)
        partners = [data.partner_of(d.doc_id) for d in documents]
        result.notes.append(
            f"{name}, pairing: TRL's own rows {order} (d desirable, u undesirable) take as KL completion the "
            f"completion of rows {kl_sources(own_rows)} (the previous row, cyclic within its batch of {batch_size}); "
            f"chattune's examples {ours_order} take the reply of examples {partners} of the source (the same side "
            "of the next record, cyclic over the whole source)"
        )
        first = own_rows[0]
        ours_examples = [prompt_and_reply(*first_segment(doc)) for doc in documents]
        ours_prompt, ours_reply = ours_examples[0]
        # TRL's rows, in their order, against chattune's examples (any order): the prompt, the reply less its last
        # token ('\n'), which must be TRL's one extra scored token
        same = all(
            (row["prompt_ids"], row["completion_ids"][:-1]) in ours_examples
            and trl_tokenizer.decode(row["completion_ids"][-1:]) == "\n"
            for row in own_rows
        )
        result.notes.append(
            f"{name}, TRL's own rows: row 0 scores {trailing(trl_tokenizer, first['completion_ids'])} "
            f"({len(first['completion_ids'])} tokens after a {len(first['prompt_ids'])}-token prompt), chattune's "
            f"example {trailing(tokenizer, ours_reply)} ({len(ours_reply)} tokens after a {len(ours_prompt)}-token "
            f"prompt); every row's prompt tokens are chattune's and its scored tokens chattune's plus the template's "
            f"'\\n' after <|im_end|>: {same}"
        )
    result.notes.append(
        "aligned: TRL's rows get chattune's tokens: prompt_ids = the example's tokens before its reply, "
        "completion_ids = its scored tokens (the reply and <|im_end|>), KL_completion_ids = the scored tokens of "
        "chattune's mismatched sequence (whose prompt tokens equal the example's, asserted); TRL's collator "
        "concatenates prompt_ids with each and scores the completion tokens; one batch of all the examples, so TRL's "
        "per-batch z is chattune's per-step (here per-set) z: " + ", ".join(f"{k}: z = {v:.5g}" for k, v in zs.items())
    )
    result.notes.append(
        f"aligned, training step: chattune's accumulate_gradients on {KTO_STEP_MICROBATCHES} microbatches (its z the "
        "step's, from the no-grad pass over both) against TRL's compute_loss + backward on one batch of all the "
        "examples; the gradient row compares the policy's whole gradient vectors: |g_chattune - g_TRL| / max norm"
    )
    result.notes.append(
        "z: TRL's is the mean of (policy - reference) KL log-probs over one device batch, averaged over processes "
        "(each process's mean, unweighted), clamped at 0, detached: per compute_loss call, so per micro-batch under "
        "gradient accumulation and per batch in evaluation (TRL logs the batches' mean); chattune's is the sum over "
        "every microbatch and rank of the step (of the whole held-out set in evaluation) over their example count"
    )
    result.notes.append(
        "TRL's own tokenisation: prompt_ids = the prompt rendered with the generation prompt, completion_ids = the "
        "rest of prompt + completion rendered as one conversation (split where they diverge), so the template's '\\n' "
        "after <|im_end|> is scored; no eos is appended to a conversational completion. Its KL sequence is "
        "prompt_ids + the KL completion_ids: the same prompt tokens, as chattune's mismatched sequence has"
    )
    result.notes.append(
        "metrics: both log kl (z), rewards/chosen, rewards/rejected (beta r over the desirable / undesirable "
        "examples), rewards/margins, logps/chosen, logps/rejected (summed over the completion); TRL's margins only "
        "when both kinds are in the batch (chattune's mean of a kind absent is 0). TRL adds logits/*, entropy and "
        "num_tokens (every non-padding token, cumulative); chattune num_examples, num_desirable, num_tokens (the "
        "examples' trained tokens)"
    )
    result.notes.append(
        f"models: tiny Llama fp32, policy seed {KTO_POLICY_SEED}, reference seed {KTO_REFERENCE_SEED} with its "
        f"embeddings x{KTO_REFERENCE_SCALE:g} (z > 0, not clamped); beta {KTO_WEIGHTS.beta}, desirable_weight "
        f"{KTO_WEIGHTS.desirable}, undesirable_weight {KTO_WEIGHTS.undesirable}"
    )
    return result


def compare_grpo(setup: Setup) -> Comparison:
    """The GRPO family's losses against TRL's GRPOTrainer (scripts/parity/trl_grpo.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trl_grpo import compare_grpo as grpo

    return grpo(setup)


COMPARISONS: list[Callable[[Setup], Comparison]] = [compare_orpo, compare_reward, compare_kto, compare_grpo]


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
        from trl import GRPOTrainer, KTOTrainer, RewardTrainer  # noqa: F401
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
        f"reward: head x{HEAD_SCALE:g}; KTO: reference seed {KTO_REFERENCE_SEED}, embeddings "
        f"x{KTO_REFERENCE_SCALE:g}); tolerance {TOLERANCE:g} relative"
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
