"""eval.samples: at every evaluation the model being trained answers a few prompts greedily. The replies, on 1
and 2 ranks (FSDP2, gloo, real processes), are plain transformers generate of the same weights (the starting
model at step 0, the export at the last step); sampling leaves training as it was; a resumed run keeps one
line per prompt and step; the prompts are the held-out records' context or a prompts file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_sft_recipe import read_metrics
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from chattune.config.paths import DEMO_ASSETS
from chattune.data.ingest.formats import SourceSpec
from chattune.data.templates.prompts import Prompt, held_out_prompts
from chattune.distributed import ParallelDims, exit_process, init_distributed, shutdown_distributed
from chattune.hf_layout import decoder_layers
from chattune.model.causal_lm import PackedCausalLM
from chattune.model.generate import Sampling, generate_reply, prompt_ids, sharded_generation, stop_token_ids
from chattune.model.packed.attention import ATTENTION_NAME
from chattune.parallel.fsdp import Placement, compiled_graphs, shard_model
from chattune.train.samples import EvalSamples, run_samples
from conftest import demo_chat_prompts, free_port, init_worker_process_group, launch, mesh_dims, spawn, torchrun

STEPS = [
    "max_steps=4",
    "eval_every=2",
    "save_every=2",
    "log_every=1",
    "optimizer.lr=5e-3",  # the replies these steps learn; 3e-3 learned them while step 1 trained at lr 0
    "scheduler.num_warmup_steps=0",
    "data.max_tokens_per_microbatch=512",
    "data.report_records=0",
    "eval.max_new_tokens=24",
]


def plain_replies(model_dir: Path, prompts: list[list[dict]], max_new_tokens: int = 24) -> list[str]:
    """transformers alone, unsharded: greedy replies from the chat template's generation prompt, before <|im_end|>."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    replies = []
    for messages in prompts:
        inputs = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        with torch.no_grad():
            output = model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end, pad_token_id=end
            )
        new = output[0, inputs["input_ids"].shape[1] :].tolist()
        replies.append(tokenizer.decode(new[: new.index(end)] if end in new else new, skip_special_tokens=False))
    return replies


def samples_by_step(output_dir: Path) -> dict[int, list[dict]]:
    lines = [json.loads(line) for line in (output_dir / "samples.jsonl").read_text().splitlines()]
    steps: dict[int, list[dict]] = {}
    for line in lines:
        steps.setdefault(line["step"], []).append(line)
    return steps


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """The chats the chat model learned (held out: its replies are known)."""
    path = tmp_path_factory.mktemp("samples") / "chats.jsonl"
    path.write_text("".join((DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines(keepends=True)[:6]))
    return path


@pytest.fixture(scope="module")
def others(tmp_path_factory) -> Path:
    """Chats it did not learn, to train on: four steps change its replies (the samples of step 4 are not step 0's)."""
    path = tmp_path_factory.mktemp("samples") / "others.jsonl"
    path.write_text("".join((DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines(keepends=True)[6:60]))
    return path


@pytest.mark.launch
def test_samples_on_one_rank_are_plain_generate_leave_training_as_it_was_and_resume_once(
    chat_model_dir, chats, others, tmp_path
):
    prompts = tmp_path / "prompts.jsonl"  # eval.sample_prompts: 4 prompts, of which eval.samples takes 3
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in demo_chat_prompts(4)))
    out, without = tmp_path / "run", tmp_path / "without"
    command = [
        sys.executable,
        "recipes/sft.py",
        f"model.path={chat_model_dir}",
        f"tokenizer.path={chat_model_dir}",
        f"data.train=[{others}]",
        "data.eval=[]",
        *STEPS,
        f"eval.sample_prompts={prompts}",
        "eval.samples=3",
    ]
    launch([*command, f"output_dir={out}"])
    steps = samples_by_step(out)
    assert sorted(steps) == [0, 2, 4] and all(len(lines) == 3 for lines in steps.values())  # no held-out set needed
    assert all(line["prompt"] == m for lines in steps.values() for line, m in zip(lines, demo_chat_prompts(3)))
    assert [s["reply"] for s in steps[0]] == plain_replies(chat_model_dir, demo_chat_prompts(3))
    assert [s["reply"] for s in steps[4]] == plain_replies(out / "hf", demo_chat_prompts(3))
    assert [s["reply"] for s in steps[4]] != [s["reply"] for s in steps[0]]  # the trained model, not the start
    assert (
        sum(
            s["reply"] == c[-1]["content"]
            for s, c in zip(steps[0], [json.loads(line)["messages"] for line in chats.read_text().splitlines()])
        )
        >= 2
    )  # replies worth reading: the model answers these chats

    # Sampling draws nothing and changes nothing: the same run without it trains the same steps, bit for bit.
    launch([*command, f"output_dir={without}", "eval.samples=0"])
    assert not (without / "samples.jsonl").exists()
    assert [m["loss"] for m in read_metrics(without)] == [m["loss"] for m in read_metrics(out)]
    assert [m["grad_norm"] for m in read_metrics(without)] == [m["grad_norm"] for m in read_metrics(out)]

    # Continued from step 2: the lines of step 4 are set aside, then written again, once.
    first = (out / "samples.jsonl").read_text()
    launch([*command, f"output_dir={out}", f"resume={out}/checkpoints/step_2"])
    assert (out / "samples.jsonl.abandoned").read_text() == first
    again = samples_by_step(out)
    assert sorted(again) == [0, 2, 4] and all(len(lines) == 3 for lines in again.values())
    assert again == steps  # the resumed run is the uninterrupted one


@pytest.mark.launch
def test_samples_on_two_ranks_are_plain_generate_of_the_held_out_prompts(chat_model_dir, chats, others, tmp_path):
    """3 held-out prompts on 2 ranks (rank 0 answers two, rank 1 one), at steps 0, 2 and 4 of a run."""
    out = tmp_path / "run"
    run = launch(
        torchrun(
            "recipes/sft.py",
            f"output_dir={out}",
            f"model.path={chat_model_dir}",
            f"tokenizer.path={chat_model_dir}",
            f"data.train=[{others}]",
            f"data.eval=[{chats}]",
            *STEPS,
            "eval.samples=3",
            nproc=2,
        )
    )
    # what step 0 will cost is said before it runs (minutes on a CPU with a real model), and timed after
    assert "step 0: the held-out metrics over " in run.stdout and " and 3 sample replies of up to " in run.stdout
    assert "step 0: evaluated in " in run.stdout
    held_out = [
        m[: max(i for i, t in enumerate(m) if t["role"] == "assistant")]
        for m in (json.loads(line)["messages"] for line in chats.read_text().splitlines()[:3])
    ]
    steps = samples_by_step(out)
    assert sorted(steps) == [0, 2, 4] and [s["prompt"] for s in steps[0]] == held_out
    assert [s["reply"] for s in steps[0]] == plain_replies(chat_model_dir, held_out)
    assert [s["reply"] for s in steps[4]] == plain_replies(out / "hf", held_out)
    assert [s["reply"] for s in steps[4]] != [s["reply"] for s in steps[0]]
    assert all("eval_loss" in m for m in read_metrics(out, include_start=True) if m["step"] in (0, 2, 4))


def _answer_worker(rank: int, world_size: int, port: int, model_dir: str, out_path: str) -> None:
    init_worker_process_group(rank, world_size, port)
    dims = init_distributed("cpu")
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=ATTENTION_NAME)
    model = PackedCausalLM(hf_model, loss_chunk_size=16)
    placement = shard_model(model, dims)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [Prompt(m) for m in demo_chat_prompts(3)]
    samples = EvalSamples(prompts, tokenizer, 24, dims, Path(f"{out_path}.jsonl"))
    found = {}
    for gather in (True, False):
        replies = samples.answer(model, placement, gather)
        sharded = all(isinstance(p, DTensor) for p in model.parameters())  # every unit resharded after
        found[gather] = (replies, sharded, model.training)
    torch.save(found, f"{out_path}.rank{rank}")
    shutdown_distributed()
    exit_process()


@pytest.mark.launch
def test_sample_replies_on_two_ranks_gathered_once_or_in_step_are_plain_generate(chat_model_dir, tmp_path):
    """3 prompts on 2 ranks, both ways `sharded_generation` answers: the model gathered once and each rank on its
    own (where it fits), and every forward a collective with the ranks in step (rank 1 answers one prompt, then
    one whose reply nobody keeps). Rank 0 gets every reply, each plain transformers generate."""
    out_path = str(tmp_path / "answers")
    spawn(_answer_worker, args=(2, free_port(), str(chat_model_dir), out_path), nprocs=2)
    expected = plain_replies(chat_model_dir, demo_chat_prompts(3))
    first, second = (torch.load(f"{out_path}.rank{rank}") for rank in (0, 1))
    for gather in (True, False):
        assert first[gather] == (expected, True, True), gather
        assert second[gather] == ([], True, True), gather


def test_held_out_prompts_are_the_context_before_each_records_last_reply(tmp_path):
    chats = [json.loads(line)["messages"] for line in (DEMO_ASSETS / "chat_eval.jsonl").read_text().splitlines()[:5]]
    want = []
    for messages in chats:
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        want.append(messages[:last])
    got = held_out_prompts([SourceSpec(str(DEMO_ASSETS / "chat_eval.jsonl"))], 5)
    assert [p.messages for p in got] == want and any(len(m) > 1 for m in want)

    pairs = [json.loads(line) for line in (DEMO_ASSETS / "preference_eval.jsonl").read_text().splitlines()[:3]]
    got = held_out_prompts([SourceSpec(str(DEMO_ASSETS / "preference_eval.jsonl"), format="preference")], 3)
    expected = [
        p["prompt"] if isinstance(p["prompt"], list) else [{"role": "user", "content": p["prompt"]}] for p in pairs
    ]
    assert [p.messages for p in got] == expected

    # Across sources in order, an unreadable record passed over for the next, a count beyond them all: all.
    second = tmp_path / "second.jsonl"
    second.write_text(
        '{"messages": [{"role": "user", "content": "no reply"}]}\n'
        '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}\n'
    )
    first = tmp_path / "first.jsonl"
    first.write_text("".join((DEMO_ASSETS / "chat_eval.jsonl").read_text().splitlines(keepends=True)[:2]))
    got = held_out_prompts([SourceSpec(str(first)), SourceSpec(str(second))], 10)
    assert [p.messages for p in got] == [*want[:2], [{"role": "user", "content": "Hi"}]]


@pytest.mark.parametrize("compile", [False, True])
def test_the_sharded_model_generates_as_the_plain_one_and_compiles_nothing_for_it(
    chat_model_dir, one_rank_group, compile
):
    """One rank in this process: the packed attention and compiled layers are set aside for generation and
    restored after it (a training forward still runs the packed attention)."""
    torch._dynamo.reset()
    hf_model = AutoModelForCausalLM.from_pretrained(chat_model_dir, attn_implementation=ATTENTION_NAME)
    model = PackedCausalLM(hf_model, loss_chunk_size=16)
    placement = shard_model(model, mesh_dims(), compile=compile)
    tokenizer = AutoTokenizer.from_pretrained(chat_model_dir)
    prompts = demo_chat_prompts(3)
    graphs = compiled_graphs()
    with sharded_generation(model, placement):
        replies = [
            generate_reply(
                model,
                tokenizer,
                prompt_ids(tokenizer, m),
                Sampling(max_new_tokens=24),
                stop_token_ids(tokenizer),
                device=placement.device,
            ).text
            for m in prompts
        ]
    assert replies == plain_replies(chat_model_dir, prompts)
    assert compiled_graphs() == graphs and model.training
    assert hf_model.config._attn_implementation == ATTENTION_NAME
    assert all("forward" in layer.__dict__ for layer in decoder_layers(model)) == compile  # compiled again


def test_a_resumed_run_keeps_the_sample_lines_up_to_its_step_also_with_sampling_off(tmp_path):
    lines = [json.dumps({"step": step, "prompt": [], "reply": str(step)}) + "\n" for step in (0, 2, 4, 6)]
    (tmp_path / "samples.jsonl").write_text("".join(lines))
    cfg = OmegaConf.create({"output_dir": str(tmp_path), "eval_every": 2, "eval": {"samples": 0}})
    one_rank = ParallelDims.one_rank()
    assert run_samples(cfg, None, one_rank, resume_step=2) is None
    assert (tmp_path / "samples.jsonl").read_text() == "".join(lines[:2])
    assert run_samples(cfg, None, one_rank, resume_step=None) is None  # a fresh run without samples: nothing written
    assert (tmp_path / "samples.jsonl").read_text() == "".join(lines[:2])


def test_without_data_eval_the_samples_come_from_the_records_eval_split_holds_out(tmp_path):
    """data.eval_split alone is a held-out set: its records' prompts are sampled (the split's own rule, computed
    independently here: SplitMix64 keys of (seed, source, record), the smallest held out)."""
    from omegaconf import OmegaConf

    from chattune.train.samples import sample_prompts

    data = tmp_path / "chats.jsonl"
    lines = (DEMO_ASSETS / "chat_train.jsonl").read_text().splitlines(keepends=True)[:50]
    data.write_text("".join(lines))
    cfg = OmegaConf.create(
        {
            "eval_every": 10,
            "seed": 7,
            "eval": {"samples": 3, "sample_prompts": None},
            "data": {"eval": None, "eval_split": 0.1, "train": [str(data)]},
        }
    )

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) % 2**64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
        return z ^ (z >> 31)

    base = mix((mix(7) + 0) % 2**64)
    held = sorted(sorted(range(50), key=lambda i: mix((base + i) % 2**64))[:5])  # round(0.1 x 50) records
    want = []
    for i in held[:3]:
        messages = json.loads(lines[i])["messages"]
        last = max(j for j, m in enumerate(messages) if m["role"] == "assistant")
        want.append(messages[:last])
    from chattune.data.ingest.held_out import held_out_records

    split_records = held_out_records(50, 5, seed=7, source=0)  # what the run's split holds out (TrainingData)
    assert list(split_records) == held
    assert [p.messages for p in sample_prompts(cfg, [split_records])] == want
    assert sample_prompts(cfg, [split_records[:0]]) == []  # no held-out set, no prompts file: nothing to sample


def test_a_model_stock_transformers_cannot_generate_with_trains_with_its_sample_replies_off(tmp_path, caplog):
    """Bamba without an attention layer: transformers' own generate fails on its cache (so would every rank's at
    step 0). The run says so once and samples nothing; Gemma 2 (no SDPA path: eager for the replies) samples."""
    import logging

    from conftest import tiny_model

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    cfg = OmegaConf.create(
        {
            "output_dir": str(tmp_path),
            "eval_every": 2,
            "eval": {"samples": 1, "sample_prompts": str(prompts), "max_new_tokens": 4},
            "data": {"eval": None, "train": []},
        }
    )
    one_rank = ParallelDims.one_rank()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_ASSETS / "tokenizer")
    bamba = tiny_model(model_type="bamba", attn_layer_indices=[], mamba_d_head=16, mamba_n_heads=8)
    with caplog.at_level(logging.WARNING, logger="chattune.train.samples"):
        assert run_samples(cfg, tokenizer, one_rank, None, (), None, bamba) is None
    assert "eval.samples: BambaForCausalLM.generate fails in stock transformers in get_seq_length" in caplog.text
    assert "sample replies are off for this run" in caplog.text
    gemma2 = tiny_model(model_type="gemma2", head_dim=16)
    samples = run_samples(cfg, tokenizer, one_rank, None, (), None, gemma2)
    assert samples is not None and len(samples.answer(PackedCausalLM(gemma2), Placement.one_rank())) == 1
