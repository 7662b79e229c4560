"""Loading and writing models: HF model directories in, composite (multimodal) models' text parts, weights, HF
safetensors out."""
