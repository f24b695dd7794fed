"""Numba bin-packing: sequence lengths in, packed rows (a PackPlan) out.

>>> from packer_algos import pack, PackPlan, OnlinePacker
>>> plan = pack([5, 3, 6, 2], capacity=8, algorithm="bfd")
>>> plan.n_bins, plan.efficiency
(2, 1.0)
"""
from .api import ALGORITHMS, pack
from .online import OnlinePacker
from .pieces import OVERFLOW_POLICIES
from .plan import PackPlan

__all__ = ["pack", "PackPlan", "OnlinePacker", "ALGORITHMS", "OVERFLOW_POLICIES"]
