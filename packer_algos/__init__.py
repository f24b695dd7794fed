"""Numba bin-packing: sequence lengths in, packed rows (a PackPlan) out."""
