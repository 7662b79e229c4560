"""The memory checks: low-bit optimizer states, activation offload, CPU offload, run-state snapshots, the
start-up memory estimate as a bound."""

from __future__ import annotations

import gc
import importlib.util
import math
import os
import signal
import time
from contextlib import nullcontext
from unittest.mock import patch

import torch

from chattune.data.documents import Document
from chattune.data.packing import PackedBatch, collate_packed

from .context import Context, _model_and_placement, built_from, chat_documents, recipe_config, relative, tokenizer

# torchao's low-bit AdamW on FSDP2's shards (issue 68, item 6): the documented per-step tolerance against fp32
# AdamW (docs/memory.md, "Low-bit optimizer states": 0.02 nats for 8-bit, 0.4 for 4-bit; FP8 states have no
# documented figure yet: held to 8-bit's, provisionally). Measured on the CPU over 50 steps of the tiny model.
LOW_BIT_STEP_TOLERANCE = {"AdamW8bit": 0.02, "AdamW4bit": 0.4, "AdamWFp8": 0.02}


def check_low_bit(ctx: Context) -> None:
    """torchao.optim.AdamW8bit, AdamW4bit and AdamWFp8 as the recipe builds them (chattune.train.optimizer:
    each class's inductor cache of its own), 20 steps of the recipe's model (4 layers of the 0.6B shape, bf16
    compute) against fp32 AdamW on the same rows, every step's loss within LOW_BIT_STEP_TOLERANCE; the 8-bit run
    saves its model and optimizer asynchronously after step 10 (chattune.checkpoint.checkpoint: DCP through the
    pinned stager) and a second model resumed from that save gives steps 11-20 bit for bit. On the CPU 8 steps
    of the tiny shape, the save after step 4, torchao's step eager (dynamo off: it compiles per shard shape,
    tens of seconds on the CPU)."""
    from chattune.checkpoint.checkpoint import BackgroundSaves, load_sharded, save_checkpoint
    from chattune.checkpoint.run_state import model_and_optimizer
    from chattune.data.feed import StepBatches
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.optimizer import build_optimizer
    from chattune.train.step import UpdateRule, train_step

    if importlib.util.find_spec("torchao") is None:
        ctx.add("low_bit", None, "torchao is not importable")
        return
    steps, layers = (20, 4) if ctx.cuda else (8, None)
    saved_after = steps // 2
    documents = chat_documents(ctx, 4 * steps, start=500)
    rows = [collate_packed(documents[4 * i : 4 * i + 4]) for i in range(steps)]
    eager = nullcontext() if ctx.cuda else patch.dict(os.environ, TORCHDYNAMO_DISABLE="1")  # read at each torch.compile

    def build(optimizer: str):
        cfg = recipe_config(ctx, ctx.shape, layers, overrides=(f"optimizer._target_={optimizer}", "optimizer.lr=1e-3"))
        model, placement = _model_and_placement(built_from(ctx, cfg))
        made = build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad], ctx.device)
        rule = UpdateRule(made, torch.optim.lr_scheduler.LambdaLR(made, lambda step: 1.0), None)
        return model, made, rule, placement

    def train(model, placement, rule, first: int, last: int) -> dict[int, float]:
        losses = {}
        for step in range(first, last + 1):
            result, _ = train_step(model, TokenCrossEntropy(), StepBatches([rows[step - 1]]), rule, placement)
            losses[step] = result.loss_sum / result.global_units
        return losses

    with eager:
        model, _, rule, placement = build("torch.optim.AdamW")
        reference = train(model, placement, rule, 1, steps)
        del model, rule
        for name, tolerance in LOW_BIT_STEP_TOLERANCE.items():
            model, optimizer, rule, placement = build(f"torchao.optim.{name}")
            saves = BackgroundSaves(ctx.device) if name == "AdamW8bit" else None
            losses = train(model, placement, rule, 1, saved_after)
            if saves is not None:
                checkpoint = save_checkpoint(
                    ctx.work / "low_bit",
                    saved_after,
                    model_and_optimizer(model, optimizer),
                    {"world_size": 1},
                    background=saves,
                )
            losses |= train(model, placement, rule, saved_after + 1, steps)  # the save in flight while these step
            worst = max(abs(losses[s] - reference[s]) for s in reference)
            ctx.add(
                f"low_bit_{name}",
                worst <= tolerance,
                f"worst step {worst:.4f} nats from fp32 AdamW over {steps} steps; last {losses[steps]:.4f} vs "
                f"{reference[steps]:.4f}",
                f"≤ {tolerance:g} a step",
            )
            del model, optimizer, rule
            if saves is None:
                continue
            saves.close()  # written and committed
            straight = losses
            model, optimizer, rule, placement = build(f"torchao.optim.{name}")
            load_sharded(checkpoint, model_and_optimizer(model, optimizer))
            resumed = train(model, placement, rule, saved_after + 1, steps)
            differing = [s for s in resumed if resumed[s] != straight[s]]
            ctx.add(
                "low_bit_resume",
                not differing,
                f"steps {saved_after + 1}-{steps} after an async save and a resume: "
                + (f"differ at {differing}" if differing else "bit for bit"),
                "bitwise equal",
            )
            del model, optimizer, rule


OFFLOAD_TOKENS = 16384  # the row of the offload check on CUDA (a long row: what offloading is for)
OFFLOAD_REPEATS = 3  # a race between the copies and the compute shows as a gradient that differs in some repeat


def check_offload_races(ctx: Context) -> None:
    """`model.fsdp.offload_activations=true` (chattune.parallel.offload: the saved tensors copied to pinned host
    memory on a side stream and back in the backward) in bf16 on one 16k-token row, eager and compiled, with and
    without activation checkpointing (rows `offload_{eager,compiled}_{ac,noac}`): OFFLOAD_REPEATS backwards each
    give the plain run's gradients as exactly as the plain run repeats itself (bit for bit where it does: a copy
    that raced the compute changes some repeat); the peak lower than the plain run's; the bytes moved at most the
    saved tensors' unique storages (each moved once however often it is saved; counted eager, by a hook of this
    check's around the plain forward). On the CPU the tiny shape, eager (the hooks copy on the host)."""
    from chattune.data.feed import StepBatches
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.parallel.offload import MIN_OFFLOAD_BYTES, MIN_SLAB_BYTES, _is_weight
    from chattune.train.step import accumulate_gradients

    documents, tokens = [], 0
    for document in chat_documents(ctx, 400 if ctx.cuda else 8, start=1100):
        if ctx.cuda and tokens + len(document.input_ids) > OFFLOAD_TOKENS:
            break
        documents.append(document)
        tokens += len(document.input_ids)
    row = StepBatches([collate_packed(documents)])
    layers = 4 if ctx.cuda else None

    def gradients(model, placement, hooks=None) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with hooks or nullcontext():
            accumulate_gradients(model, TokenCrossEntropy(), row, placement)
        return {n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.grad is not None}

    unique: dict[int, int] = {}

    def count(tensor: torch.Tensor) -> torch.Tensor:  # what the offload could move: its storages, once
        if tensor.device == ctx.device and tensor.numel() * tensor.element_size() >= MIN_OFFLOAD_BYTES:
            if not _is_weight(tensor):
                unique[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    for compiled in (False, True) if ctx.cuda else (False,):
        for checkpointing in (False, True):
            name = f"offload_{'compiled' if compiled else 'eager'}_{'ac' if checkpointing else 'noac'}"
            runs, peaks, moved, host, ahead = {}, {}, 0, 0, 0
            for offload in (False, True):
                settings = (
                    f"model.fsdp.activation_checkpointing={str(checkpointing).lower()}",
                    f"model.fsdp.offload_activations={str(offload).lower()}",
                )
                model, placement = _model_and_placement(
                    built_from(ctx, recipe_config(ctx, ctx.shape, layers, compile=compiled, overrides=settings))
                )
                gradients(model, placement)  # (warm: compiles, allocates)
                if ctx.cuda:
                    torch.cuda.reset_peak_memory_stats()
                counting = not offload and not compiled
                if counting:
                    unique.clear()
                hooks = torch.autograd.graph.saved_tensors_hooks(count, lambda t: t) if counting else None
                runs[offload] = [
                    gradients(model, placement, hooks if i == 0 else None)
                    for i in range(OFFLOAD_REPEATS if offload else 2)
                ]
                peaks[offload] = torch.cuda.max_memory_allocated() / 2**30 if ctx.cuda else None
                if offload:
                    offload_hooks = placement.activation_offload
                    assert offload_hooks is not None
                    moved, host, ahead = (
                        offload_hooks.offloaded_bytes,
                        offload_hooks.host_bytes,
                        offload_hooks.brought_ahead,
                    )
                del model
            plain = runs[False][0]
            noise = max(relative(runs[False][1][n], plain[n]) for n in plain)
            errors_ = [max(relative(grads[n], plain[n]) for n in plain) for grads in runs[True]]
            exact = all(e <= 4 * noise for e in errors_)
            lower = peaks[True] < peaks[False] if ctx.cuda else True
            storages = sum(unique.values()) if not compiled else None
            once = storages is None or moved <= storages
            # one slab of what a forward moved (each copy's start aligned; a first slab's least size), not a
            # power-of-two pinned block each
            slab_fits = host <= 1.05 * moved + MIN_SLAB_BYTES
            peak_text = f"; peak {peaks[True]:.2f} vs {peaks[False]:.2f} GiB" if ctx.cuda else ""
            share = f"; moved {moved / 2**20:,.1f} MiB" + (
                f" of {storages / 2**20:,.1f} MiB saved storages" if storages else ""
            )
            share += f"; host slab {host / 2**20:,.1f} MiB; {ahead} copies back started ahead of their use"
            ctx.add(
                name,
                exact and lower and once and slab_fits,
                f"{len(errors_)} backwards {', '.join(f'{e:.2g}' for e in errors_)} from plain "
                f"(plain against itself {noise:.2g}){peak_text}{share}",
                "≤ 4x plain's own spread (0: bitwise); peak lower; moved ≤ unique storages; slab ≤ 1.05x moved + 64 MiB",
                f"{tokens:,} tokens",
            )


CPU_OFFLOAD_TOLERANCE = 1e-5  # the same bf16 compute; only AdamW's kernel differs (the host's against CUDA's fused)


def check_cpu_offload(ctx: Context) -> None:
    """`model.fsdp.cpu_offload=true` as the recipe builds it (bf16 compute, layers compiled, activation
    checkpointing: what the memory advice tells an 8B run on one GPU to do) against the same model without it:
    two steps on the same rows, every parameter within CPU_OFFLOAD_TOLERANCE relative of the plain run's (the
    shards, their gradients and AdamW's step on the host, copied in for each all-gather); the second step's time
    of each, the offloaded one's slowdown as its figure. On the CPU the tiny shape, layers eager (compiling is the
    `compile_vs_eager` item's), fp32."""
    from chattune.data.feed import StepBatches
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.optimizer import build_optimizer
    from chattune.train.step import UpdateRule, train_step

    documents = chat_documents(ctx, 8, start=700)
    rows = [collate_packed(documents[:4]), collate_packed(documents[4:])]
    layers = 4 if ctx.cuda else None
    after, seconds = {}, {}
    for name, offload in (("plain", False), ("cpu_offload", True)):
        settings = (f"model.fsdp.cpu_offload={str(offload).lower()}", "model.fsdp.activation_checkpointing=true")
        cfg = recipe_config(ctx, ctx.shape, layers, compile=ctx.cuda, overrides=(*settings, "optimizer.lr=1e-3"))
        model, placement = _model_and_placement(built_from(ctx, cfg))
        optimizer = build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad], ctx.device)
        rule = UpdateRule(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), None)
        for row in rows:
            synchronize(ctx)
            started = time.perf_counter()
            train_step(model, TokenCrossEntropy(), StepBatches([row]), rule, placement)
            synchronize(ctx)
            seconds[name] = time.perf_counter() - started  # the last: the first compiles and makes the states
        after[name] = {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}
        del model, optimizer, rule
    worst = max(relative(after["cpu_offload"][n], after["plain"][n]) for n in after["plain"])
    ctx.add(
        "cpu_offload",
        worst <= CPU_OFFLOAD_TOLERANCE,
        f"parameters after 2 steps within {worst:.2g} of the plain run's; step 2 {seconds['cpu_offload']:.3f} s "
        f"offloaded vs {seconds['plain']:.3f} s ({seconds['cpu_offload'] / seconds['plain']:.1f}x)",
        f"≤ {CPU_OFFLOAD_TOLERANCE:g}",
    )


SNAPSHOT_OVERLAP = 0.5  # at most this share of the staged copy's own time (bytes / bandwidth) added to a step
SNAPSHOT_LAYERS = 8  # of the 0.6B on CUDA: 3.3 GB of state a step (the 8-minute call; 28 layers: 7.2 GB)


def check_snapshots(ctx: Context) -> None:
    """`snapshot_steps=true`'s per-step copy of the run state to the host (chattune.checkpoint.snapshot: pinned
    buffers, a side stream, the next optimizer step waits for it). `snapshot_overhead`: steps with a snapshot
    staged after each against the same steps without, the added time per step beside the copy's own time (the
    state's bytes over the device-to-host bandwidth measured here): at most what the copy takes beyond the plain
    step plus SNAPSHOT_OVERLAP of it, since the copy overlaps the next step's forward and backward (CUDA only: on
    the host the copy is the step's). On CUDA SNAPSHOT_LAYERS of the 0.6B and 16,384-token rows. Then a
    stop signal (SIGTERM, to a handler of this check's) has the watcher write the staged step while the state has
    moved on: `snapshot_exact`: a fresh model loaded from it holds that step's weights and AdamW states bit for bit;
    `snapshot_resume`: its next step's loss equals the uninterrupted run's, bit for bit."""
    from chattune.checkpoint.checkpoint import load_checkpoint
    from chattune.checkpoint.run_state import model_and_optimizer
    from chattune.checkpoint.snapshot import Snapshots
    from chattune.data.feed import StepBatches
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.optimizer import build_optimizer
    from chattune.train.step import UpdateRule, train_step

    warm, timed = (3, 6) if ctx.cuda else (2, 3)
    if ctx.cuda:  # a training row (16,384 tokens), not a few chats: the copy overlaps what a real step computes
        rows = [_row_of(ctx, 16384)] * (warm + timed + 1)
    else:
        documents = chat_documents(ctx, 4 * (warm + timed + 1), start=900)
        rows = [collate_packed(documents[4 * i : 4 * i + 4]) for i in range(len(documents) // 4)]
    layers = SNAPSHOT_LAYERS if ctx.cuda else None

    def build(seed: int):
        cfg = recipe_config(ctx, ctx.shape, layers, seed=seed, compile=ctx.cuda, overrides=("optimizer.lr=1e-3",))
        model, placement = _model_and_placement(built_from(ctx, cfg))
        optimizer = build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad], ctx.device)
        return (
            model,
            optimizer,
            UpdateRule(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), None),
            placement,
        )

    def step(model, placement, rule, row) -> float:
        result, _ = train_step(model, TokenCrossEntropy(), StepBatches([row]), rule, placement)
        return float(result.loss_sum / result.global_units)

    def local_state(model, optimizer) -> dict[str, torch.Tensor]:
        """Every local shard of the weights and AdamW's states, cloned on the device."""
        found = {f"model.{n}": p.to_local().detach().clone() for n, p in model.named_parameters()}
        for index, parameter in enumerate(model.parameters()):
            for key, value in optimizer.state[parameter].items():
                if torch.is_tensor(value) and value.dim():
                    found[f"optimizer.{index}.{key}"] = getattr(value, "to_local", lambda v=value: v)().clone()
        return found

    model, optimizer, rule, placement = build(0)
    state = model_and_optimizer(model, optimizer)
    snapshots = Snapshots(ctx.work / "snapshots" / "checkpoints", state, {"world_size": 1}, {}, ctx.device, optimizer)
    for row in rows[:warm]:
        step(model, placement, rule, row)
    state_bytes = sum(t.numel() * t.element_size() for t in local_state(model, optimizer).values())
    bandwidth = _host_bandwidth(ctx, min(max(state_bytes, 2**26), 2**30))
    seconds = {}
    for phase, staged in (("plain", False), ("snapshots", True)):
        synchronize(ctx)
        started = time.perf_counter()
        for number in range(warm, warm + timed):  # the same rows: their lengths decide a step's time
            step(model, placement, rule, rows[number])
            if staged:
                snapshots.stage(timed + number + 1)
        synchronize(ctx)
        seconds[phase] = (time.perf_counter() - started) / timed
    added, copy_alone = seconds["snapshots"] - seconds["plain"], state_bytes / bandwidth
    # A copy that overlaps the next step perfectly still adds what it takes beyond that step's compute
    unhidden = max(copy_alone - seconds["plain"], 0.0)
    ctx.add(
        "snapshot_overhead",
        added <= unhidden + SNAPSHOT_OVERLAP * copy_alone if ctx.cuda else None,
        f"{added * 1e3:+.1f} ms a step ({seconds['plain'] * 1e3:.1f} ms plain); the copy alone "
        f"{copy_alone * 1e3:.1f} ms ({state_bytes / 2**20:,.1f} MiB at {bandwidth / 2**30:.1f} GiB/s)",
        f"≤ the copy beyond the step ({unhidden * 1e3:.1f} ms) + {SNAPSHOT_OVERLAP:g} of the copy alone",
        "" if ctx.cuda else "CUDA only: on the host the copy is part of the step",
    )
    last = warm + 2 * timed  # the staged step
    expected = local_state(model, optimizer)
    straight = step(model, placement, rule, rows[-1])  # the state moves on; the staged copy must not
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # (the watcher wakes on the signal's byte)
    try:
        snapshots.watch()
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 120
        while snapshots.written_step != last and time.monotonic() < deadline:
            time.sleep(0.05)
        written = snapshots.written_step == last
        snapshots.settle()
    finally:
        snapshots.close()
        signal.signal(signal.SIGTERM, previous)
    del model, optimizer, rule, state
    model, optimizer, rule, placement = build(1)  # other weights, replaced by the load
    step(model, placement, rule, rows[0])  # (AdamW's states exist, to be replaced)
    load_checkpoint(ctx.work / "snapshots" / "checkpoints" / f"step_{last}", model_and_optimizer(model, optimizer))
    loaded = local_state(model, optimizer)
    differing = [key for key in expected if not torch.equal(loaded.get(key, torch.empty(0)), expected[key])]
    ctx.add(
        "snapshot_exact",
        written and not differing and loaded.keys() == expected.keys(),
        f"step {last}'s snapshot written on SIGTERM after step {last + 1} ran: "
        + (
            "not written"
            if not written
            else f"{len(differing)} of {len(expected)} tensors differ"
            if differing
            else f"{len(expected)} tensors bit for bit"
        ),
        "bitwise equal",
    )
    resumed = step(model, placement, rule, rows[-1])
    ctx.add(
        "snapshot_resume",
        resumed == straight,
        f"step {last + 1}'s loss after the resume {resumed!r} vs {straight!r}",
        "bitwise equal",
    )
    del model, optimizer, rule


def _host_bandwidth(ctx: Context, size: int) -> float:
    """Bytes a second of the fastest of three copies of `size` bytes from the device into pinned host memory (on the CPU: a memcpy)."""
    source = torch.empty(size, dtype=torch.uint8, device=ctx.device)
    target = torch.empty(size, dtype=torch.uint8, pin_memory=ctx.cuda)
    fastest = math.inf
    for _ in range(3):  # (the first warms)
        synchronize(ctx)
        started = time.perf_counter()
        target.copy_(source, non_blocking=ctx.cuda)
        synchronize(ctx)
        fastest = min(fastest, time.perf_counter() - started)
    return size / fastest


def synchronize(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize()


# The memory estimate held as a bound (issue 68, item 9): every combination of the loss head, activation
# checkpointing and activation offload; the 0.6B shape at 16k tokens on CUDA. The bound is the documented one
# (docs/memory.md): the estimate within 10% of the peak torch allocated.
ESTIMATE_BOUND_ROWS = [
    (loss, checkpointing, offload)
    for loss in ("cut_cross_entropy", "chunked")
    for checkpointing in (True, False)
    for offload in (False, True)
]
ESTIMATE_BOUND = 0.10
# 8 of the 0.6B's 28 layers on CUDA: each layer's activations, the head's rows and the states are what a whole
# model holds (layer by layer the same arithmetic), at two fifths of the build time (the 8-minute call, item 9)
ESTIMATE_BOUND_LAYERS = 8


def _row_of(ctx: Context, tokens: int) -> PackedBatch:
    """One packed row of exactly `tokens` tokens of real chats (the last one cut where the row ends)."""
    documents, total, start = [], 0, 0
    while total < tokens:
        for document in chat_documents(ctx, 200, start=start):
            take = min(len(document.input_ids), tokens - total)
            documents.append(Document(document.doc_id, document.input_ids[:take], document.labels[:take]))
            total += take
            if total == tokens:
                break
        start += 200
    return collate_packed(documents)


def check_estimate_bound(ctx: Context) -> None:
    """The start-up memory estimate (chattune.model.cost.memory, from the recipe's own config) against the peak torch
    allocated in two optimizer steps of the model built from that config, one row per combination of
    ESTIMATE_BOUND_ROWS (layers compiled, as `model.compile=auto` compiles them on CUDA): within 10% of the peak;
    the first row also says what the device holds that torch does not count (total - free - reserved: the CUDA
    context, NCCL's and cuBLAS's buffers). On the CPU the estimates are made and the steps run on the tiny shape
    (chunked rows: the CPU's CCE is its torch implementation), no peak to hold them to: SKIP."""
    from chattune.data.feed import StepBatches
    from chattune.model.cost.memory import estimate, hf_config_of, inputs_of
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.optimizer import build_optimizer
    from chattune.train.step import UpdateRule, train_step

    tokens = 16384 if ctx.cuda else 256
    row = _row_of(ctx, tokens)
    rows = ESTIMATE_BOUND_ROWS if ctx.cuda else [r for r in ESTIMATE_BOUND_ROWS if r[0] == "chunked"]
    figures = []
    for loss, checkpointing, offload in rows:
        name = f"estimate_bound_{'cce' if loss == 'cut_cross_entropy' else loss}_{'ac' if checkpointing else 'noac'}"
        name += "_offload" if offload else ""
        keys = (
            f"data.max_tokens_per_microbatch={tokens}",
            f"model.fsdp.activation_checkpointing={str(checkpointing).lower()}",
            f"model.fsdp.offload_activations={str(offload).lower()}",
        )
        cfg = recipe_config(
            ctx, ctx.shape, ESTIMATE_BOUND_LAYERS if ctx.cuda else None, compile=ctx.cuda, loss=loss, overrides=keys
        )
        inputs = inputs_of(cfg, hf_config_of(cfg, len(tokenizer(ctx))), ctx.dims, on_cuda=ctx.cuda)
        estimated = estimate(inputs).total
        gc.collect()
        if ctx.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(ctx.device)
        before = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
        model, placement = _model_and_placement(built_from(ctx, cfg))
        optimizer = build_optimizer(cfg.optimizer, [p for p in model.parameters() if p.requires_grad], ctx.device)
        rule = UpdateRule(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0), None)
        for _ in range(2):  # the second step holds the optimizer's states the first made
            train_step(model, TokenCrossEntropy(), StepBatches([row]), rule, placement)
        if ctx.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(ctx.device) - before
            free, total = torch.cuda.mem_get_info(ctx.device)
            uncounted = total - free - torch.cuda.memory_reserved(ctx.device)
        del model, optimizer, rule
        if not ctx.cuda:
            figures.append(f"{name} {estimated / 2**30:.3f} GiB")
            continue
        error = (estimated - peak) / peak if estimated is not None else math.inf
        extra = f"; not counted by torch {uncounted / 2**30:.2f} GiB" if not figures else ""
        figures.append(name)
        ctx.add(
            name,
            abs(error) <= ESTIMATE_BOUND,
            f"estimated {estimated / 2**30 if estimated else float('nan'):.2f} GiB, peak {peak / 2**30:.2f} GiB "
            f"({error:+.1%}){extra}",
            f"within ±{ESTIMATE_BOUND:.0%}",
        )
    if not ctx.cuda:
        ctx.add("estimate_bound", None, "no device peak on the CPU; estimated " + ", ".join(figures))
