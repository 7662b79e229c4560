"""Training: the update step and its microbatches, the loop, the optimizer and its schedule, metrics, evaluation
and sample replies, a reference model's log-probabilities."""
