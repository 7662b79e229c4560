"""On-policy post-training: prompts, the policy's samples, their rewards and advantages, made into the update steps
of the GRPO recipe (`recipes/grpo.py`), and the held-out prompts' rewards at its evaluations; its losses are
`chattune.objectives.policy_gradient`."""
