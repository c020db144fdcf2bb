"""Tensor parallelism on torch.distributed (gloo on the CPU): sharding, the group, the workers."""
