"""Mamba modules that consume packed batches."""
