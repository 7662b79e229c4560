"""Training: the update step, the loop, checkpoints and resume, metrics, the run's output directory."""
