"""The output head: the chunked fp32 loss, cut-cross-entropy, the chunked divergence to a teacher (GKD), the model's
logit transforms, and the kinds of head a recipe trains (a causal LM's, a reward model's score)."""
