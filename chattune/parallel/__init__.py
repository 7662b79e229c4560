"""The run's layout over ranks: FSDP2 sharding, tensor, sequence, vocabulary and context parallelism, and
activation offloading (expert parallelism goes here next)."""
