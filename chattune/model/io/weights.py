"""The weight files of a Hugging Face model directory, and whether they are all there: checked before a launch
(`chattune validate` and a recipe's start-up) without importing torch or transformers, so that a directory
without weights, or with shards missing, is one clear problem instead of an OSError from deep in the loading."""

from __future__ import annotations

import json
from pathlib import Path

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
# What `from_pretrained` reads, in its order of preference: each file with the index of its sharded form.
WEIGHT_FILES = ((SAFETENSORS_SINGLE, SAFETENSORS_INDEX), ("pytorch_model.bin", "pytorch_model.bin.index.json"))


def weights_problem(directory: Path) -> str | None:
    """What keeps `directory` from giving a model its weights: no weight files, or an index naming shards that
    are not there (a download or copy cut short). None when its weights are all present."""
    for single, index in WEIGHT_FILES:
        if (directory / index).is_file():
            try:
                shards = set(json.loads((directory / index).read_text())["weight_map"].values())
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
                return f"its {index} cannot be read ({type(error).__name__}: {error})"
            missing = sorted(shard for shard in shards if not (directory / shard).is_file())
            if missing:
                return (
                    f"{len(missing)} of the {len(shards)} weight files its {index} names are missing "
                    f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
                )
            return None
        if (directory / single).is_file():
            return None
    return (
        f"it holds no model weights ({', '.join(name for pair in WEIGHT_FILES for name in pair)}): a "
        "directory that save_pretrained wrote, or a complete download, has them"
    )
