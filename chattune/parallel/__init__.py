"""The run's layout over ranks: FSDP2 sharding, tensor, sequence, vocabulary and context parallelism, and
activation offloading, and expert parallelism's token exchange (its `parallel.expert` key is not wired yet)."""
