"""Models: an HF model as chattune trains it (the packed causal LM, or a reward model's score head), built as a
recipe asks and generating replies; its parts by concern in the packages below."""
