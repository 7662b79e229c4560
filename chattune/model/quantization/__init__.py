"""Low-precision weights: a 4-bit base (QLoRA, bitsandbytes) and float8 linear layers (torchao)."""
