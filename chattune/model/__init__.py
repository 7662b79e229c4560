"""Models: the HF model with packed attention and a chunked loss head (or a reward model's score head), its sharding, its export and its replies."""
