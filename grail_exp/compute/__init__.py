"""The policy forward and what computes it fast: token log-probs in chunks, the CPU attention kernels and their
layouts, the leading-rows backward, the host heap, weight chunks for an engine."""
