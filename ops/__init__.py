"""Packing-safe Mamba kernels (causal conv1d, selective scan) and modules."""
