"""Tensor parallelism's process groups and collectives (torch.distributed: NCCL on GPU, gloo on CPU)."""
