"""Issue 71 on the GPU: the attention of a row whose pairs share their prompts (data.share_prompts), three ways, each
checked against the per-segment loop (the CPU path, exact there) and timed forward and backward beside the same
pairs unshared on the varlen kernel:

- varlen: one varlen kernel call with separate key offsets, each segment's prompt keys gathered before its own
  (`chattune.model.packed.kernels._varlen` with `SharedKeys`; what training takes where `probe_shared_varlen`
  agrees);
- flex: FlexAttention (compiled) with a block mask built from the row's segments, prompt spans and positions, the
  mask's construction timed apart (a microbatch would build one);
- loop: per-segment SDPA with each prompt's keys (`_per_document_sdpa`), what shared rows take otherwise.

On the CPU (the smoke test) the varlen kernel and FlexAttention's backward do not run: the row is built, FlexAttention's
forward is checked against the loop, and the row is a SKIP."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from chattune.data.documents import IGNORE_INDEX, Document
from chattune.data.packing import PackedBatch, collate_packed
from chattune.model.packed import kernels
from chattune.model.packed.kernels import VarlenOptions

from .context import Context, relative

# A DPO pair shaped as the multi-turn preference data's (the prompt 56% of an unshared pair's tokens, BENCHMARKS.md):
# a prompt of 320 tokens and replies of 256, 14 pairs (16,128 tokens unshared), Qwen3-0.6B's attention.
PROMPT, REPLY, PAIRS = 320, 256, 14
HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
TOLERANCE = 2e-2  # bf16 against the loop: as `kernels.SHARED_VARLEN_TOLERANCE`


def pair_rows(prompt: int, reply: int, pairs: int) -> tuple[PackedBatch, PackedBatch]:
    """(shared, unshared) rows of the same pairs: [prompt + chosen][rejected continuing the prompt less its last
    token] against [prompt + chosen][prompt + rejected] (`chattune.data.packing`)."""
    rng = np.random.default_rng(0)
    shared, unshared = [], []
    for index in range(pairs):
        ids = rng.integers(16, 1000, prompt + 2 * reply)
        first, second = ids[: prompt + reply], np.concatenate([ids[:prompt], ids[prompt + reply :]])
        both = np.concatenate([first, second])
        unshared.append(Document(index, both, np.full(len(both), IGNORE_INDEX), segments=(len(first), len(second))))
        kept = np.concatenate([first, second[prompt - 1 :]])
        shared.append(
            Document(
                index,
                kept,
                np.full(len(kept), IGNORE_INDEX),
                segments=(len(first), reply + 1),
                shared_prefix=prompt - 1,
            )
        )
    return collate_packed(shared), collate_packed(unshared)


def flex_block_mask(batch: PackedBatch, device: torch.device):
    """FlexAttention's block mask of a shared row: query q sees key k where k is in q's segment or q's prompt span, and
    k stands at or before q (positions: a continuing segment's start after its prompt's end)."""
    from torch.nn.attention.flex_attention import create_block_mask

    segment = batch.segment_ids.to(device)
    positions = batch.position_ids[0].to(device)
    spans = batch.prefixes.to(device)[segment]  # each token's segment's (prompt start, prompt length)
    span_start, span_end = spans[:, 0], spans[:, 0] + spans[:, 1]

    def visible(b, h, q, k):
        in_prompt = (k >= span_start[q]) & (k < span_end[q])
        return ((segment[q] == segment[k]) | in_prompt) & (positions[q] >= positions[k])

    tokens = batch.num_tokens
    return create_block_mask(visible, None, None, tokens, tokens, device=str(device))


def _timed(step, repeats: int, cuda: bool) -> float:
    """The median seconds of `step` (forward and backward) over `repeats` runs after one warm-up run."""
    step()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def check_shared_prompt_attention(ctx: Context) -> None:
    from torch.nn.attention.flex_attention import flex_attention

    cuda = ctx.cuda
    prompt, reply, pairs = (PROMPT, REPLY, PAIRS) if cuda else (24, 12, 3)
    heads, kv_heads, head_dim = (HEADS, KV_HEADS, HEAD_DIM) if cuda else (4, 2, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    shared, unshared = pair_rows(prompt, reply, pairs)
    generator = torch.Generator(device=ctx.device).manual_seed(0)

    def inputs(tokens: int) -> list[torch.Tensor]:
        return [
            torch.randn(1, h, tokens, head_dim, generator=generator, device=ctx.device, dtype=dtype)
            for h in (heads, kv_heads, kv_heads)
        ]

    rows = inputs(shared.num_tokens)
    upstream = torch.randn(1, shared.num_tokens, heads, head_dim, generator=generator, device=ctx.device)
    cu_seqlens = shared.cu_seqlens.to(ctx.device)
    options = VarlenOptions(shared.max_seqlen, scale=head_dim**-0.5)
    keys = shared.to(ctx.device).shared_keys
    mask_started = time.perf_counter()
    block_mask = flex_block_mask(shared, ctx.device)
    if cuda:
        torch.cuda.synchronize()
    mask_seconds = time.perf_counter() - mask_started

    def loop(q, k, v):
        return kernels._per_document_sdpa(q, k, v, shared.cu_seqlens, options, shared.prefixes)

    def varlen(q, k, v):
        return kernels._varlen(q, k, v, cu_seqlens, options, keys)

    compiled_flex = torch.compile(flex_attention, dynamic=False) if cuda else flex_attention

    def flex(q, k, v):
        out = compiled_flex(q, k, v, block_mask=block_mask, scale=options.scale, enable_gqa=heads != kv_heads)
        return out.transpose(1, 2)  # (1, N, H, D), as the kernels return

    def outputs_and_grads(attend, backward: bool = True) -> list[torch.Tensor]:
        q, k, v = (t.clone().requires_grad_(backward) for t in rows)
        out = attend(q, k, v)
        if not backward:
            return [out.detach().float()]
        (out.float() * upstream).sum().backward()
        return [out.detach().float(), *(t.grad.float() for t in (q, k, v))]

    want = outputs_and_grads(loop, backward=cuda)
    flex_error = max(relative(a, b) for a, b in zip(outputs_and_grads(flex, backward=cuda), want, strict=True))
    if not cuda:
        ctx.add(
            "shared_prompt_attention",
            None,
            "CUDA only (the varlen kernel; FlexAttention has no backward on the CPU)",
            detail=f"on the CPU FlexAttention's forward against the loop: rel {flex_error:.2g}",
        )
        return
    varlen_error = max(relative(a, b) for a, b in zip(outputs_and_grads(varlen), want, strict=True))

    def step(attend, tensors, upstream_of_row):
        def run():
            q, k, v = (t.detach().requires_grad_() for t in tensors)
            (attend(q, k, v).float() * upstream_of_row).sum().backward()

        return run

    repeats = 10
    plain_rows = inputs(unshared.num_tokens)
    plain_upstream = torch.randn(1, unshared.num_tokens, heads, head_dim, device=ctx.device)
    plain_cu = unshared.cu_seqlens.to(ctx.device)
    plain_options = VarlenOptions(unshared.max_seqlen, scale=options.scale)
    seconds = {
        "unshared varlen": _timed(
            step(lambda q, k, v: kernels._varlen(q, k, v, plain_cu, plain_options), plain_rows, plain_upstream),
            repeats,
            cuda,
        ),
        "varlen": _timed(step(varlen, rows, upstream), repeats, cuda),
        "flex": _timed(step(flex, rows, upstream), repeats, cuda),
        "loop": _timed(step(loop, rows, upstream), repeats, cuda),
    }
    fastest = min(("varlen", "flex"), key=seconds.__getitem__)
    ms = {name: f"{value * 1e3:.2f} ms" for name, value in seconds.items()}
    ctx.add(
        "shared_prompt_attention",
        varlen_error <= TOLERANCE and flex_error <= TOLERANCE,
        f"fwd+bwd of {pairs} pairs (prompt {prompt}, replies {reply}): unshared varlen {ms['unshared varlen']} "
        f"({unshared.num_tokens} tokens); shared ({shared.num_tokens} tokens): varlen {ms['varlen']}, flex "
        f"{ms['flex']} (+ block mask {mask_seconds * 1e3:.1f} ms), loop {ms['loop']}; fastest shared: {fastest}",
        f"rel to the loop ≤ {TOLERANCE:g}: varlen {varlen_error:.2g}, flex {flex_error:.2g}",
        f"heads {heads}/{kv_heads}, head dim {head_dim}, bf16; varlen kernel: "
        f"{'flash-attn' if kernels._FLASH_ATTN_VARLEN is not None else 'torch varlen_attn'}",
    )
