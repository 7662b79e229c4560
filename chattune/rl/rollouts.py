"""The GRPO recipe's update steps, made from the policy's own samples: a `chattune.data.feed.StepSource`.

A rollout, on each data-parallel rank: take this rank's prompts of the step (`chattune.rl.prompts`), sample G
completions of each from the current policy (`chattune.rl.sampling`; the sharded model gathered once for the whole
rollout where every rank has room, as the sample replies are), score them (`chattune.rl.rewards`), turn each group's
rewards into advantages (`chattune.rl.advantages`), and pack the completions as documents into rows of at most
data.max_tokens_per_microbatch tokens (`chattune.rl.completion_documents`: the prompt untrained, the sampled tokens
trained with their advantage and the sampler's log-probs; with data.share_prompts a group's completions continue one
copy of their prompt). With rollout.steps_per_rollout = μ > 1 the same rows serve μ optimizer steps, the old policy's
log-probs computed once by a no-grad pass right after sampling; with loss.beta > 0 the reference's log-probs too. Every rank trains the same number of rows a step (the most any rank packed; empty rows fill the rest).

With loss.type=gkd and rollout.on_policy_share = λ < 1 (GKD's λ), a rollout is sampled with probability λ (a draw
seeded by the run's seed and the rollout's index: the same on every rank and on a resume); the others train on the
data's own replies (each prompt record's rollout.reply_field, rendered and located as SFT renders a last reply), one
completion document per prompt.

Its state is the rollout it holds (μ > 1: a resume inside a rollout trains on the very rows the uninterrupted run did)
and its counts; the prompts and the sampling RNG of each step follow from the step (`chattune.rl.prompts`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from chattune.config.schema import GRPOConfig
from chattune.data.documents import SKIP_REASONS, Document, Skipped
from chattune.data.feed import StepBatches
from chattune.data.ingest.formats import DataError
from chattune.data.packing import PackedBatch, best_fit_decreasing, collate_packed, empty_batch
from chattune.data.templates.chat_template import ChatTemplateError, probe_template, tokenize_conversation
from chattune.distributed import all_reduce_max
from chattune.errors import UserError
from chattune.model.generate import Sampling, sharded_generation, stop_token_ids
from chattune.model.peft.adapters import BaseModelView
from chattune.objectives.policy_gradient import ADVANTAGE, OLD_LOGP, REF_LOGP, TEACHER_LOGP
from chattune.parallel.fsdp import Placement, reshard
from chattune.rl.advantages import group_advantages, is_uniform
from chattune.rl.completion_documents import completion_document, group_documents
from chattune.rl.prompts import Prompt, PromptOrder, PromptSource, place_seed
from chattune.rl.rewards import RewardFunction, score
from chattune.rl.sampling import GroupSampling, Sampled, sample_groups

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutSettings:
    """What a rollout takes and makes (the recipe's `rollout`, `advantage` and `reward` sections): P prompts over all
    data-parallel ranks, G completions of each drawn as `sampling` says (ended by a stop token, one of
    `stop_strings`, or the budget; the chat template called with `template_kwargs`), μ optimizer steps on each
    rollout; the advantages' scale, whether groups of equal rewards are left out, what a failed reward does; the
    token budget of a row and what a prompt too long for it does (`overlong`: drop, counted, or error)."""

    prompts_per_step: int
    completions_per_prompt: int
    sampling: Sampling
    steps_per_rollout: int = 1
    stop_strings: tuple[str, ...] = ()
    advantage_scale: str = "std"
    skip_uniform_groups: bool = False
    on_reward_error: str = "error"
    budget: int = 2048
    overlong: str = "drop"
    seed: int = 0  # the run's: with a place in the prompt stream, it seeds that prompt's order and sampling
    num_epochs: int | None = None  # passes over the prompts, then the run ends (None: max_steps decides)
    on_policy_share: float = 1.0  # GKD's λ: the share of rollouts sampled; the others are the data's replies
    reply_field: str = "reply"  # where a prompt record holds its own reply
    share_prompts: bool = False  # a group's completions continue one copy of their prompt (data.share_prompts)

    @classmethod
    def from_config(cls, cfg: GRPOConfig) -> RolloutSettings:
        """The settings a GRPO run's `rollout`, `advantage`, `reward` and `data` sections name."""
        rollout = cfg.rollout
        return cls(
            prompts_per_step=rollout.prompts_per_step,
            completions_per_prompt=rollout.completions_per_prompt,
            sampling=Sampling(
                max_new_tokens=rollout.max_new_tokens,
                temperature=rollout.temperature,
                top_p=rollout.top_p,
                top_k=rollout.top_k,
                min_p=rollout.min_p,
            ),
            steps_per_rollout=rollout.steps_per_rollout,
            stop_strings=tuple(rollout.stop_strings),
            advantage_scale=cfg.advantage.scale,
            skip_uniform_groups=rollout.skip_uniform_groups,
            on_reward_error=cfg.reward.on_error,
            budget=cfg.data.max_tokens_per_microbatch,
            overlong=cfg.data.overlong,
            seed=cfg.seed,
            num_epochs=cfg.data.num_epochs,
            on_policy_share=rollout.on_policy_share,
            reply_field=rollout.reply_field,
            share_prompts=cfg.data.share_prompts,
        )


@dataclass(frozen=True)
class RolloutModels:
    """The models a rollout runs: the `policy` being trained (sharded, and where it computes: `placement`), and
    what scores the completions for the loss: the old policy's log-probs (`old_log_probs`: μ > 1), a frozen
    `reference` (loss.beta > 0; None: no reference) and a frozen `teacher` (on-policy distillation)."""

    policy: nn.Module
    placement: Placement
    old_log_probs: bool = False
    reference: nn.Module | BaseModelView | None = None
    teacher: nn.Module | None = None  # on-policy distillation: scores every sampled token


@dataclass(frozen=True)
class SamplesLog:
    """Where rank 0 writes a rollout's first group (samples.jsonl), on the rollouts whose first step is the first or
    a multiple of `every`."""

    path: Path
    every: int = 1

    def due(self, step: int) -> bool:
        return step == 1 or step % max(self.every, 1) == 0


@dataclass
class Rollout:
    """One rollout on this rank: its index, its rows (as every step of it trains them) and its figures."""

    index: int
    rows: list[PackedBatch]
    figures: dict[str, float]
    epoch: int = 0


@dataclass
class _Group:
    place: int
    prompt: Prompt
    samples: list[Sampled]
    rewards: list[float] = field(default_factory=list)
    parts: dict[str, list[float]] = field(default_factory=dict)
    failed: bool = False


class RolloutSteps:
    """The recipe's `StepSource` (the module docstring); `samples`: where rank 0 logs a group of some rollouts."""

    mixer = None

    def __init__(
        self,
        models: RolloutModels,
        tokenizer: PreTrainedTokenizerBase,
        prompts: PromptSource,
        rewards: Sequence[RewardFunction],
        settings: RolloutSettings,
        pad_id: int,
        samples: SamplesLog | None = None,
    ):
        dims = models.placement.dims
        if settings.prompts_per_step % dims.data_ranks:
            raise UserError(
                f"rollout.prompts_per_step={settings.prompts_per_step} does not divide over the run's "
                f"{dims.data_ranks} data-parallel ranks: make it a multiple of {dims.data_ranks}"
            )
        if len(prompts) == 0:
            raise UserError("data.train holds no prompt")
        self.models, self.tokenizer, self.prompts, self.rewards = models, tokenizer, prompts, list(rewards)
        self.settings, self.pad_id, self.samples = settings, pad_id, samples
        self.order = PromptOrder(len(prompts), settings.seed)
        self.how = GroupSampling(
            settings.sampling,
            settings.completions_per_prompt,
            tuple(stop_token_ids(tokenizer)),
            settings.stop_strings,
        )
        self.per_rank = settings.prompts_per_step // dims.data_ranks
        # where a rendered conversation's last reply starts and ends (the data's replies: off-policy rollouts)
        self.markers = probe_template(tokenizer) if settings.on_policy_share < 1 else None
        self.current: Rollout | None = None
        self.last_step = 0  # the last step this source gave
        self.counts = dict.fromkeys(SKIP_REASONS, 0)

    def _rollout_of(self, step: int) -> int:
        return (step - 1) // self.settings.steps_per_rollout

    @property
    def epoch(self) -> int:
        """The prompt stream's epoch at the next step's rollout's first prompt."""
        return self._rollout_of(self.last_step + 1) * self.settings.prompts_per_step // len(self.prompts)

    @property
    def finished(self) -> bool:
        """data.num_epochs passes over the prompts are done: the next step would sample a rollout that starts past
        them (a rollout's later steps still train on it)."""
        if self.settings.num_epochs is None:
            return False
        fresh = self.current is None or self._rollout_of(self.last_step + 1) != self.current.index
        return fresh and self.epoch >= self.settings.num_epochs

    @property
    def skipped(self) -> dict[str, int]:
        """This rank's prompts left out: over the budget (`overlong`) and unreadable (`bad_record`)."""
        return dict(self.counts)

    def next_step(self, step: int) -> StepBatches:
        index = self._rollout_of(step)
        fresh = self.current is None or self.current.index != index
        if fresh:
            self.current = self._rollout(index, step)
        assert self.current is not None
        self.last_step = step
        figures = dict(self.current.figures)
        if not fresh:  # a later step of the same rollout: trained again, not sampled again
            figures["rollout_s"] = 0.0
        return StepBatches(list(self.current.rows), epoch=self.current.epoch, figures=figures)

    def close_step(self, ranks_at_epoch_end: int) -> list[tuple[int, dict[str, int]]]:
        return []  # (an epoch of prompts ends inside a rollout: no figures of its own)

    def state_dict(self) -> dict:
        return {"current": self.current, "last_step": self.last_step, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict) -> None:
        self.current, self.last_step, self.counts = state["current"], state["last_step"], dict(state["counts"])

    def close(self) -> None:
        self.current = None

    def held_out_sums(self, at_once: int) -> dict[str, float]:
        """Collective: every prompt of the source answered once (this data-parallel rank's share, in the source's
        order; `at_once` prompts a generation call, as a training rollout's, so that the KV cache is no larger),
        its G completions sampled and scored as a rollout's, and their figures summed on this rank (a rollout's,
        nothing trained): the GRPO recipe's held-out evaluation (`chattune.rl.held_out`)."""
        ranks, rank = self.models.placement.dims.data_ranks, self.models.placement.dims.data_rank
        per_rank = -(-len(self.prompts) // ranks)
        first = min(rank * per_rank, len(self.prompts))
        end = min(first + per_rank, len(self.prompts))
        groups = []
        for start in range(first, first + per_rank, at_once):  # (as many calls on every rank: they may be synced)
            groups += self._sample(range(min(start, end), min(start + at_once, end)))
        self._score(groups)
        _, figures = self._documents(groups)
        if not self.models.placement.dims.reports_rows:  # (a tp group's other ranks sampled the same)
            figures = dict.fromkeys(figures, 0.0)
        return figures

    # --- one rollout ---

    def on_policy(self, index: int) -> bool:
        """Whether rollout `index` samples from the policy (else it trains on the data's replies): a draw of its own
        against rollout.on_policy_share, from the run's seed and the index alone."""
        share = self.settings.on_policy_share
        if share >= 1:
            return True
        return bool(np.random.default_rng([self.settings.seed, index, 0x6B64]).random() < share)

    def _rollout(self, index: int, step: int) -> Rollout:
        """Collective: rollout `index` on this rank, its rows and figures."""
        started = time.perf_counter()
        settings, placement = self.settings, self.models.placement
        first = index * settings.prompts_per_step + placement.dims.data_rank * self.per_rank
        places = range(first, first + self.per_rank)
        groups: list[_Group] = []
        sampled = self.on_policy(index)
        if sampled:
            groups = self._sample(places)
            self._score(groups)
            documents, figures = self._documents(groups)
        else:  # (every rank draws the same: none of them generates)
            documents, figures = self._data_replies(places)
        if settings.on_policy_share < 1:
            figures["on_policy"] = float(sampled)
        rows = [collate_packed(row) for row in best_fit_decreasing(documents, settings.budget)]
        # every rank scores and trains as many rows as the most any packed: every forward is a collective
        count = max(all_reduce_max(len(rows), placement.device), 1)
        rows += [empty_batch(self.pad_id) for _ in range(count - len(rows))]
        self._score_tokens(rows)
        figures["rollout_s"] = time.perf_counter() - started
        if not placement.dims.reports_rows:  # (a tp group's other ranks made the same rollout: counted once)
            figures = dict.fromkeys(figures, 0.0)
        if self.samples is not None and groups and self.samples.due(step):
            self._write_samples(step, groups[0])
        epoch = first // len(self.prompts)
        return Rollout(index, rows, figures, epoch)

    def _fits(self, prompt: Prompt, tokens: int, what: str) -> bool:
        """Whether `prompt`'s `tokens` fit a row; if not, a UserError naming it, or (data.overlong=drop) counted."""
        budget = self.settings.budget
        if tokens <= budget:
            return True
        problem = f"{prompt.where}: {what} exceed data.max_tokens_per_microbatch={budget}"
        if self.settings.overlong != "drop":
            raise UserError(problem + " (data.overlong=drop leaves such prompts out, counted)")
        logger.warning("left out %s (data.overlong=drop)", problem)
        self.counts["overlong"] += 1
        return False

    def _prompt_at(self, place: int) -> Prompt | None:
        """The prompt at the stream's `place`, or None where it is skipped (counted)."""
        prompt = self.prompts.get(self.order.at(place)[1])
        if isinstance(prompt, Skipped):
            self.counts[prompt.reason] += 1
            return None
        return prompt

    def _sample(self, places: range) -> list[_Group]:
        """Collective: the groups of this rank's prompts at `places` (a skipped prompt gives none)."""
        settings, models = self.settings, self.models
        prompts: list[tuple[int, Prompt | None]] = []
        new_tokens = settings.sampling.max_new_tokens
        for place in places:
            prompt = self._prompt_at(place)
            if prompt is not None:
                what = f"its prompt ({len(prompt.ids)} tokens) and rollout.max_new_tokens={new_tokens}"
                prompt = prompt if self._fits(prompt, len(prompt.ids) + new_tokens, what) else None
            prompts.append((place, prompt))
        kept = [(place, prompt) for place, prompt in prompts if prompt is not None]
        groups = []
        with sharded_generation(models.policy, models.placement) as alone:
            if kept or not alone:  # (ranks that generate together, synced, all call it: one without prompts too)
                sampled = sample_groups(
                    models.policy,
                    self.tokenizer,
                    [prompt.ids for _, prompt in kept] or [[self.pad_id]],
                    self.how,
                    seed=place_seed(settings.seed, places.start),
                    device=models.placement.device,
                    synced=not alone,
                )
                groups = [_Group(place, prompt, samples) for (place, prompt), samples in zip(kept, sampled)]
        return groups

    def _score(self, groups: list[_Group]) -> None:
        """Every completion's rewards, in one call of each reward function for the rank's whole rollout."""
        if not groups:
            return
        flat = [(group, sample) for group in groups for sample in group.samples]
        scores = score(
            self.rewards,
            [group.prompt.record.messages for group, _ in flat],
            [sample.text for _, sample in flat],
            [sample.token_ids for _, sample in flat],
            [group.prompt.record.fields for group, _ in flat],
            [group.prompt.where for group, _ in flat],
            self.settings.on_reward_error,
        )
        size = self.settings.completions_per_prompt
        for number, group in enumerate(groups):
            span = range(number * size, (number + 1) * size)
            group.rewards = [scores.total[i] for i in span]
            group.parts = {name: [values[i] for i in span] for name, values in scores.parts.items()}
            group.failed = any(i in scores.failed for i in span)

    def _documents(self, groups: list[_Group]) -> tuple[list[Document], dict[str, float]]:
        """The completions of the groups that train as documents, and the rollout's figures on this rank (sums)."""
        settings, size = self.settings, self.settings.completions_per_prompt
        rewarded = bool(self.rewards)  # (on-policy distillation may run without a reward: none reported)
        figures = {
            "ranks": 1.0,
            "sampled": 0.0,
            **({"reward_sum": 0.0, "reward_sq_sum": 0.0} if rewarded else {}),
            **{f"reward_sum/{function.name}": 0.0 for function in self.rewards},
            "advantage_abs_sum": 0.0,
            "groups": 0.0,
            "uniform_groups": 0.0,
            "skipped_groups": 0.0,
            "sampled_tokens": 0.0,
            "truncated": 0.0,
            "entropy_sum": 0.0,
        }
        documents = []
        for group in groups:
            figures["groups"] += 1
            if group.failed:  # reward.on_error=skip: a group with a failed reward has no advantages
                figures["skipped_groups"] += 1
                continue
            advantages = group_advantages(group.rewards, settings.advantage_scale)
            group.parts[ADVANTAGE] = advantages
            uniform = is_uniform(group.rewards)
            figures["uniform_groups"] += uniform
            for k, sample in enumerate(group.samples):
                figures["sampled"] += 1
                if rewarded:
                    figures["reward_sum"] += group.rewards[k]
                    figures["reward_sq_sum"] += group.rewards[k] ** 2
                for function in self.rewards:
                    figures[f"reward_sum/{function.name}"] += group.parts[function.name][k]
                figures["advantage_abs_sum"] += abs(advantages[k])
                figures["sampled_tokens"] += len(sample.token_ids)
                figures["truncated"] += not sample.finished
                figures["entropy_sum"] += sum(sample.entropy)
            if uniform and settings.skip_uniform_groups:
                figures["skipped_groups"] += 1
                continue
            completions = [
                (group.place * size + k, sample, advantages[k])
                for k, sample in enumerate(group.samples)
                if sample.token_ids
            ]
            if settings.share_prompts:
                documents += group_documents(group.prompt.ids, completions, settings.budget)
            else:
                documents += [completion_document(doc_id, group.prompt.ids, *rest) for doc_id, *rest in completions]
        return documents, figures

    def _data_replies(self, places: range) -> tuple[list[Document], dict[str, float]]:
        """An off-policy rollout (GKD's 1 - λ): each prompt's own reply as its one completion document, rendered with
        its conversation as SFT renders a last reply (its end of turn included), and the rollout's figures."""
        field_name, size = self.settings.reply_field, self.settings.completions_per_prompt
        figures = dict.fromkeys(
            ("sampled", "advantage_abs_sum", "groups", "uniform_groups", "skipped_groups", "sampled_tokens"), 0.0
        )
        figures["ranks"], figures["truncated"] = 1.0, 0.0
        documents = []
        for place in places:
            prompt = self._prompt_at(place)
            rendered = self._rendered_reply(prompt, field_name) if prompt is not None else None
            if prompt is None or rendered is None:
                continue
            ids, reply = rendered
            tokens = len(ids) + len(reply)
            if not self._fits(prompt, tokens, f"its prompt and its reply ({tokens} tokens)"):
                continue
            text = prompt.record.fields[field_name]
            sample = Sampled(reply, [0.0] * len(reply), [0.0] * len(reply), finished=True, text=text)
            documents.append(completion_document(place * size, ids, sample, 0.0))
            figures["groups"] += 1
            figures["sampled"] += 1
            figures["sampled_tokens"] += len(reply)
        return documents, figures

    def _rendered_reply(self, prompt: Prompt, field_name: str) -> tuple[list[int], list[int]] | None:
        """(the conversation's ids before its reply, the reply's ids) of `prompt`'s record's own reply; a DataError
        naming the record where it has none or the template cannot render it (with data.on_bad_record=skip: None,
        counted)."""
        reply = prompt.record.fields.get(field_name)
        try:
            if not isinstance(reply, str) or not reply:
                raise DataError(
                    f"{prompt.where}: no reply in its field {field_name!r} (rollout.reply_field), which gkd's "
                    "off-policy rollouts train on (rollout.on_policy_share < 1): give every record one, or set "
                    "rollout.on_policy_share=1"
                )
            assert self.markers is not None
            messages = [*prompt.record.messages, {"role": "assistant", "content": reply}]
            try:
                rendered = tokenize_conversation(
                    self.tokenizer, messages, self.markers, prompt.record.tools, last_turn_only=True
                )
            except ChatTemplateError as error:
                raise DataError(f"{prompt.where}: the chat template cannot render its reply: {error}") from error
        except DataError as error:
            if self.prompts.on_bad_record != "skip":
                raise
            logger.warning("skipped %s (data.on_bad_record=skip)", error)
            self.counts["bad_record"] += 1
            return None
        trained = [i for i, kept in enumerate(rendered.assistant_mask) if kept]
        return rendered.input_ids[: trained[0]], rendered.input_ids[trained[0] : trained[-1] + 1]

    @torch.no_grad()
    def _score_tokens(self, rows: list[PackedBatch]) -> None:
        """The old policy's (μ > 1), the reference's (loss.beta > 0) and the teacher's (distillation) log-probs of
        every row's tokens, declared on the row: no-grad forwards of the models as they are now."""
        models = self.models
        scorers = (
            (OLD_LOGP, models.policy if models.old_log_probs else None),
            (REF_LOGP, models.reference),
            (TEACHER_LOGP, models.teacher),
        )
        for name, model in scorers:
            if model is None:
                continue
            was_training = model.training
            model.eval()
            for row in rows:
                losses = model(row.to(models.placement.device)).float().cpu()
                row.token_values[name] = (-losses).reshape(1, -1)
            model.train(was_training)
            reshard(model)  # (a forward without a backward leaves the root gathered; a LoRA base view: the policy's)

    def _write_samples(self, step: int, group: _Group) -> None:
        """Rank 0: the group's completions, with their rewards, in samples.jsonl."""
        if self.models.placement.dims.data_rank != 0 or not self.models.placement.dims.is_main:
            return
        assert self.samples is not None
        with self.samples.path.open("a") as file:
            for k, sample in enumerate(group.samples):
                line = {
                    "step": step,
                    "prompt": group.prompt.record.messages,
                    "reply": sample.text,
                    "reward": group.rewards[k],
                    "rewards": {name: values[k] for name, values in group.parts.items() if name != ADVANTAGE},
                    "advantage": group.parts.get(ADVANTAGE, [0.0] * len(group.samples))[k],
                    "finished": sample.finished,
                }
                file.write(json.dumps(line) + "\n")
