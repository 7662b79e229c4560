"""GRPO-family losses: chattune's `PolicyGradientObjective` through its update step against TRL's
`GRPOTrainer._compute_loss` (called on a real trainer, its inputs made here), on the same completions, advantages,
old log-probs and reference log-probs, for each loss both define: grpo, dapo, dr_grpo, cispo, and GSPO (TRL: loss_type
grpo with importance_sampling_level=sequence). The step's loss and its gradients are compared (part of
scripts/parity/compare_trl.py, which imports this module).

Alignment: every completion answers the same prompt (TRL left-pads prompts of different lengths, and a plain forward
of a left-padded row shifts its rotary positions); the completions are random tokens right-padded in TRL's rows (a
loss does not ask how they were drawn), 2 groups of 4; both sides score them at the sampling temperature 0.7. TRL's
CISPO cap is its epsilon_high (5.0, ScaleRL's), chattune's loss.cispo_max_ratio. TRL corrects for the sampler's
distribution only with vLLM: the comparison runs without it (chattune's rollout.is_correction is tested on its own).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from compare_trl import CPU, Comparison, Row, Setup, gradient_difference, tiny_model

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.feed import StepBatches
from chattune.data.packing import collate_packed
from chattune.model.causal_lm import PackedCausalLM
from chattune.objectives.policy_gradient import ADVANTAGE, OLD_LOGP, REF_LOGP, PolicyGradientObjective, PolicyLoss
from chattune.parallel.fsdp import Placement
from chattune.train.step import accumulate_gradients

TEMPERATURE = 0.7
MAX_NEW_TOKENS = 8
COMPLETIONS = 8
BETA = 0.04
# (chattune's loss.type, TRL's loss_type, TRL's importance_sampling_level, epsilon_low, epsilon_high)
LOSSES = [
    ("grpo", "grpo", "token", 0.2, 0.2),
    ("dapo", "dapo", "token", 0.2, 0.28),
    ("dr_grpo", "dr_grpo", "token", 0.2, 0.2),
    ("gspo", "grpo", "sequence", 3e-4, 4e-4),
    ("cispo", "cispo", "token", 0.2, 5.0),
]


def completions(tokenizer) -> tuple[list[int], list[dict]]:
    """One prompt of the demo's task and `COMPLETIONS` completions of it: random tokens, old log-probs set later."""
    prompt = [{"role": "user", "content": "Sort these numbers in ascending order: 97, 53, 5, 33"}]
    ids = list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=True)["input_ids"])
    rng = np.random.default_rng(0)
    made = [
        {
            "tokens": rng.integers(10, len(tokenizer), size=int(rng.integers(2, MAX_NEW_TOKENS + 1))).tolist(),
            "advantage": float(rng.normal()),
        }
        for _ in range(COMPLETIONS)
    ]
    return ids, made


def logps_at_temperature(model, prompt: list[int], tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy()


def with_old_and_reference(model, reference, prompt: list[int], made: list[dict]) -> None:
    """Each completion's old log-probs (the policy's perturbed: several optimizer steps on a rollout, the clip in
    play) and the reference's, at the temperature."""
    rng = np.random.default_rng(1)
    for item in made:
        item["old"] = logps_at_temperature(model, prompt, item["tokens"]) + rng.normal(0, 0.3, len(item["tokens"]))
        item["ref"] = logps_at_temperature(reference, prompt, item["tokens"])


def chattune_step(model, prompt: list[int], made: list[dict], loss: PolicyLoss) -> tuple[float, dict]:
    documents = []
    for d, item in enumerate(made):
        tokens, start = item["tokens"], len(prompt) - 1
        ids = np.array(prompt + tokens)
        labels = np.full(len(ids), IGNORE_INDEX)
        labels[start : start + len(tokens)] = tokens
        values = {}
        for name, key in ((OLD_LOGP, "old"), (REF_LOGP, "ref")):
            column = np.zeros(len(ids), dtype=np.float32)
            column[start : start + len(tokens)] = item[key]
            values[name] = column
        documents.append(Document(d, ids, labels, token_values=values, doc_values={ADVANTAGE: item["advantage"]}))
    packed = PackedCausalLM(copy.deepcopy(model), loss_chunk_size=16)
    packed.logit_transform = packed.logit_transform.at_temperature(TEMPERATURE)
    result = accumulate_gradients(
        packed, PolicyGradientObjective(loss), StepBatches([collate_packed(documents)]), Placement.one_rank(CPU)
    )
    grads = {name.removeprefix("hf_model."): p.grad.clone() for name, p in packed.named_parameters()}
    return result.loss_sum / result.global_units, grads


def trl_inputs(tokenizer, prompt: list[int], made: list[dict], beta: float) -> dict:
    width = max(len(item["tokens"]) for item in made)
    pad = tokenizer.pad_token_id
    completion_ids = torch.tensor([item["tokens"] + [pad] * (width - len(item["tokens"])) for item in made])
    mask = torch.tensor([[1] * len(item["tokens"]) + [0] * (width - len(item["tokens"])) for item in made])

    def padded(key: str) -> torch.Tensor:
        return torch.tensor(
            np.stack([np.pad(item[key], (0, width - len(item[key]))) for item in made]), dtype=torch.float32
        )

    inputs = {
        "prompt_ids": torch.tensor([prompt] * len(made)),
        "prompt_mask": torch.ones(len(made), len(prompt), dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": mask,
        "advantages": torch.tensor([item["advantage"] for item in made]),
        "old_per_token_logps": padded("old"),
        "num_items_in_batch": mask.sum(),
    }
    if beta:
        inputs["ref_per_token_logps"] = padded("ref")
    return inputs


def compare_grpo(setup: Setup) -> Comparison:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    result = Comparison("GRPO family (PolicyGradientObjective vs trl.GRPOTrainer._compute_loss)")
    tokenizer = setup.tokenizer()
    policy, reference = tiny_model(tokenizer, seed=0), tiny_model(tokenizer, seed=1)
    for model in (policy, reference):
        model.set_attn_implementation("sdpa")
    prompt, made = completions(tokenizer)
    with_old_and_reference(policy, reference, prompt, made)
    for ours_type, trl_type, level, low, high in LOSSES:
        for beta in (0.0, BETA):
            trl_policy = copy.deepcopy(policy)
            args = GRPOConfig(
                output_dir=setup.output_dir,
                use_cpu=True,
                bf16=False,
                fp16=False,
                report_to="none",
                disable_tqdm=True,
                per_device_train_batch_size=COMPLETIONS,
                num_generations=4,
                max_completion_length=MAX_NEW_TOKENS,
                temperature=TEMPERATURE,
                loss_type=trl_type,
                importance_sampling_level=level,
                epsilon=low,
                epsilon_high=high,
                beta=0.0,  # (a beta here makes it load a reference by the model's name: set after, its log-probs given)
            )
            trainer = GRPOTrainer(
                model=trl_policy,
                reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)],
                args=args,
                train_dataset=Dataset.from_list([{"prompt": "x"}] * COMPLETIONS),
                processing_class=setup.tokenizer(),
            )
            trainer.beta = beta
            trainer.current_gradient_accumulation_steps = 1  # (set by Trainer's loop: one microbatch, one step)
            trainer.model.train()
            trl_loss = trainer._compute_loss(trainer.model, trl_inputs(tokenizer, prompt, made, beta))
            trl_loss.backward()
            trl_grads = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
            loss = PolicyLoss(
                ours_type,
                epsilon_low=low,
                epsilon_high=high,
                beta=beta,
                cispo_max_ratio=high,
                max_new_tokens=MAX_NEW_TOKENS,
            )
            ours, grads = chattune_step(policy, prompt, made, loss)
            name = f"{ours_type}{f', beta {beta:g}' if beta else ''}"
            result.add(name, {"loss": (ours, float(trl_loss))}, checked=True)
            norms = (
                float(torch.cat([g.flatten() for g in grads.values()]).norm()),
                float(torch.cat([g.flatten() for g in trl_grads.values()]).norm()),
            )
            result.rows.append(
                Row(f"{name}: gradient norm", *norms, True, difference=gradient_difference(grads, trl_grads))
            )
    result.notes += [
        f"{COMPLETIONS} completions (2 groups of 4) of one demo prompt, random tokens of 2 to {MAX_NEW_TOKENS}, "
        f"temperature {TEMPERATURE}; old log-probs the policy's + N(0, 0.3) (the clip in play); reference: seed 1",
        "gspo is TRL's loss_type=grpo with importance_sampling_level=sequence (the GSPO paper's objective); cispo's "
        "cap is TRL's epsilon_high (5.0) and chattune's loss.cispo_max_ratio",
        "the gradient norm row's relative difference is that of the whole gradient (the worst parameter)",
    ]
    return result
