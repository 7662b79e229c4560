"""The in-process numeric checks (a one-rank group): packed against Hugging Face, cut-cross-entropy, float8,
tensor parallelism, the in-backward optimizer, TF32's scope, compile against eager, host syncs."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from chattune.data.documents import IGNORE_INDEX
from chattune.data.packing import collate_packed

from .context import (
    Context,
    _model_and_placement,
    built_from,
    chat_documents,
    hf_model,
    recipe_config,
    recipe_model,
    relative,
    tokenizer,
)

# --- in-process checks (a one-rank group) ---


def check_packed_vs_hf(ctx: Context) -> None:
    from torch.distributed.tensor import DTensor

    documents = chat_documents(ctx, 12)
    built = recipe_model(ctx, ctx.shape)  # eager layers
    model, ours = built.hf_model, built.model
    reference = hf_model(ctx, ctx.shape)  # the same seed: the same weights, checked here
    reference.set_attn_implementation("sdpa")
    reference = reference.to(ctx.device)
    differing = [
        name
        for name, parameter in model.named_parameters()
        if not torch.equal(
            parameter.full_tensor() if isinstance(parameter, DTensor) else parameter, reference.get_parameter(name)
        )
    ]
    if differing:
        ctx.add("packed_vs_hf", False, f"the reference's weights differ from the recipe-built model's: {differing[:3]}")
        return
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    reference = reference.to(dtype)
    batch = collate_packed(documents).to(ctx.device)
    losses = ours(batch)
    losses.sum().backward()
    layer = len(model.model.layers) // 2
    grad = model.model.layers[layer].self_attn.q_proj.weight.grad.full_tensor().float()
    head = reference.lm_head.weight

    def head_losses(hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # our head's computation, fp32
        return F.cross_entropy(hidden.float() @ head.float().t(), labels, ignore_index=IGNORE_INDEX, reduction="none")

    want = []
    for document in documents:
        ids = torch.as_tensor(document.input_ids, device=ctx.device).unsqueeze(0)
        hidden = reference.model(input_ids=ids, use_cache=False).last_hidden_state[0]
        want.append(head_losses(hidden, torch.as_tensor(document.labels, device=ctx.device)))
    want = torch.cat(want)
    want.sum().backward()
    want_grad = reference.model.layers[layer].self_attn.q_proj.weight.grad.float()
    with torch.no_grad():  # the control: one causal attention over the whole row, documents see each other
        # (an explicit all-ones mask: with none, transformers finds the documents from the position ids)
        hidden = reference.model(
            input_ids=batch.input_ids,
            position_ids=batch.position_ids,
            use_cache=False,
            attention_mask=torch.ones_like(batch.input_ids),
        ).last_hidden_state[0]
        leaked = head_losses(hidden, batch.labels[0])
    bounds = (0.05, 1e-3, 3e-2) if ctx.cuda else (1e-4, 1e-6, 1e-5)
    token = float((losses.detach() - want.detach()).abs().max())
    total = abs(float(losses.sum()) - float(want.sum())) / abs(float(want.sum()))
    grad_error = relative(grad, want_grad)
    ok = token <= bounds[0] and total <= bounds[1] and grad_error <= bounds[2]
    ctx.add(
        "packed_vs_hf",
        ok,
        f"token max|diff| {token:.3g}, sum rel {total:.2g}, q_proj grad rel {grad_error:.2g}",
        f"≤ {bounds[0]:g} / {bounds[1]:g} / {bounds[2]:g}",
        f"{batch.num_tokens} tokens, {len(documents)} chats",
    )
    control = float((leaked - want.detach()).abs().max())
    ctx.add(
        "leak_control",
        control > 10 * bounds[0],
        f"token max|diff| {control:.3g} with documents leaking",
        f"> {10 * bounds[0]:g}: ten times the check's bound",
    )


def check_cce(ctx: Context) -> None:
    from chattune.model.head import fused_loss
    from chattune.model.head.chunked_loss import chunked_token_losses

    if not fused_loss.cce_available():
        ctx.add("cce_vs_chunked", None, "cut-cross-entropy cannot be imported", detail=str(fused_loss._import_cce()[1]))
        return
    tokens, width, vocab = (8192, 1024, len(tokenizer(ctx))) if ctx.cuda else (200, 32, 500)
    generator = torch.Generator(device=ctx.device).manual_seed(0)
    hidden = torch.randn(tokens, width, generator=generator, device=ctx.device).bfloat16()
    # Peaked logits (std ~4), like a trained model's, not the near-uniform softmax of random weights.
    weight = (torch.randn(vocab, width, generator=generator, device=ctx.device) * 4 / width**0.5).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device=ctx.device)
    labels[::7] = IGNORE_INDEX
    upstream = torch.linspace(0.5, 1.5, tokens, device=ctx.device)

    def run(loss_fn):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        losses = loss_fn(h, w)
        (losses * upstream).sum().backward()
        return losses.detach(), h.grad.float(), w.grad.float()

    want = run(lambda h, w: chunked_token_losses(h, w, labels, chunk_size=1024))
    got = run(lambda h, w: fused_loss.cce_token_losses(h, w, labels))
    token = float((got[0] - want[0]).abs().max() / want[0].abs().max())
    total = abs(float(got[0].sum() - want[0].sum())) / abs(float(want[0].sum()))
    hidden_grad, head_grad = relative(got[1], want[1]), relative(got[2], want[2])
    # CUDA: the kernels accumulate the logits in fp32 and never round them; the CPU's torch implementation
    # rounds them to bf16 (tests/unit/model/head/test_fused_loss.py's bounds).
    bounds = (1e-3, 1e-4, 3e-2) if ctx.cuda else (5e-3, 2.5e-4, 1e-2)
    ok = token <= bounds[0] and total <= bounds[1] and max(hidden_grad, head_grad) <= bounds[2]
    options = fused_loss.cce_options(ctx.cuda)
    ctx.add(
        "cce_vs_chunked",
        ok,
        f"token {token:.2g} of max, sum rel {total:.2g}, hidden grad rel {hidden_grad:.2g}, "
        f"head grad rel {head_grad:.2g}",
        f"≤ {bounds[0]:g} / {bounds[1]:g} / {bounds[2]:g} / {bounds[2]:g}",
        f"{tokens}x{width}, vocab {vocab}, options {options}",
    )


def check_float8(ctx: Context) -> None:
    """model.fp8 (tensorwise on CUDA, emulate on the CPU): one float8 linear layer's forward and backward on rows
    of 1001, 1008 and 1 tokens (CUDA's _scaled_mm wants every inner dimension a multiple of 16; the weight
    gradient's is the row's token count), then 3 optimizer steps of the recipe's model in float8 against the same
    steps without it: every step's loss within 1%."""

    from chattune.model.quantization.float8 import convert_linear_layers, fp8_problem

    mode = "tensorwise" if ctx.cuda else "emulate"
    problem = fp8_problem(mode, ctx.device, adapted=False)
    if problem is None and importlib.util.find_spec("torchao") is None:
        problem = "torchao is not installed (the lowbit extra; gpu_carry.py carries it)"
    if problem is not None:
        ctx.add("float8", None, problem)
        return
    width = 1024 if ctx.cuda else 64
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    for tokens in (1001, 1008, 1):  # raises where a matmul's shape is refused
        torch.manual_seed(0)
        layer = torch.nn.Sequential(torch.nn.Linear(width, width, bias=False)).to(ctx.device, dtype)
        convert_linear_layers([layer], mode)
        inputs = torch.randn(tokens, width, device=ctx.device, dtype=dtype, requires_grad=True)
        layer(inputs).float().pow(2).sum().backward()
        if not (torch.isfinite(inputs.grad).all() and torch.isfinite(layer[0].weight.grad).all()):
            ctx.add("float8", False, f"non-finite gradients of a float8 layer at {tokens} tokens")
            return
    documents = chat_documents(ctx, 24, start=200)
    batches = [collate_packed(documents[start : start + 8]) for start in (0, 8, 16)]
    layers = 4 if ctx.cuda else None
    losses = {}
    for name, overrides in (("plain", ()), ("float8", (f"model.fp8={mode}",))):
        model = recipe_model(ctx, ctx.shape, layers, overrides=overrides).model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        losses[name] = []
        for batch in batches:
            trained = int((batch.labels != IGNORE_INDEX).sum())
            loss = model(batch.to(ctx.device)).sum() / trained
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[name].append(float(loss))
        del model, optimizer
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses["float8"], losses["plain"]))
    plain = "bf16" if ctx.cuda else "fp32"
    ctx.add(
        "float8",
        worst <= 0.01,
        f"rows of 1001, 1008 and 1 tokens ran; 3 steps' losses within {worst:.2g} of {plain}'s",
        "≤ 0.01",
        f"model.fp8={mode}; losses {[round(x, 4) for x in losses['float8']]} vs {[round(x, 4) for x in losses['plain']]}",
    )


def check_cce_anchor(ctx: Context) -> None:
    """Cut-cross-entropy under loss-parallel (a vocabulary split over tp): a token whose target is another rank's
    is computed at an anchor row of this rank's whose logit is added back. The kernels sum the output layer's
    gradient in bf16, so one anchor row taking (T-1)/T of the tokens kept their cancelling terms' rounding (a CPU
    simulation: 860x a row's error). Per-row error of the weight gradient of this rank's half of the vocabulary
    against the exact fp32 chunked head: row 0's within 5x the median row's. CUDA only (CCE's kernels)."""
    import torch.distributed as dist

    from chattune.model.head import fused_loss
    from chattune.model.head.chunked_loss import chunked_token_losses
    from chattune.parallel.vocab_parallel import VocabShard

    if not ctx.cuda:
        ctx.add(
            "cce_anchor",
            None,
            "CUDA only: the kernels' bf16 sums (tests/unit/model/head/test_fused_loss.py checks a stand-in)",
        )
        return
    if not fused_loss.cce_available():
        ctx.add("cce_anchor", None, "cut-cross-entropy cannot be imported", detail=str(fused_loss._import_cce()[1]))
        return
    tokens, width, vocab = 8192, 1024, len(tokenizer(ctx))
    half = vocab // 2
    generator = torch.Generator(device=ctx.device).manual_seed(3)
    hidden = torch.randn(tokens, width, generator=generator, device=ctx.device).bfloat16()
    weight = (torch.randn(half, width, generator=generator, device=ctx.device) * 4 / width**0.5).bfloat16()
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device=ctx.device)  # half of them elsewhere
    rows = VocabShard(0, half, dist.group.WORLD)  # this rank's half (the one-rank group: its sums are its own)

    def weight_gradient(loss_fn, dtype: torch.dtype) -> torch.Tensor:
        h, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
        loss_fn(h, w).sum().backward()
        return w.grad.float()

    exact = weight_gradient(lambda h, w: chunked_token_losses(h, w, labels, chunk_size=1024, rows=rows), torch.float32)
    fused = weight_gradient(lambda h, w: fused_loss.cce_token_losses(h, w, labels, rows=rows), torch.bfloat16)
    errors = (fused - exact).norm(dim=1)
    median = float(errors.median())
    ratio = float(errors[0]) / median if median > 0 else float("inf")
    ctx.add(
        "cce_anchor",
        ratio <= 5,
        f"row 0's error {ratio:.2g}x the median row's (largest {float(errors.max()) / median:.2g}x)",
        "≤ 5",
        f"{tokens}x{width}, {half} of {vocab} rows, options {fused_loss.cce_options(True)}",
    )


# Tensor parallelism on one GPU: the split model at degree 1 runs the same arithmetic as the unsplit one, so its
# bounds are the rounding of a different order of operations (the vocabulary's logsumexp and target logit reduced
# over the group, DTensor's redistributions): fp32 on the CPU, the recipe's bf16 on CUDA.
TENSOR_PARALLEL_BOUNDS = {"cpu": (1e-5, 1e-4), "cuda": (2e-3, 2e-2)}  # (loss, update) relative


def check_tensor_parallel(ctx: Context) -> None:
    """Tensor parallelism and loss-parallel (the decoder layers and the vocabulary split over a tp mesh,
    chattune.parallel.tensor_parallel and vocab_parallel) composed with FSDP2, on a tp mesh of one rank
    (`ParallelDims.build(keep={"tp"})`: NCCL refuses two ranks on one GPU): for the chunked head and
    cut-cross-entropy, one step of SGD (lr 1: the update is the gradient) against the unsplit model on the same
    batch, its loss and update within TENSOR_PARALLEL_BOUNDS; on CUDA the split step's device syncs no more than
    the unsplit one's, and none in a padded row slice (context_parallel.row_slice of a row whose length the
    ranks do not divide: its padding made on the device, not copied from pageable memory)."""
    from chattune.data.feed import StepBatches
    from chattune.distributed import ParallelDims
    from chattune.model.head import fused_loss
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.parallel.context_parallel import row_slice
    from chattune.train.step import UpdateRule, train_step

    split_dims = ParallelDims.build(ctx.device, None, keep=frozenset({"tp"}))
    documents = chat_documents(ctx, 8, start=500)
    layers = 4 if ctx.cuda else None
    loss_bound, update_bound = TENSOR_PARALLEL_BOUNDS[ctx.device.type]
    for loss in ("chunked", "cut_cross_entropy"):
        if loss == "cut_cross_entropy" and not fused_loss.cce_available():
            ctx.add(f"tensor_parallel_{loss}", None, "cut-cross-entropy cannot be imported")
            continue
        losses, updates, syncs = {}, {}, {}
        for name, dims in (("unsplit", ctx.dims), ("split", split_dims)):
            cfg = recipe_config(ctx, ctx.shape, layers, loss=loss, overrides=("model.compile=false",))
            model, placement = _model_and_placement(built_from(ctx, cfg, dims=dims))
            if name == "split":
                meshes = {p.device_mesh.mesh_dim_names for p in model.parameters()}
                if model.stream is None or ("dp_shard_cp", "tp") not in meshes:
                    raise AssertionError(f"the kept tp mesh did not split the model (parameters on {meshes})")
            before = {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
            batches = StepBatches([collate_packed(documents)])
            result, _ = train_step(
                model, TokenCrossEntropy(), batches, UpdateRule(optimizer, scheduler, None), placement
            )
            losses[name] = torch.tensor(result.loss_sum / result.global_units)
            updates[name] = torch.cat(
                [(p.full_tensor().float().cpu() - before[n]).flatten() for n, p in model.named_parameters()]
            )
            syncs[name] = _count_syncs(
                ctx,
                lambda m=model, b=batches, o=optimizer, s=scheduler, p=placement: train_step(
                    m, TokenCrossEntropy(), b, UpdateRule(o, s, None), p
                ),
            )
            del model, optimizer
        loss_error, update_error = (
            relative(losses["split"], losses["unsplit"]),
            relative(updates["split"], updates["unsplit"]),
        )
        synced = syncs["split"] is None or syncs["split"] <= syncs["unsplit"]
        counts = "" if syncs["unsplit"] is None else f"; device syncs {syncs['split']} vs {syncs['unsplit']}"
        ctx.add(
            f"tensor_parallel_{loss}",
            loss_error <= loss_bound and update_error <= update_bound and synced,
            f"loss rel {loss_error:.2g}, update rel {update_error:.2g} against the unsplit model{counts}",
            f"≤ {loss_bound:g} / {update_bound:g}; syncs no more than unsplit",
            "tp mesh of 1 rank with FSDP2, one SGD step",
        )
    odd = collate_packed(documents[:3])
    odd = replace(  # a row whose length 2 ranks do not divide: row_slice pads it
        odd, **{f: getattr(odd, f).to(ctx.device) for f in ("input_ids", "labels", "position_ids", "cu_seqlens")}
    )
    if odd.num_tokens % 2 == 0:
        odd = replace(
            odd,
            input_ids=odd.input_ids[:, :-1],
            labels=odd.labels[:, :-1],
            position_ids=odd.position_ids[:, :-1],
            cu_seqlens=torch.cat([odd.cu_seqlens[:-1], odd.cu_seqlens[-1:] - 1]),
        )
    sliced = _count_syncs(ctx, lambda: row_slice(odd, 2, 1))
    ctx.add(
        "tensor_parallel_padded_slice",
        None if sliced is None else sliced == 0,
        "CUDA only (its slice ran)" if sliced is None else f"{sliced} device syncs in the padded row slice",
        "" if sliced is None else "0",
        f"a row of {odd.num_tokens} tokens over 2 ranks",
    )


def check_in_backward(ctx: Context) -> None:
    """optimizer.in_backward: one step of the recipe's model with each parameter updated as FSDP2 reduces its
    gradient (in FSDP2's post-reduce stream on CUDA) against the ordinary step on the same batch: every parameter
    within 1e-6 relative (the same AdamW arithmetic, element for element); on CUDA also the step's device syncs
    (torch.cuda.set_sync_debug_mode): the ordinary step's count, not one per parameter."""
    from chattune.data.feed import StepBatches
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.in_backward import UpdateInBackward
    from chattune.train.step import UpdateRule, train_step

    documents = chat_documents(ctx, 8, start=300)
    layers = 4 if ctx.cuda else None
    after, syncs = {}, {}
    for name in ("ordinary", "in_backward"):
        model, placement = _model_and_placement(recipe_model(ctx, ctx.shape, layers))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=ctx.cuda)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        updater = UpdateInBackward(model, optimizer, placement) if name == "in_backward" else None
        rule = UpdateRule(optimizer, scheduler, None, in_backward=updater)
        batches = StepBatches([collate_packed(documents)])
        train_step(model, TokenCrossEntropy(), batches, rule, placement)  # warm (the optimizer's states exist)
        counted = _count_syncs(
            ctx, lambda m=model, b=batches, r=rule, p=placement: train_step(m, TokenCrossEntropy(), b, r, p)
        )
        syncs[name] = counted
        after[name] = {n: p.full_tensor().float().cpu() for n, p in model.named_parameters()}
        del model, optimizer
    worst = max(relative(after["in_backward"][n], after["ordinary"][n]) for n in after["ordinary"])
    synced = syncs["in_backward"] is None or syncs["in_backward"] <= syncs["ordinary"]
    counts = "" if syncs["ordinary"] is None else f"; device syncs {syncs['in_backward']} vs {syncs['ordinary']}"
    ctx.add(
        "in_backward",
        worst <= 1e-6 and synced,
        f"parameters after 2 steps within {worst:.2g} of the ordinary step's{counts}",
        "≤ 1e-6; syncs no more than the ordinary step's",
    )


def _count_syncs(ctx: Context, step: Callable[[], object]) -> int | None:
    """The device syncs `step` makes (CUDA's sync debug mode warns at each); None on the CPU."""
    if not ctx.cuda:
        step()
        return None
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def check_tf32_scope(ctx: Context) -> None:
    from chattune.model.head.chunked_loss import chunked_token_losses

    tokens, width, vocab = (4096, 1024, 32768) if ctx.cuda else (256, 64, 1024)
    generator = torch.Generator(device=ctx.device).manual_seed(1)
    hidden = torch.randn(tokens, width, generator=generator, device=ctx.device).bfloat16()
    weight = (
        (torch.randn(vocab, width, generator=generator, device=ctx.device) / width**0.5).bfloat16().requires_grad_()
    )
    labels = torch.randint(0, vocab, (tokens,), generator=generator, device=ctx.device)
    before = torch.get_float32_matmul_precision()
    fast = chunked_token_losses(hidden, weight, labels, 1024, tf32=True)
    fast.sum().backward()
    exact = chunked_token_losses(hidden, weight, labels, 1024, tf32=False).detach()
    error = relative(fast.detach(), exact)
    after = torch.get_float32_matmul_precision()
    ctx.add(
        "tf32_scope",
        error <= 1e-5 and before == after == "highest",
        f"forward rel {error:.2g} against fp32; precision {before} -> {after}",
        "≤ 1e-5; highest",
    )


def check_compile(ctx: Context) -> None:
    from chattune.parallel.fsdp import compiled_graphs

    torch._dynamo.reset()
    documents = chat_documents(ctx, 80, start=100)
    rows, start = [], 0
    for size in [3, 5, 2, 7, 4, 6, 3, 5, 8, 2, 4, 6, 5, 3, 7, 4, 2, 6, 5, 3]:  # 20 packed lengths
        rows.append(collate_packed(documents[start % 60 : start % 60 + size]))
        start += size
    layers = 4 if ctx.cuda else None

    def losses_and_grads(model, batches):
        out = []
        for batch in batches:
            losses = model(batch.to(ctx.device))
            losses.sum().backward()
            out.append((losses.detach(), {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}))
            model.zero_grad(set_to_none=True)
        return out

    eager = losses_and_grads(recipe_model(ctx, ctx.shape, layers).model, rows[:3])
    compiled_model = recipe_model(ctx, ctx.shape, layers, compile=True).model
    graphs, compiled = [compiled_graphs()], []
    for index, batch in enumerate(rows):
        result = losses_and_grads(compiled_model, [batch])
        if index < 3:
            compiled += result
        graphs.append(compiled_graphs())
    bounds = (1e-2, 5e-2) if ctx.cuda else (1e-5, 1e-4)
    loss_error = max(relative(c[0], e[0]) for c, e in zip(compiled, eager))
    grad_error = max(relative(c[1][n], e[1][n]) for c, e in zip(compiled, eager) for n in e[1])
    ctx.add(
        "compile_vs_eager",
        loss_error <= bounds[0] and grad_error <= bounds[1],
        f"losses rel {loss_error:.2g}, gradients rel {grad_error:.2g}",
        f"≤ {bounds[0]:g} / {bounds[1]:g}",
    )
    later = graphs[-1] - graphs[3]
    ctx.add("recompiles", later == 0, f"graphs after each of 20 steps: {graphs[1:]}", "none after the third")


def check_host_syncs(ctx: Context) -> None:
    """The set-up and two warm steps run on every device (so the CPU smoke test covers them); the count of
    syncs needs CUDA's sync debug mode."""
    from omegaconf import OmegaConf

    from chattune.data.feed import StepBatches
    from chattune.objectives.cross_entropy import TokenCrossEntropy
    from chattune.train.optimizer import build_optimizer
    from chattune.train.step import UpdateRule, train_step

    model, placement = _model_and_placement(recipe_model(ctx, ctx.shape, layers=4, loss="auto"))  # not compiled
    loss = model.loss_implementation
    optimizer = build_optimizer(
        OmegaConf.create({"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-5}),
        [p for p in model.parameters() if p.requires_grad],
        ctx.device,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    documents = chat_documents(ctx, 16, start=400)
    microbatches = [collate_packed(documents[:8]), collate_packed(documents[8:])]
    for _ in range(2):  # warm: the first steps allocate, autotune and initialise the optimizer's state
        train_step(
            model, TokenCrossEntropy(), StepBatches(microbatches), UpdateRule(optimizer, scheduler, 1.0), placement
        )
    if not ctx.cuda:
        ctx.add("host_syncs", None, "CUDA only (its set-up and two warm steps ran)")
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(
                model, TokenCrossEntropy(), StepBatches(microbatches), UpdateRule(optimizer, scheduler, 1.0), placement
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
    allowed = 1 + (len(microbatches) if loss == "cut_cross_entropy" else 0)
    ctx.add(
        "host_syncs",
        len(syncs) <= allowed,
        f"{len(syncs)} in a step of 2 microbatches ({loss})",
        f"≤ {allowed}",
        "; ".join(sorted(set(syncs)))[:300],
    )
