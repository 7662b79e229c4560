"""Verify chattune's GPU path in one command, on one GPU: one JSON file and one markdown table, a row per
check, PASS / FAIL / SKIP with its figure.

    python scripts/gpu_check [--out DIR] [--assets DIR] [--only ITEM ...]        # one GPU (the default device)
    python scripts/gpu_check --budget 540 [--estimate-scale F]                   # within 540 s (+ 20 s margin)
    python scripts/gpu_check --device cpu                                         # the CPU smoke test (CI runs it)

Items, most valuable first (what `--budget` runs in this order): issue 68's ten (`float8`, `offload_races`,
`cce_anchor`, `tensor_parallel`, `in_backward`, `low_bit`, `cpu_offload`, `snapshots`, `estimate_bound`, then the
24-step `throughput_0.6b_sft` launch: about 430 s priced, within 8 minutes; `--plan` prints the order and the
estimates without running anything), the other in-process checks (`packed_vs_hf`, `cce_vs_chunked`, `tf32_scope`,
`compile_vs_eager`, `host_syncs`, `dpo_reference_memory`, `objectives_bf16`), `resume_and_export`, `cuda_tests`,
`trl_0.6b`, `throughput_1.7b_sft`, the 0.6B LoRA and QLoRA launches, then `trl_1.7b` and the 1.7B LoRA and QLoRA
launches (about eleven launches: well past ten minutes in all). With
`--budget SECONDS` (counted from the start) an item starts only where its estimate (`ESTIMATES`,
`LAUNCH_ESTIMATES`: rough H100 seconds; `--estimate-scale` multiplies them) fits the time left; an in-process
check still running when the budget ends is stopped (SIGALRM), a launch is stopped with everything it started
(its timeout is the time left). The script returns within the budget plus 20 s (a watchdog's last resort),
every item in the table and JSON (PASS / FAIL / SKIP, or NOT RUN: "not run (budget: needs ~N s, M s left)",
"not finished (...)"), rewritten after every item so that even a kill from outside leaves them, and prints the
second call that runs the rest (`--only` those items, `--out OUT-rest`, the same `--work`).
The in-process checks build their models as recipes/sft.py does, through chattune.model.build's
build_sharded_model (the architecture check, the loss head, `probe_native_gqa` on CUDA, FSDP2 with the
recipe's settings); the environment's `varlen_gqa` says how torch's varlen_attn took grouped-query attention
(flag: its enable_gqa; native: unequal head counts as they are, probed; repeat: kv heads repeated) and
`compute` the start-up line of those models.

Checks (the tolerances are the documented ones; a row shows the measured figure next to its bound):
- `float8`: `model.fp8=tensorwise` (emulate on the CPU): a float8 linear layer's forward and backward on rows of
  1001, 1008 and 1 tokens (CUDA's `_scaled_mm` refuses inner dimensions that are not multiples of 16; the weight
  gradient's is the row's tokens: torchao pads them), then 3 steps of the recipe's model against the same steps
  without float8 (losses within 1%). SKIP where torchao is absent or the GPU has no float8 matmuls.
- `packed_vs_hf`: a packed bf16 row (12 real chats) through chattune's sharded model (FSDP2 mixed precision,
  eager layers) against each chat alone through stock Hugging Face (sdpa) in bf16, both heads in fp32:
  per-token losses (max |diff| ≤ 0.05), their sum (relative ≤ 1e-3) and a q_proj gradient (relative ≤ 3e-2).
  `leak_control`: the same row with every document attending to the ones before it must miss the per-token
  bound tenfold, or the check proves nothing. On the CPU, fp32 and ≤ 1e-4 / 1e-6 / 1e-5.
- `cce_vs_chunked`: cut-cross-entropy against the exact fp32 chunked head on the same bf16 inputs (8192
  tokens, the tokenizer's vocabulary, peaked logits): per-token losses (≤ 1e-3 of the largest), their sum
  (≤ 1e-4) and the output layer's and hidden states' gradients (≤ 3e-2: CCE 25.1.1 sums them in bf16 and
  drops blocks below `filter_eps`, see chattune.model.head.fused_loss). On the CPU, CCE's torch implementation,
  which rounds the logits to bf16: ≤ 5e-3 / 2.5e-4 / 1e-2, as tests/unit/model/head/test_fused_loss.py.
- `cce_anchor`: cut-cross-entropy on half a vocabulary (loss-parallel's rows, the other half's targets on an
  anchor row of this half): the per-row error of its output-layer gradient against the exact fp32 chunked head,
  row 0's within 5x the median row's (the kernels sum that gradient in bf16; anchors all on row 0 collected the
  rounding of thousands of cancelling terms). CUDA only (tests/unit/model/head/test_fused_loss.py checks a stand-in on the CPU).
- `tensor_parallel` (rows `tensor_parallel_chunked`, `_cut_cross_entropy`, `_padded_slice`): the decoder layers
  and the vocabulary split over a tp mesh of one rank (loss-parallel; NCCL refuses two ranks on one GPU) with
  FSDP2, one SGD step (its update is the gradient) against the unsplit model on the same batch: loss within
  2e-3 and update within 2e-2 relative in bf16 (1e-5 / 1e-4 on the CPU in fp32), its device syncs no more than
  the unsplit step's; a padded row slice (a row two ranks do not divide) makes no device sync. Two-GPU layouts:
  docs/gpu-check.md.
- `in_backward`: `optimizer.in_backward` (each parameter updated as FSDP2 reduces its gradient) against the
  ordinary step, two steps on the same batch: every parameter within 1e-6; on CUDA its device syncs no more than
  the ordinary step's.
- `tf32_scope`: the chunked head with its matmuls in TF32 gives the fp32 forward (≤ 1e-5 relative) and leaves
  the process's matmul precision at `highest`.
- `compile_vs_eager`, `recompiles`: compiled decoder layers against eager on the same batches (losses ≤ 1e-2,
  gradients ≤ 5e-2 in bf16; 1e-5 / 1e-4 on the CPU), and the compiled graphs over 20 steps of packed rows of
  varying length (none after the third).
- `host_syncs`: device syncs in one warm `train_step` of 2 microbatches (torch.cuda.set_sync_debug_mode): at
  most the step's one transfer, plus cut-cross-entropy's `nonzero()` per microbatch. CUDA only.
- `dpo_reference_memory`: DPO with a live reference, peak memory with the forward-only reshard and without
  it (the reference's root left gathered). On the CPU: the reference's gathered parameters, 0 and not 0.
- `objectives_bf16` (rows `objectives_bf16_dpo_sigmoid`, `_orpo`, `_kto`, `_reward`): DPO (sigmoid, live
  reference), ORPO, KTO (live reference, alternating desirable labels) and the reward model (a sequence-score
  head), one update step (`accumulate_gradients`, 2 microbatches of 4 real-chat pairs, sides cut to 512 tokens)
  with the recipe's numerics (bf16 compute, loss.implementation auto, eager layers) against the exact fp32
  reference (fp32 parameters, the chunked head, no TF32) on the same documents and weights: the step's loss
  (relative ≤ 2e-2) and its gradient over all parameters (relative ≤ 1e-1). Bounds chosen from what bf16 can
  give, not yet measured: the first GPU run should tighten them (`OBJECTIVES_BF16_BOUNDS`). On the CPU both runs
  are fp32 (2 pairs a microbatch, sides cut to 64 tokens): ≤ 1e-5 / 1e-5, the path run end to end.
- `low_bit` (rows `low_bit_AdamW8bit`, `_AdamW4bit`, `_AdamWFp8`, `low_bit_resume`): torchao's low-bit AdamW
  as the recipe builds it, 20 steps of a 4-layer 0.6B against fp32 AdamW on the same rows, every step's loss
  within the documented tolerance (0.02 nats 8-bit, 0.4 4-bit; FP8 held to 8-bit's until measured); the 8-bit
  run saves asynchronously after step 10 and a resumed model gives steps 11-20 bit for bit. On the CPU 8 steps
  of the tiny shape, torchao's step eager. SKIP where torchao is absent.
- `offload_races` (rows `offload_{eager,compiled}_{ac,noac}`): activation offload in bf16 on one 16k-token row
  (4 layers of the 0.6B), eager and compiled, with and without checkpointing: 3 backwards each give the plain
  run's gradients as exactly as the plain run repeats itself (bit for bit where it does: a copy racing the
  compute shows in some repeat), a lower peak, the bytes moved at most the saved tensors' unique storages
  (counted eager by the check's own hook), and the host slab at most 1.05x the bytes moved (plus a first slab's 64 MiB); the figure also counts
  the copies back that the prefetch started before autograd asked for them. On the CPU the tiny shape, eager, no peak.
- `cpu_offload`: `model.fsdp.cpu_offload=true` (bf16 compute, layers compiled, activation checkpointing) against
  the same model without it, two steps on the same rows: every parameter within 1e-5 relative; the second
  step's time of each, the offloaded one's slowdown its figure. On the CPU the tiny shape, eager, fp32.
- `snapshots` (rows `snapshot_overhead`, `snapshot_exact`, `snapshot_resume`): `snapshot_steps`' copy of the run
  state to pinned host buffers after every step, on a side stream: the time it adds to a step (8 layers of the
  0.6B, compiled, 16,384-token rows) at most what the copy takes beyond the step's compute plus half of the copy's
  own time (the state's bytes over the device-to-host bandwidth measured there), since it overlaps the next
  step; then SIGTERM has the watcher write the staged step after the state
  moved on, and a fresh model loaded from it holds that step's weights and AdamW states bit for bit and gives
  the next step's loss bit for bit. On the CPU the tiny shape; the overhead row is SKIP (the copy is the step's).
- `estimate_bound` (rows `estimate_bound_{cce,chunked}_{ac,noac}[_offload]`): the start-up memory estimate of
  the recipe's config against the peak torch allocated in two steps of the model built from it (8 layers of the
  0.6B, one 16,384-token row, layers compiled), for each loss head with and without activation checkpointing and
  activation offload: within ±10%; the first row also gives what torch does not count (total - free -
  reserved). On the CPU the estimates and steps run on the tiny shape and the row is SKIP (no device peak).
- `throughput`: full SFT, LoRA and QLoRA steps of `recipes/sft.py` on the 0.6B and 1.7B Qwen3 shapes (random
  weights, 20k short real chats, 2 × 16,384-token microbatches a step; the 1.7B with activation
  checkpointing): tokens/s per device, MFU and peak memory beside rank 0's start-up estimate of it
  (chattune.model.cost.memory); TRL's SFTTrainer beside full SFT when `trl` is importable; last, on the first shape,
  float8 linear layers (`model.fp8=tensorwise`, needs torchao) and offloaded, recomputed activations, against the
  full SFT row's tokens/s and peak. Targets: MFU ≥ 45% on the 1.7B full step; ≥ 3× TRL's tokens/s; peak memory ≤
  TRL's. (The CPU smoke test runs the full SFT launch alone, on the tiny shape.) Each launch logs dynamo's
  recompiles (`TORCH_LOGS=recompiles`); `steady_steps_<shape>_<mode>`: no step after the first 2 over 2x the
  median step time, each that is named with what recompiled before it ("no recompile logged": it slowed for
  another reason) and its own wait for data and garbage-collection time (the step's `data_wait_s`, `gc_s`). The
  first shape's full SFT launch runs 24 steps on CUDA (the slow steps 11-12 of the first GPU run, BENCHMARKS.md).
- `longest_row`: the longest packed row (32k, 64k, 128k tokens, one step, activation checkpointing) the first shape
  trains on one GPU, without and with offloaded activations, each with its peak memory. CUDA only, last.
- `cuda_tests`: the project's CUDA-only tests, `pytest -k cuda` over the test files with a
  `torch.cuda.is_available()` skip and tests/unit/model/packed/test_varlen_fallback.py, in a subprocess (needs pytest). CUDA only.
- `resume_exact`: 8 steps straight against 4, stop, resume, 4 with `save_async=true` and evaluation on:
  bitwise equal losses. `export_masters`: the export after a final step that saved a checkpoint equals that
  checkpoint's fp32 masters, tensor for tensor; `export_after_eval`: the export after a final step that
  evaluated and saved nothing holds fp32 masters, not bf16 copies (issue 26, item 1).

On a GPU machine without internet (torch ≥ 2.11, transformers ≥ 5.17 preinstalled) it runs from a checkout
on PYTHONPATH with the wheels the machine lacks: `python scripts/gpu_carry.py` builds that carry folder
(hydra-core, omegaconf, antlr4-python3-runtime, torchdata, datasets, peft, cut-cross-entropy, trl, pytest)
and prints the one command that installs it and runs this script and bench_gpu.py within a budget; QLoRA's
bitsandbytes is a folder and a call of its own (`--with-bitsandbytes`). Real tokenizer and chats come from
--assets (../shared/assets: the Qwen3 tokenizer, the FastChat chats); without them the run uses chattune's demo
tokenizer and chats, and says so.

The package (`python scripts/gpu_check` runs its __main__.py, the arguments and main): context.py (the rows,
the context, models and data), numerics.py and objectives.py (the in-process checks), memory.py (low-bit
states, offload, snapshots, the memory estimate), runs.py (the recipe launches), plan.py (the budget, the
items, their order), report.py (the JSON, the table, the environment). Its modules import each other
within the package; importing it puts this checkout and scripts/bench/ (bench_gpu) on sys.path.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project (scripts/gpu_check/__init__.py)
sys.path.insert(0, str(ROOT))  # chattune from this checkout
sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # bench_gpu: the budget, the launches' stops, the corpora
