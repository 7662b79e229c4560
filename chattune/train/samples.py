"""Sample replies at every evaluation (`chattune.train.evaluation.Evaluator` decides when one is due): a few
prompts answered greedily by the model being trained, written by rank 0 to `output_dir/samples.jsonl` (one line
per prompt: step, prompt, reply) and, with logger=wandb, as a table.

`eval.samples` prompts come from `eval.sample_prompts` (a prompts file, `chattune.data.templates.prompts`) or else from
the held-out set (`data.eval`: the context before each of its first records' last reply). Rank r answers prompts
r, r + W, ... greedily with the same token limit (under tensor parallelism, the ranks of tp group g answer
prompts g, g + W/T, ... together). Where every rank has room for the whole model, it is gathered
once for all the replies and each rank generates on its own (`chattune.parallel.fsdp.stay_gathered`: a reply no
longer gathers every layer for every token). Otherwise every forward is a collective: the ranks answer in turns
of one prompt each (a rank out of prompts repeats its last one, whose answer nobody keeps) and transformers'
`synced_gpus` keeps a rank whose reply has ended stepping until every rank's has (`chattune.model.generate`).
Greedy replies draw no random numbers: the training that follows is the one without samples.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch.distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from chattune.config.schema import RunConfig
from chattune.data.ingest.records import source_specs
from chattune.data.templates.prompts import Prompt, held_out_prompts, read_prompts_file
from chattune.distributed import ParallelDims
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.generate import (
    Sampling,
    generate_reply,
    generation_failure,
    prompt_ids,
    sharded_generation,
    stop_token_ids,
)
from chattune.parallel.fsdp import Placement
from chattune.train.metrics import start_step_log

logger = logging.getLogger(__name__)

HeldOutRecords = Sequence[int] | np.ndarray  # one training source's held-out record numbers

SAMPLES_FILE = "samples.jsonl"


def run_samples(
    cfg: RunConfig,
    tokenizer: PreTrainedTokenizerBase,
    dims: ParallelDims,
    resume_step: int | None,
    held_out_records: Sequence[HeldOutRecords] = (),
    wandb_run=None,
    model: PreTrainedModel | None = None,
) -> EvalSamples | None:
    """The run's sample prompts, ready to answer (None: eval.samples=0, evaluation off, no prompts, or a model
    that stock transformers cannot generate with: `model`'s class, said once). Rank 0 starts samples.jsonl: afresh,
    or for a resumed run (`resume_step`) with its lines up to that step (the later ones were copied aside by
    `chattune.checkpoint.output_dir`), also when sampling is now off."""
    path = Path(cfg.output_dir) / SAMPLES_FILE
    prompts = sample_prompts(cfg, held_out_records)
    if prompts and model is not None and (failure := generation_failure(model)):
        if dims.is_main:
            logger.warning(
                "eval.samples: %s; sample replies are off for this run (eval.samples=0 turns them off without this check)",
                failure,
            )
        prompts = []
    if dims.is_main and (prompts or (resume_step is not None and path.exists())):
        start_step_log(path, resume_step)
    if not prompts:
        return None
    return EvalSamples(prompts, tokenizer, cfg.eval.max_new_tokens, dims, path, wandb_run)


def sample_prompts(cfg: RunConfig, held_out_records: Sequence[HeldOutRecords] = ()) -> list[Prompt]:
    """The prompts a run samples: the first eval.samples of eval.sample_prompts, or else of data.eval, then of
    the records data.eval_split holds out (`held_out_records`: their numbers in each training source); none with
    eval.samples=0, or evaluation off."""
    count = cfg.eval.samples if cfg.eval_every > 0 else 0
    if count <= 0:
        return []
    if cfg.eval.sample_prompts is not None:
        return read_prompts_file(cfg.eval.sample_prompts)[:count]
    prompts = held_out_prompts(source_specs(cfg.data.eval), count) if cfg.data.eval else []
    for spec, records in zip(source_specs(cfg.data.train), held_out_records):
        if len(prompts) < count and len(records):
            prompts += held_out_prompts([spec], count - len(prompts), records)
    return prompts


class EvalSamples:
    """The sample prompts of a run, tokenized once, answered by the model at each evaluation (`answer`) and
    written by rank 0 (`write`)."""

    def __init__(
        self,
        prompts: list[Prompt],
        tokenizer: PreTrainedTokenizerBase,
        max_new_tokens: int,
        dims: ParallelDims,
        path: Path,
        wandb_run=None,
    ):
        """`path`: the samples.jsonl rank 0 appends to; `wandb_run`: rank 0's, with logger=wandb."""
        self.prompts, self.tokenizer, self.dims = prompts, tokenizer, dims
        self.path, self.wandb_run = path, wandb_run
        self.sampling = Sampling(max_new_tokens=max_new_tokens)  # greedy
        self.stop_ids = stop_token_ids(tokenizer)
        self.ids = [prompt_ids(tokenizer, p.messages, p.tools) for p in prompts]

    def answer(self, model: PackedCausalLM, placement: Placement, gather: bool | None = None) -> list[str]:
        """Collective: every prompt's greedy reply (rank 0 gets them all, in prompt order; the others []).
        `placement`: the model's (`chattune.parallel.fsdp.shard_model`); `gather`: as `sharded_generation` (None:
        where it fits)."""
        rank, world = self.dims.rank, self.dims.world_size
        # The ranks of a tp group split every layer of the model: they answer the same prompts, in step, and the
        # group's first one hands the replies on.
        group, groups = rank // self.dims.tp, world // self.dims.tp
        mine = list(range(group, len(self.ids), groups))
        replies: dict[int, str] = {}
        with sharded_generation(model, placement, gather) as on_its_own:
            if on_its_own:  # the model whole on every rank: no collective until the replies are gathered
                for index in mine:
                    replies[index] = self._reply(model, placement, index, synced=False)
            else:  # every forward gathers: the ranks take turns of one prompt each, in step
                for turn in range(-(-len(self.ids) // groups)):
                    index = mine[min(turn, len(mine) - 1)] if mine else 0  # out of prompts: one again, dropped
                    reply = self._reply(model, placement, index, synced=world > 1)
                    if turn < len(mine):
                        replies[index] = reply
        if world > 1:
            gathered: list[dict[int, str] | None] | None = [None] * world if rank == 0 else None
            dist.gather_object(replies if rank % self.dims.tp == 0 else {}, gathered, dst=0)
            if rank != 0:
                return []
            replies = {index: text for part in gathered or [] if part is not None for index, text in part.items()}
        return [replies[i] for i in range(len(self.ids))]

    def _reply(self, model: PackedCausalLM, placement: Placement, index: int, synced: bool) -> str:
        ids, sampling = self.ids[index], self.sampling
        return generate_reply(model, self.tokenizer, ids, sampling, self.stop_ids, synced, placement.device).text

    def write(self, step: int, replies: list[str]) -> None:
        """Rank 0: one line per prompt in samples.jsonl, and the step's table to wandb."""
        if not self.dims.is_main:
            return
        rows = [
            {"step": step, "prompt": prompt.messages, "reply": reply} for prompt, reply in zip(self.prompts, replies)
        ]
        with self.path.open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        if self.wandb_run is not None:
            import wandb

            table = wandb.Table(
                columns=["step", "prompt", "reply"],
                data=[[step, prompt.as_text(), reply] for prompt, reply in zip(self.prompts, replies)],
            )
            self.wandb_run.log({"samples": table}, step=step)

    def __call__(self, model: PackedCausalLM, placement: Placement, step: int) -> None:
        """Collective: answer the prompts with the model as it is at `step`, and write the replies."""
        started = time.perf_counter()
        replies = self.answer(model, placement)
        self.write(step, replies)
        if self.dims.is_main:
            logger.info(
                "step %d: %d sample replies in %.1f s (%s)",
                step,
                len(replies),
                time.perf_counter() - started,
                self.path,
            )
