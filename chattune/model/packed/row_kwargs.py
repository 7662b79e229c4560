"""The kwargs a packed row with shared prompts hands its layers beside transformers' own flash-attention kwargs
(`cu_seq_lens_q`, ...), which the models forward untouched to their attention functions
(`chattune.model.packed.attention.packed_decoder_output` passes them; `check_shared_prompts` measures that they
arrive)."""

from __future__ import annotations

PREFIXES_KWARG = "chattune_prefixes"  # `PackedBatch.prefixes`: each segment's prompt span, read on the host
SHARED_KEYS_KWARG = "chattune_shared_keys"  # `PackedBatch.shared_keys`: the same row laid out for a varlen kernel
SHARED_PROMPT_KWARGS = (PREFIXES_KWARG, SHARED_KEYS_KWARG)
