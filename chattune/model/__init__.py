"""Models: the HF model with packed attention and a chunked loss head, its sharding, its export and its replies."""
