"""canzona: matrix-optimizer partitioning and scheduling (policy core) and its torch.distributed runtime."""
