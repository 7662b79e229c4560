"""Shared prompts (data.share_prompts) on the shared assets' preference files (BENCHMARKS.md, docs/dpo.md): how much of a
pair's tokens its prompt is, what sharing saves per pair and per microbatch, and a DPO run's step time with and without.

    python scripts/bench/bench_shared_prompts.py --assets ../shared/assets [--time] [--pairs 8] [--budget 4096]

Tokens (always): each file with each offline tokenizer (Qwen3's, Phi-3-mini's), as chattune's data layer makes the
pairs (`PairDocuments`), both ways: the tokens of every pair, the prompt's share of them (both copies: each side renders
it, less the one token each side keeps), what sharing saves (one copy) and the microbatches best-fit decreasing packs
at the budget from the pairs that fit it unshared.

`--time`: DPO's update step (`accumulate_gradients`: the policy's forward and backward and a live reference's forward,
sigmoid loss) on one CPU process (both cores) with a random-init model of SmolLM2-135M's shape (30 layers, hidden 576,
9 heads, 3 KV heads, MLP 1536, tied; Qwen3's tokenizer: no SmolLM2 tokenizer is offline), fp32: the same `--pairs`
pairs of each file (the first that fit `--budget` unshared), packed at `--budget` tokens a microbatch both ways, and
the seconds each way takes.

`--groups N`: GRPO's groups instead of pairs: each of the first N prompts of each file (as the pairs render them) with 8
completions, the replies (chosen and rejected) of the 4 pairs from its own on (real reply lengths; a loss does not ask
how its tokens were drawn), as the GRPO recipe packs them (`chattune.rl.completion_documents.group_documents`) both ways: the
tokens, the prompt's share and, with `--time`, the dapo loss's update step on the same model.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # scripts/bench/ is two below it
sys.path.insert(0, str(PROJECT_ROOT))

FILES = {
    "preference_ultrafeedback_200.jsonl": "preference",
    "preference_sharegpt_multiturn_300.json": "sharegpt_preference",
}
TOKENIZERS = ("qwen3", "phi-3-mini")
SMOLLM2_135M = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}


def token_figures(assets: Path, budget: int) -> list[dict]:
    from transformers import AutoTokenizer

    from chattune.data.documents import Document
    from chattune.data.ingest.formats import SourceSpec
    from chattune.data.ingest.records import RecordSource
    from chattune.data.packing import best_fit_decreasing
    from chattune.data.templates.pair_documents import PairDocuments

    rows = []
    for name in TOKENIZERS:
        tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / name)
        for file, format in FILES.items():
            spec = SourceSpec(str(assets / "data" / file), format=format)
            made = {}
            for shared in (False, True):
                documents = PairDocuments(RecordSource([spec]), tokenizer, 1 << 20, share_prompts=shared)
                made[shared] = [d for d in documents.get_many(range(len(documents))) if isinstance(d, Document)]
            fitting = [i for i, d in enumerate(made[False]) if len(d) <= budget]  # the pairs both layouts can train
            unshared, shared = (sum(len(made[s][i]) for i in range(len(made[s]))) for s in (False, True))
            rows.append(
                {
                    "tokenizer": name,
                    "file": file,
                    "pairs": len(made[False]),
                    "unshared_tokens": unshared,
                    "shared_tokens": shared,
                    "saved": (unshared - shared) / unshared,
                    "microbatches_unshared": len(best_fit_decreasing([made[False][i] for i in fitting], budget)),
                    "microbatches_shared": len(best_fit_decreasing([made[True][i] for i in fitting], budget)),
                    "pairs_within_budget": len(fitting),
                }
            )
    return rows


GROUP = 8  # completions per prompt


def groups_of(tokenizer, file: Path, format: str, count: int | None) -> list[tuple[list[int], list[list[int]]]]:
    """(prompt ids, 8 completions' ids) of the first `count` prompts of `file` (None: every one with 3 pairs after
    it): the prompt as its pair renders it, the completions the replies of that pair and the next 3."""
    from chattune.data.documents import Document
    from chattune.data.ingest.formats import SourceSpec
    from chattune.data.ingest.records import RecordSource
    from chattune.data.templates.pair_documents import PairDocuments

    documents = PairDocuments(
        RecordSource([SourceSpec(str(file), format=format)]), tokenizer, 1 << 20, share_prompts=True
    )
    pairs = [d for d in documents.get_many(range(len(documents))) if isinstance(d, Document)]
    parts = []
    for pair in pairs:
        prompt, first = pair.shared_prefix + 1, pair.segment_lengths[0]
        ids = pair.input_ids.tolist()
        parts.append((ids[:prompt], [ids[prompt:first], ids[first + 1 :]]))
    made = []
    for index in range(len(parts) - GROUP // 2 + 1 if count is None else count):
        completions = [reply for _, replies in parts[index : index + GROUP // 2] for reply in replies]
        made.append((parts[index][0], completions))
    return made


def group_layouts(groups: list, budget: int | None) -> dict[bool, list]:
    """Each group's completions as the GRPO recipe packs them, unshared and shared (`budget`: a row's tokens)."""
    from chattune.rl.completion_documents import completion_document, group_documents
    from chattune.rl.sampling import Sampled

    made: dict[bool, list] = {False: [], True: []}
    for number, (prompt, completions) in enumerate(groups):
        samples = [
            (number * GROUP + k, Sampled(ids, [0.0] * len(ids), [0.0] * len(ids), True, ""), 0.5 - k % 2)
            for k, ids in enumerate(completions)
        ]
        made[False] += [completion_document(doc_id, prompt, sample, a) for doc_id, sample, a in samples]
        made[True] += group_documents(prompt, samples, budget)
    return made


def group_token_figures(assets: Path, budget: int) -> list[dict]:
    from transformers import AutoTokenizer

    from chattune.data.packing import best_fit_decreasing

    rows = []
    for name in TOKENIZERS:
        tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / name)
        for file, format in FILES.items():
            groups = groups_of(tokenizer, assets / "data" / file, format, None)
            made = group_layouts(groups, budget)
            unshared, shared = (sum(len(d) for d in made[s]) for s in (False, True))
            prompts = sum(len(prompt) - 1 for prompt, _ in groups) * GROUP  # each copy less the token each keeps
            rows.append(
                {
                    "tokenizer": name,
                    "file": file,
                    "groups": len(groups),
                    "unshared_tokens": unshared,
                    "shared_tokens": shared,
                    "prompt_share": prompts / unshared,
                    "saved": (unshared - shared) / unshared,
                    "microbatches_unshared": len(best_fit_decreasing(made[False], budget)),
                    "microbatches_shared": len(best_fit_decreasing(made[True], budget)),
                }
            )
    return rows


def model_directory(assets: Path, directory: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = directory / "smollm2-135m-shape"
    if (out / "config.json").is_file():
        return out
    tokenizer = AutoTokenizer.from_pretrained(assets / "tokenizers" / "qwen3")
    config = AutoConfig.for_model(**SMOLLM2_135M, vocab_size=len(tokenizer))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def timed_step(model_dir: Path, file: Path, format: str, pairs: int, budget: int) -> dict:
    """The same `pairs` pairs of `file` (the first that fit `budget` unshared), packed both ways (best-fit decreasing at
    `budget`), through DPO's step on one CPU process: the policy's forward and backward and a live reference's forward
    per microbatch (`accumulate_gradients`), timed after a warm-up microbatch; each way's seconds and tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chattune.data.documents import Document
    from chattune.data.ingest.formats import SourceSpec
    from chattune.data.ingest.records import RecordSource
    from chattune.data.templates.pair_documents import PairDocuments
    from chattune.distributed import ParallelDims
    from chattune.model.causal_lm import PackedCausalLM
    from chattune.model.packed.attention import ATTENTION_NAME
    from chattune.objectives.dpo import LiveReference, PreferenceObjective
    from chattune.objectives.pair_losses import PreferenceLoss
    from chattune.parallel.fsdp import shard_model

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    spec = SourceSpec(str(file), format=format)
    made = {}
    for shared in (False, True):
        documents = PairDocuments(RecordSource([spec]), tokenizer, 1 << 20, share_prompts=shared)
        made[shared] = documents.get_many(range(len(documents)))
    chosen = [i for i, d in enumerate(made[False]) if isinstance(d, Document) and len(d) <= budget][:pairs]
    dims = ParallelDims.build(torch.device("cpu"))

    def loaded() -> PackedCausalLM:
        hf_model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=ATTENTION_NAME)
        hf_model.config.use_cache = False
        return PackedCausalLM(hf_model, loss_chunk_size=2048)

    policy, reference = loaded(), loaded()
    placement = shard_model(policy, dims)
    shard_model(reference, dims)
    reference.eval().requires_grad_(False)
    objective = PreferenceObjective(PreferenceLoss(loss_type="sigmoid", beta=0.1), LiveReference(reference))
    out = time_both(policy, objective, placement, {s: [made[s][i] for i in chosen] for s in (False, True)}, budget)
    return {"file": file.name, "pairs": len(chosen), **out}


def timed_group_step(model_dir: Path, file: Path, format: str, count: int, budget: int) -> dict:
    """The first `count` groups of `file` packed both ways at `budget`, through the dapo loss's update step (the
    policy's forward and backward, on-policy: no old log-probs, no reference) on one CPU process, timed after a
    warm-up microbatch; each way's seconds and tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chattune.distributed import ParallelDims
    from chattune.model.causal_lm import PackedCausalLM
    from chattune.model.packed.attention import ATTENTION_NAME
    from chattune.objectives.policy_gradient import PolicyGradientObjective, PolicyLoss
    from chattune.parallel.fsdp import shard_model

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    made = group_layouts(groups_of(tokenizer, file, format, count), budget)
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=ATTENTION_NAME)
    hf_model.config.use_cache = False
    policy = PackedCausalLM(hf_model, loss_chunk_size=2048)
    placement = shard_model(policy, ParallelDims.build(torch.device("cpu")))
    objective = PolicyGradientObjective(PolicyLoss("dapo"))
    return {"file": file.name, "pairs": count * GROUP, **time_both(policy, objective, placement, made, budget)}


REPEATS = 1  # (--repeats: each way's step timed this many times, alternating, its fastest kept)


def time_both(policy, objective, placement, made: dict[bool, list], budget: int) -> dict[str, dict]:
    """The update step on `made`'s documents of each layout (False: unshared, True: shared), packed best-fit at
    `budget`: after a warm-up microbatch of each, REPEATS timings alternating between the two, the fastest of each."""
    from chattune.data.feed import StepBatches
    from chattune.data.packing import best_fit_decreasing, collate_packed
    from chattune.train.step import accumulate_gradients

    rows = {shared: [collate_packed(b) for b in best_fit_decreasing(made[shared], budget)] for shared in made}

    def step(microbatches: list) -> float:
        started = time.perf_counter()
        accumulate_gradients(policy, objective, StepBatches(microbatches), placement)
        seconds = time.perf_counter() - started
        policy.zero_grad(set_to_none=True)
        return seconds

    for microbatches in rows.values():
        step(microbatches[:1])  # warm-up
    seconds: dict[bool, list[float]] = {shared: [] for shared in rows}
    for _ in range(REPEATS):
        for shared, microbatches in rows.items():
            seconds[shared].append(step(microbatches))
    return {
        ("shared" if shared else "unshared"): {
            "seconds": min(seconds[shared]),
            "tokens": sum(b.num_tokens for b in microbatches),
            "microbatches": len(microbatches),
        }
        for shared, microbatches in rows.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--assets", type=Path, default=PROJECT_ROOT.parent / "shared" / "assets")
    parser.add_argument("--budget", type=int, default=4096, help="data.max_tokens_per_microbatch")
    parser.add_argument("--time", action="store_true", help="also time DPO's step (minutes on 2 CPU cores)")
    parser.add_argument("--pairs", type=int, default=8, help="pairs of each file timed (the same both ways)")
    parser.add_argument("--keep", type=Path, default=None, help="keep the model here (default: a temporary folder)")
    parser.add_argument("--groups", type=int, default=0, help="GRPO groups of 8 of each file timed (0: pairs)")
    parser.add_argument("--repeats", type=int, default=1, help="time each way this often, alternating; the fastest")
    args = parser.parse_args()
    global REPEATS
    REPEATS = args.repeats
    if args.groups:
        print(
            f"| tokenizer | file | groups of {GROUP} | tokens unshared | tokens shared | the prompt (every copy) | "
            f"saved by sharing | microbatches of {args.budget} unshared | shared |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for row in group_token_figures(args.assets, args.budget):
            print(
                f"| {row['tokenizer']} | {row['file']} | {row['groups']} | {row['unshared_tokens']:,} | "
                f"{row['shared_tokens']:,} | {row['prompt_share']:.1%} | {row['saved']:.1%} | "
                f"{row['microbatches_unshared']} | {row['microbatches_shared']} |",
                flush=True,
            )
    else:
        print(
            "| tokenizer | file | pairs | tokens unshared | tokens shared | the prompt (both copies) | saved by sharing "
            f"| pairs within {args.budget} tokens | microbatches unshared | shared |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for row in token_figures(args.assets, args.budget):
            print(
                f"| {row['tokenizer']} | {row['file']} | {row['pairs']} | {row['unshared_tokens']:,} | "
                f"{row['shared_tokens']:,} | {2 * row['saved']:.1%} | {row['saved']:.1%} | "
                f"{row['pairs_within_budget']} | {row['microbatches_unshared']} | {row['microbatches_shared']} |",
                flush=True,
            )
    if not args.time:
        return
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29581", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory() as temporary:
        directory = args.keep or Path(temporary)
        directory.mkdir(parents=True, exist_ok=True)
        model = model_directory(args.assets, directory)
        print(
            f"\n| file | pairs | microbatches of {args.budget} unshared / shared | tokens unshared / shared | "
            "seconds unshared / shared | shared's speed-up |"
        )
        print("|---|---|---|---|---|---|")
        for file, format in FILES.items():
            if args.groups:  # (the "pairs" column: the groups' completions)
                run = timed_group_step(model, args.assets / "data" / file, format, args.groups, args.budget)
            else:
                run = timed_step(model, args.assets / "data" / file, format, args.pairs, args.budget)
            plain, shared = run["unshared"], run["shared"]
            print(
                f"| {file} | {run['pairs']} | {plain['microbatches']} / {shared['microbatches']} | "
                f"{plain['tokens']:,} / {shared['tokens']:,} | {plain['seconds']:.1f} / {shared['seconds']:.1f} | "
                f"{plain['seconds'] / shared['seconds']:.2f}x |",
                flush=True,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
