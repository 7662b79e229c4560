"""Modules that moved in a reshaping of the package, and where to: a recipe copied before the move imports the old
name and gets one error naming the new import (`MovedModules`, installed by `chattune/__init__.py`), not a bare
"No module named". The table grows by one line per move; nothing is kept at the old place."""

from __future__ import annotations

import importlib.abc
import sys

# old module -> new module (2026-12: the parallelisms out of model/ into parallel/)
MOVED = {
    "chattune.model.fsdp": "chattune.parallel.fsdp",
    "chattune.model.tensor_parallel": "chattune.parallel.tensor_parallel",
    "chattune.model.sequence_parallel": "chattune.parallel.sequence_parallel",
    "chattune.model.vocab_parallel": "chattune.parallel.vocab_parallel",
    "chattune.model.context_parallel": "chattune.parallel.context_parallel",
    "chattune.model.offload": "chattune.parallel.offload",
    # (2026-12: the run's state on disk out of train/ into checkpoint/; the feed beside the data it assembles)
    "chattune.train.checkpoint": "chattune.checkpoint.checkpoint",
    "chattune.train.snapshot": "chattune.checkpoint.snapshot",
    "chattune.train.staging": "chattune.checkpoint.staging",
    "chattune.train.resume": "chattune.checkpoint.resume",
    "chattune.train.run_state": "chattune.checkpoint.run_state",
    "chattune.train.output_dir": "chattune.checkpoint.output_dir",
    "chattune.train.faults": "chattune.faults",
    "chattune.train.feed": "chattune.data.feed",
    # (2026-12: model/ by concern: the packed forward, the head, the checks, loading and export, adapters,
    # quantization, costs)
    "chattune.model.activation_trace": "chattune.model.cost.activation_trace",
    "chattune.model.flops": "chattune.model.cost.flops",
    "chattune.model.memory": "chattune.model.cost.memory",
    "chattune.model.memory_advice": "chattune.model.cost.memory_advice",
    "chattune.model.adapter_targets": "chattune.model.peft.adapter_targets",
    "chattune.model.adapters": "chattune.model.peft.adapters",
    "chattune.model.architecture_check": "chattune.model.checks.architecture",
    "chattune.model.code_failures": "chattune.model.checks.code_failures",
    "chattune.model.packing_probe": "chattune.model.checks.packing_probe",
    "chattune.model.attention": "chattune.model.packed.attention",
    "chattune.model.attention_kernels": "chattune.model.packed.kernels",
    "chattune.model.chunked_attention": "chattune.model.packed.chunked_attention",
    "chattune.model.indexed_attention": "chattune.model.packed.indexed_attention",
    "chattune.model.mixers": "chattune.model.packed.mixers",
    "chattune.model.rotary": "chattune.model.packed.rotary",
    "chattune.model.router_loss": "chattune.model.packed.router_loss",
    "chattune.model.chunked_loss": "chattune.model.head.chunked_loss",
    "chattune.model.fused_loss": "chattune.model.head.fused_loss",
    "chattune.model.heads": "chattune.model.head.kinds",
    "chattune.model.output_logits": "chattune.model.head.output_logits",
    "chattune.model.composite": "chattune.model.io.composite",
    "chattune.model.export": "chattune.model.io.export",
    "chattune.model.load": "chattune.model.io.load",
    "chattune.model.weights": "chattune.model.io.weights",
    "chattune.model.float8": "chattune.model.quantization.float8",
    "chattune.model.quantize": "chattune.model.quantization.quantize",
    # (2026-12: data/ by stage: records/ in, templates/ to documents; packing, the stream and the cache stay)
    "chattune.data.records": "chattune.data.ingest.records",
    "chattune.data.formats": "chattune.data.ingest.formats",
    "chattune.data.sources": "chattune.data.ingest.sources",
    "chattune.data.cached_sources": "chattune.data.ingest.cached_sources",
    "chattune.data.source_mixture": "chattune.data.ingest.source_mixture",
    "chattune.data.mixing_policy": "chattune.data.ingest.mixing_policy",
    "chattune.data.held_out": "chattune.data.ingest.held_out",
    "chattune.data.fingerprint": "chattune.data.ingest.fingerprint",
    "chattune.data.report": "chattune.data.ingest.report",
    "chattune.data.chat_template": "chattune.data.templates.chat_template",
    "chattune.data.template_choice": "chattune.data.templates.template_choice",
    "chattune.data.template_documents": "chattune.data.templates.template_documents",
    "chattune.data.sft_documents": "chattune.data.templates.sft_documents",
    "chattune.data.pair_documents": "chattune.data.templates.pair_documents",
    "chattune.data.kto_documents": "chattune.data.templates.kto_documents",
    "chattune.data.prompts": "chattune.data.templates.prompts",
    "chattune.data.text_encoder": "chattune.data.templates.text_encoder",
    "chattune.data.tokenizer": "chattune.data.templates.tokenizer",
}


class MovedModules(importlib.abc.MetaPathFinder):
    """A finder that knows only the old names of MOVED and answers each with a ModuleNotFoundError naming the
    new one."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        raise ModuleNotFoundError(
            f"{fullname} moved to {new}: import it from there (`from {new.rsplit('.', 1)[0]} import "
            f"{new.rsplit('.', 1)[1]}`); see docs/layout.md",
            name=fullname,
        )


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
