"""Mamba modules that consume packed batches."""
from .mamba_simple import PackedMamba

__all__ = ["PackedMamba"]
