"""The kernel contract of ``ops``: the one home of the constants shared by the Python side and the CUDA sources.

The CUDA build receives these as ``-D`` definitions (see ``ops._build``); nothing is copied by hand into the
headers.
"""
from __future__ import annotations

SCAN_CHUNK = 64        # timesteps a scan block stages at a time; the forward saves one state per chunk
SCAN_LANES = 16        # state lanes per channel in the CUDA scan (dstate is padded up to this)
MAX_DSTATE = 16        # largest d_state the CUDA scan takes
CONV_MIN_WIDTH = 2     # conv widths the CUDA conv takes
CONV_MAX_WIDTH = 4
CONV_SLOT_STEPS = 128  # the conv backward writes one dweight/dbias partial per block; at most one per this many steps
