"""Start-up checks: a model's packed forward against stock transformers (`architecture`), a mixer's isolation probed
(`packing_probe`), the known failures of remote code."""
