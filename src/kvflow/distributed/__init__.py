"""torch.distributed for tensor parallelism: the rank's process groups and its collectives."""
