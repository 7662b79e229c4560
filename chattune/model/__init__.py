"""Models: the HF model with packed attention and a chunked loss head (or a reward model's score head), its
building and loading, its export and its replies."""
