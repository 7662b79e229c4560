"""Training: the update step, the loop, checkpoints and resume, metrics and sample replies, the run's output directory."""
