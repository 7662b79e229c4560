"""Adapters: LoRA and its kin through peft, and which modules of a model they target."""
