"""The CUDA kernels of ``ops/csrc`` run on the CPU: each .cu compiled by the host C++ compiler after
``tests/ops/emulation/cuda_host.h`` (its launches rewritten to run the blocks one at a time, each block's threads as
host threads meeting at the warp and block barriers), with the alignment sanitizer. The scan forward is compared with
a float64 scan (its output and the chunk-end states the backward starts from) on ragged rows (length 1, padding
tails, one sequence per row), odd and aligned lengths, B/C groups, dstate below 16, every dtype pair, with and
without z / D / bias / softplus; the backward's gradients with float64 autograd, and its recomputed output with the
forward's, bit for bit; the conv over the layouts and dtypes the ops take. The Python side of the CUDA path runs on
these kernels too (``EmulatedExt``). Every launch is checked for accesses the GPU would fault on (a misaligned
cp.async or vector access). The GPU's own arithmetic (MUFU exp2, flush to zero) and timing are not emulated: the GPU
tests (``test_cuda_kernels.py``) cover those. Skips without a C++20 compiler or CUDA headers."""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ops import _build
from ops.contract import SCAN_CHUNK, SCAN_LANES, conv_mask_stride

from ._helpers import channel_major as cm, misaligned_copy
from .test_cuda_kernels import (GRAD_NAMES, TOL, conv_ref64, kernel_err, lengths_mix, position_ids_for, rel_err,
                                scan_ref_grads, tile_edge_row)

HERE = pathlib.Path(__file__).parent / "emulation"
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^;{}]*?>)?)<<<")


def cuda_include() -> "pathlib.Path | None":
    nvcc = _build.nvcc()
    for base in ([pathlib.Path(nvcc).resolve().parent.parent] if nvcc else []) + [pathlib.Path("/usr/local/cuda")]:
        if (base / "include" / "cuda_bf16.h").exists():
            return base / "include"
    return None


def _split_top(s: str) -> list:
    """s split at the commas outside parentheses."""
    parts, depth, cur = [], 0, ""
    for ch in s:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + [cur.strip()]


def host_source(text: str, name: str) -> str:
    """A .cu made host C++ for cuda_host.h: launches `k<<<grid, block, ...>>>(args);` become
    `emu_launch(dim3(grid), dim3(block), [&] { k(args); });`; cp.async comes from cuda_host.h; the scan backward's
    dynamic shared memory becomes a static array of its size."""
    text = text.replace('#include "cp_async.cuh"', "")
    text = text.replace("extern __shared__ __align__(16) unsigned char smem_raw[];",
                        "__shared__ __align__(16) unsigned char smem_raw[sizeof(BwdSmem<in_t, w_t>)];")
    out, i = [], 0
    while (m := LAUNCH.search(text, i)) is not None:
        j = text.index(">>>", m.end())
        grid, block = _split_top(text[m.end():j])[:2]
        assert text[j + 3] == "(", f"{name}: a launch without arguments at {text[m.start():j + 10]!r}"
        depth, k = 0, j + 3
        while True:
            depth += text[k] == "("
            depth -= text[k] == ")"
            if depth == 0:
                break
            k += 1
        args = text[j + 4:k]
        out.append(text[i:m.start()] + f"emu_launch(dim3({grid}), dim3({block}), [&] {{ {m.group(1)}({args}); }})")
        i = k + 1
    out.append(text[i:])
    return f'#include "cuda_host.h"\n#line 1 "{name}"\n' + "".join(out)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    inc = cuda_include()
    if cxx is None or inc is None:
        pytest.skip(f"needs a C++20 compiler ({cxx}) and CUDA headers ({inc}) to build the emulated kernels")
    sources = {name: host_source((_build.CSRC / name).read_text(), name) for name in _build.SOURCES
               if name.endswith(".cu")}
    harness = [HERE / "cuda_host.h", HERE / "entry.cpp"]
    key = hashlib.sha256("".join([p.read_text() for p in sorted(_build.CSRC.iterdir()) + harness] +
                                 _build.defines()).encode()).hexdigest()[:16]
    out = tmp_path_factory.getbasetemp() / f"kernel_emu_{key}"
    lib = out / "emu.so"
    if not lib.exists():
        out.mkdir(exist_ok=True)
        flags = [cxx, "-std=c++20", "-O1", "-fPIC", "-pthread", "-ffp-contract=off", "-fno-strict-aliasing",
                 "-fsanitize=alignment", "-w", f"-I{HERE}", f"-I{_build.CSRC}", f"-I{inc}", *_build.defines()]
        units = []
        for name, text in sources.items():
            (out / f"{name}.cpp").write_text(text)
            units.append(out / f"{name}.cpp")
        units.append(HERE / "entry.cpp")
        procs = [(u, subprocess.Popen(flags + ["-c", str(u), "-o", str(out / (u.name + ".o"))],
                                      stderr=subprocess.PIPE, text=True)) for u in units]
        for u, proc in procs:
            err = proc.communicate()[1]
            assert proc.returncode == 0, f"{u.name}:\n{err[-4000:]}"
        res = subprocess.run([cxx, "-shared", "-pthread", "-fsanitize=alignment", "-o", str(lib),
                              *[str(out / (u.name + ".o")) for u in units]], capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-4000:]
    so = ctypes.CDLL(str(lib))
    so.emu_first_fault.restype = ctypes.c_char_p
    so.emu_conv_bwd.restype = ctypes.c_int
    return so


def emu_call(so, name: str, *args):
    """so.name(*args), checked for accesses the GPU would fault on: a misaligned cp.async (counted by cuda_host.h) or
    a vector access at an address its type's alignment forbids (the sanitizer's "runtime error" on stderr, read
    from the file descriptor: the sanitizer writes there directly)."""
    with tempfile.TemporaryFile() as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            ret = getattr(so, name)(*args)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        text = err.read().decode(errors="replace")
    assert "runtime error" not in text, f"{name}: an access the GPU would fault on:\n{text[:2000]}"
    n = so.emu_fault_count()
    assert n == 0, f"{name}: {n} accesses would fault on the GPU; the first: {so.emu_first_fault().decode()}"
    return ret


FWD_LANES = (1, 2, 4, 8)   # the scan forward's layouts: threads a channel


@pytest.fixture(params=FWD_LANES, ids=lambda k: f"lanes{k}")
def fwd_lanes(emulator, request):
    """Runs the test with the scan forward in each of its layouts (at these sizes it would always take 8 lanes)."""
    emulator.emu_set_fwd_lanes(request.param)
    yield request.param
    emulator.emu_set_fwd_lanes(0)


# One element may be off by the rounding of its own dtype (the host computes in fp32 like the kernel, but not in the
# same order as float64), plus a floor of fp32 error over the tensor's scale: a single wrong element (a bad reset bit,
# a wrong last timestep) fails where a norm over the tensor would hide it.
ULP = {torch.float32: 2.0 ** -20, torch.float16: 2.0 ** -9, torch.bfloat16: 2.0 ** -7}


def assert_elementwise(got: torch.Tensor, ref: torch.Tensor, name: str = "", floor: float = 1e-5):
    ref = ref.detach().double()
    err = (got.double() - ref).abs()
    bound = ULP[got.dtype] * ref.abs() + floor * ref.abs().max().clamp_min(1e-30)
    bad = err > bound
    if bad.any():
        i = tuple(int(k) for k in bad.nonzero()[0])
        raise AssertionError(f"{name}: {int(bad.sum())} elements off, e.g. at {i}: {got[i].item()} vs "
                             f"{ref[i].item()} (bound {bound[i].item():.3g}); scale {ref.abs().max().item():.3g}")


def ptr(t):
    return ctypes.c_void_p(0 if t is None else t.data_ptr())


def run_emulated(so, u, delta, A, B, C, D, z, delta_bias, pos, softplus, segments=1):
    batch, dim, L = u.shape
    groups, dstate = B.shape[1], B.shape[2]
    out = torch.full_like(u, float("nan"))
    saved = torch.full((batch, dim, -(-L // SCAN_CHUNK), SCAN_LANES), float("nan"))
    emu_call(so, "emu_scan_fwd", DTYPE_CODE[u.dtype], int(B.dtype == torch.float32), batch, dim, L, dstate, groups,
             int(softplus), ptr(u), ptr(delta), ptr(A), ptr(B), ptr(C), ptr(D), ptr(z), ptr(delta_bias), ptr(pos),
             ptr(out), ptr(saved), segments, 0, ptr(None), ptr(None), ptr(None), ptr(None))   # no carried states
    return out, saved


def ref64(u, delta, A, B, C, D, z, delta_bias, pos, softplus):
    """The output and the state after the last timestep of every chunk of SCAN_CHUNK, in float64."""
    u, delta, A = u.double(), delta.double(), A.double()
    batch, dim, L = u.shape
    G = B.shape[1]
    B = B.double().repeat_interleave(dim // G, dim=1)   # (batch, dim, N, L)
    C = C.double().repeat_interleave(dim // G, dim=1)
    if delta_bias is not None:
        delta = delta + delta_bias.double()[:, None]
    if softplus:
        delta = F.softplus(delta)
    keep = (pos != 0).double()
    h = torch.zeros(batch, dim, A.shape[1], dtype=torch.float64)
    ys, states = [], []
    for t in range(L):
        h = torch.exp(delta[:, :, t, None] * A) * keep[:, t, None, None] * h \
            + delta[:, :, t, None] * B[:, :, :, t] * u[:, :, t, None]
        ys.append((h * C[:, :, :, t]).sum(-1))
        if (t + 1) % SCAN_CHUNK == 0 or t == L - 1:
            states.append(h)
    out = torch.stack(ys, -1)
    if D is not None:
        out = out + D.double()[:, None] * u
    if z is not None:
        out = out * F.silu(z.double())
    return out, torch.stack(states, 2)


CASES = [  # batch, dim, dstate, L, groups, kinds
    (2, 48, 16, 200, 1, ("mixed", "padded")),
    (3, 40, 8, 70, 1, ("tiny", "one", "mixed")),   # dstate 8, dim not a multiple of 16
    (2, 96, 16, 160, 6, ("mixed",)),             # 16 channels a group
    (2, 80, 12, 151, 5, ("tiny", "one")),        # odd L (plain loads for 16-bit inputs), dstate 12
    (1, 32, 16, 1, 1, ("one",)),                 # one timestep
    (1, 33, 16, 64, 1, ("padded",)),             # one chunk exactly; a last block of one channel
    (2, 32, 16, 136, 2, ("mixed", "tiny")),      # two groups of 16
    (1, 40, 16, 100, 1, ("mixed",)),             # L % 8 == 4: a partial last run of 8 (aligned rows for fp32)
]


@pytest.mark.parametrize("dtype,bc_fp32", [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False),
                                           (torch.bfloat16, True)], ids=["fp32", "bf16", "fp16", "bf16-Bfp32"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}d{c[1]}n{c[2]}L{c[3]}g{c[4]}")
def test_emulated_forward_matches_float64(emulator, fwd_lanes, seed, dtype, bc_fp32, case):
    batch, dim, dstate, L, groups, kinds = case
    u = torch.randn(batch, dim, L).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, L) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    wdt = torch.float32 if bc_fp32 else dtype
    B = torch.randn(batch, groups, dstate, L).to(wdt)
    C = torch.randn(batch, groups, dstate, L).to(wdt)
    D, z, db = torch.randn(dim), torch.randn(batch, dim, L).to(dtype), 0.5 * torch.randn(dim)
    rows = [lengths_mix(L, kinds[i % len(kinds)]) for i in range(batch)]
    pos = position_ids_for(rows, "cpu").int().contiguous()
    out, saved = run_emulated(emulator, u, delta, A, B, C, D, z, db, pos, True)
    ref_out, ref_saved = ref64(u, delta, A, B, C, D, z, db, pos, True)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.float16: 1e-3}[dtype]
    assert not out.isnan().any() and not saved[..., :dstate].isnan().any()
    assert kernel_err(out, ref_out) <= tol, kernel_err(out, ref_out)
    assert rel_err(saved[..., :dstate], ref_saved) <= 1e-5, rel_err(saved[..., :dstate], ref_saved)
    assert_elementwise(out, ref_out, "out")
    assert_elementwise(saved[..., :dstate], ref_saved, "saved")
    assert (saved[..., dstate:] == 0).all()   # padded state lanes stay zero


@pytest.mark.parametrize("has_z,has_D,has_bias,softplus", [(False, False, False, False), (True, False, True, False),
                                                           (False, True, False, True)])
def test_emulated_forward_optional_inputs(emulator, fwd_lanes, seed, has_z, has_D, has_bias, softplus):
    batch, dim, dstate, L = 2, 40, 16, 96
    u = torch.randn(batch, dim, L)
    delta = torch.rand(batch, dim, L) if not softplus else torch.randn(batch, dim, L) - 1.0
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    B, C = torch.randn(batch, 1, dstate, L), torch.randn(batch, 1, dstate, L)
    D = torch.randn(dim) if has_D else None
    z = torch.randn(batch, dim, L) if has_z else None
    db = 0.5 * torch.rand(dim) if has_bias else None
    pos = position_ids_for([lengths_mix(L, "mixed"), lengths_mix(L, "padded")], "cpu").int().contiguous()
    out, saved = run_emulated(emulator, u, delta, A, B, C, D, z, db, pos, softplus)
    ref_out, ref_saved = ref64(u, delta, A, B, C, D, z, db, pos, softplus)
    assert rel_err(out, ref_out) <= 1e-5 and rel_err(saved, ref_saved) <= 1e-5
    assert_elementwise(out, ref_out, "out")
    assert_elementwise(saved, ref_saved, "saved")


def test_emulated_forward_keeps_inf_in_its_sequence(emulator, fwd_lanes):
    """A state that overflows to inf in one sequence must not reach the next (the reset is a select)."""
    dim, L = 32, 64
    u = torch.randn(1, dim, L)
    u[:, :, 10] = float("inf")
    delta, A = torch.rand(1, dim, L), -torch.ones(dim, 16)
    B, C = torch.randn(1, 1, 16, L), torch.randn(1, 1, 16, L)
    pos = position_ids_for([[20, 44]], "cpu").int().contiguous()
    out, saved = run_emulated(emulator, u, delta, A, B, C, None, None, None, pos, False)
    assert not out[..., :10].isnan().any() and out[..., 10:20].isinf().logical_or(out[..., 10:20].isnan()).any()
    assert torch.isfinite(out[..., 20:]).all() and torch.isfinite(saved).all()


def scan_fwd_lanes_twin(batch: int, dim: int, segments: int, sm_count: int) -> int:
    """selective_scan.cu's scan_fwd_lanes in Python: the fewest threads a channel that make SCAN_FWD_WARPS_PER_SM
    warps a multiprocessor, a row cut into segments counting as at most two rows."""
    from ops.time_split import fwd_lanes   # the rule for full rows, which the cut along time passes to the launch

    return fwd_lanes(batch * min(max(segments, 1), 2), dim, sm_count)


@pytest.mark.parametrize("sm_count", [1, 78, 114, 132])
def test_scan_forward_layout_choice(emulator, sm_count):
    """The forward's layout follows the warps a grid makes per multiprocessor: fewer threads a channel as channels
    grow, 8 for a handful, one step fewer where rows are cut into segments; the launcher and its Python twin agree
    everywhere."""
    batches = (1, 2, 3, 4, 8, 16, 64, 256)
    for dim in (1, 16, 33, 768, 1536, 2048, 2560, 4096, 5120, 8192):
        for segments in (1, 2, 8):
            lanes = [emulator.emu_scan_fwd_lanes(batch, dim, segments, sm_count) for batch in batches]
            assert lanes == [scan_fwd_lanes_twin(batch, dim, segments, sm_count) for batch in batches]
            assert lanes == sorted(lanes, reverse=True) and set(lanes) <= set(FWD_LANES)
        assert all(emulator.emu_scan_fwd_lanes(b, dim, 8, sm_count) == emulator.emu_scan_fwd_lanes(2 * b, dim, 1,
                                                                                                   sm_count)
                   for b in batches)
    assert emulator.emu_scan_fwd_lanes(1, 32, 1, sm_count) == 8
    assert emulator.emu_scan_fwd_lanes(256, 8192, 1, sm_count) == 1


def check_states(u, A, state_slots, *states):
    """binding.cpp's check_states: (2, batch, seqlen) or (2, batch) int32 slots, (slots, dim, dstate) float32
    contiguous states. Returns the kernels' (state_slots, row_slots)."""
    if state_slots is None:
        assert all(t is None for t in states), "states given without state_slots"
        return None, None
    assert state_slots.dtype == torch.int32 and state_slots.is_contiguous()
    assert state_slots.shape in ((2, u.shape[0], u.shape[2]), (2, u.shape[0]))
    for t in states:
        if t is not None:
            assert t.dtype == torch.float32 and t.is_contiguous() and t.dim() == 3
            assert t.shape[1:] == (u.shape[1], A.shape[1])
    return (None, state_slots) if state_slots.dim() == 2 else (state_slots, None)


class EmulatedExt:
    """The compiled extension's scan entry points (ops/csrc/binding.cpp's signatures) on the emulated kernels, so that
    the Python side of the CUDA path (ops.selective_scan_interface) runs on CPU tensors."""

    def __init__(self, so):
        self.so = so

    def _scan_layout(self, u, *tensors):
        """binding.cpp's check_scan_layout, and the kernels' x_bs / x_ds from u's strides."""
        assert u.shape[2] <= 1 or u.stride(2) == 1
        for t in tensors:
            assert t is None or (t.shape == u.shape and all(n <= 1 or a == b for n, a, b in
                                                            zip(u.shape, t.stride(), u.stride()))), "layouts differ"
        self.so.emu_set_scan_layout(ctypes.c_int64(u.stride(0)), ctypes.c_int64(u.stride(1)))

    def scan_fwd(self, u, delta, A, B, C, D, z, delta_bias, pos, softplus, out, saved, segments, lanes,
                 state_slots=None, initial_state=None, final_state=None):
        assert segments >= 1 and lanes in (0, 1, 2, 4, 8)
        self._scan_layout(u, delta, z, out)
        state_slots, row_slots = check_states(u, A, state_slots, initial_state, final_state)
        assert row_slots is None or z is not None, "row-edge state_slots need z"
        try:
            emu_call(self.so, "emu_scan_fwd", DTYPE_CODE[u.dtype], int(B.dtype == torch.float32), *u.shape[:2],
                     u.shape[2], A.shape[1], B.shape[1], int(softplus), ptr(u), ptr(delta), ptr(A), ptr(B), ptr(C),
                     ptr(D), ptr(z), ptr(delta_bias), ptr(pos), ptr(out), ptr(saved), segments, lanes,
                     ptr(state_slots), ptr(initial_state), ptr(final_state), ptr(row_slots))
        finally:
            self.so.emu_set_scan_layout(ctypes.c_int64(0), ctypes.c_int64(0))   # contiguous for direct calls

    def scan_bwd(self, u, delta, A, B, C, D, z, delta_bias, pos, softplus, saved, dout, out_rec, du, ddelta, dz, dA,
                 dB, dC, dD, ddelta_bias, det_part, segments, state_slots=None, initial_state=None,
                 dfinal_state=None, dinitial_state=None):
        # binding.cpp's checks: the per-(row, segment) sums have batch * segments rows; the states
        assert dA.shape[0] == u.shape[0] * segments and all(t is None or t.shape[0] == dA.shape[0]
                                                             for t in (dD, ddelta_bias))
        state_slots, row_slots = check_states(u, A, state_slots, initial_state, dfinal_state, dinitial_state)
        assert row_slots is None or z is not None, "row-edge state_slots need z"
        assert (initial_state is None) == (dinitial_state is None)
        self._scan_layout(u, delta, z, dout, out_rec, du, ddelta, dz)
        try:
            emu_call(self.so, "emu_scan_bwd", DTYPE_CODE[u.dtype], int(B.dtype == torch.float32), *u.shape[:2],
                     u.shape[2], A.shape[1], B.shape[1], int(softplus), ptr(u), ptr(delta), ptr(A), ptr(B), ptr(C),
                     ptr(D), ptr(z), ptr(delta_bias), ptr(pos), ptr(saved), ptr(dout), ptr(out_rec), ptr(du),
                     ptr(ddelta), ptr(dz), ptr(dA), ptr(dB), ptr(dC), ptr(dD), ptr(ddelta_bias), ptr(det_part),
                     segments, ptr(state_slots), ptr(initial_state), ptr(dfinal_state), ptr(dinitial_state),
                     ptr(row_slots))
        finally:
            self.so.emu_set_scan_layout(ctypes.c_int64(0), ctypes.c_int64(0))

    @staticmethod
    def _conv_args(x, weight, bias, pos, silu, runmask):
        batch, dim, L = x.shape
        xs = (ctypes.c_int64 * 3)(*x.stride())
        channel_last = x.stride(1) == 1 and dim > 1
        # binding.cpp's conv_runmask_for: the caller's boundary words, else scratch the launch fills
        given = runmask is not None and not channel_last
        if given:
            assert runmask.dtype == torch.int16 and runmask.shape == (batch, conv_mask_stride(L))
        elif not channel_last:
            runmask = torch.empty(batch, conv_mask_stride(L), dtype=torch.int16)
        else:
            runmask = None
        return (DTYPE_CODE[x.dtype], batch, dim, L, weight.shape[1], int(silu), ptr(x), xs, ptr(weight), ptr(bias),
                ptr(pos), ptr(runmask), int(given)), runmask

    def conv_runmask(self, pos):
        mask = torch.empty(pos.shape[0], conv_mask_stride(pos.shape[1]), dtype=torch.int16)
        emu_call(self.so, "emu_conv_runmask", ptr(pos), ptr(mask), *pos.shape)
        return mask

    def conv_fwd(self, x, weight, bias, pos, silu, out, runmask):
        assert out.stride() == x.stride(), "out must have x's layout"
        args, keep = self._conv_args(x, weight, bias, pos, silu, runmask)
        emu_call(self.so, "emu_conv_fwd", *args, ptr(out))

    def conv_bwd(self, x, weight, bias, pos, silu, dout, dx, dw_part, dweight, dbias, runmask):
        assert dx.stride() == x.stride(), "dx must have x's layout"
        args, keep = self._conv_args(x, weight, bias, pos, silu, runmask)
        return emu_call(self.so, "emu_conv_bwd", *args, ptr(dout), (ctypes.c_int64 * 3)(*dout.stride()), ptr(dx),
                        ptr(dw_part), ptr(dweight), ptr(dbias))

    def _conv_states(self, bwd, out, x, weight, bias, silu, initial_state, start, length, has, final_state=None,
                     dx_head=None, dw_part=None, dinitial_state=None):
        # binding.cpp's conv_state_params
        S = start.shape[0]
        assert out.shape == x.shape and out.dtype == x.dtype and initial_state.is_contiguous()
        assert initial_state.shape == (S, x.shape[1], weight.shape[1] - 1) and initial_state.dtype == x.dtype
        assert start.dtype == length.dtype == torch.int64 and has.dtype == torch.bool
        assert weight.dtype == torch.float32 and weight.is_contiguous()
        emu_call(self.so, "emu_conv_states", int(bwd), DTYPE_CODE[x.dtype], *x.shape, weight.shape[1], S, int(silu),
                 ptr(x), (ctypes.c_int64 * 3)(*x.stride()), ptr(out), (ctypes.c_int64 * 3)(*out.stride()),
                 ptr(weight), ptr(bias), ptr(start), ptr(length), ptr(has), ptr(initial_state), ptr(final_state),
                 ptr(dx_head), ptr(dw_part), ptr(dinitial_state))

    def conv_states_fwd(self, out, x, weight, bias, silu, initial_state, start, length, has, final_state):
        assert final_state.shape == initial_state.shape and final_state.is_contiguous()
        self._conv_states(False, out, x, weight, bias, silu, initial_state, start, length, has, final_state)

    def conv_states_bwd(self, dout, x, weight, bias, silu, initial_state, start, length, has, dx_head, dw_part,
                        dinitial_state):
        S, dim, width = start.shape[0], x.shape[1], weight.shape[1]
        assert dx_head.shape == (S, width - 1, dim) and dw_part.shape == (S, dim, width + 1)
        assert dinitial_state is None or dinitial_state.shape == initial_state.shape
        self._conv_states(True, dout, x, weight, bias, silu, initial_state, start, length, has, None, dx_head,
                          dw_part, dinitial_state)

    parts = None   # the parts each segment is cut into (None: binding.cpp's rule for an H200's 132 multiprocessors)

    def segment_sums(self, forward, delta, delta_bias, A, x, z, bc, softplus, start, length, max_length, sums,
                     dt_sums):
        # binding.cpp's checks
        assert x.shape == delta.shape and x.dtype == delta.dtype and delta.stride(2) == x.stride(2) == 1
        assert z is None or (not forward and z.dtype == delta.dtype and z.stride(2) == 1)
        assert bc.dim() == 3 and bc.stride(2) == 1 and bc.dtype in (delta.dtype, torch.float32)
        assert sums.shape == (start.numel(), delta.shape[1], A.shape[1]) and sums.is_contiguous()
        assert 0 <= max_length <= delta.shape[2] and int(length.max()) <= max_length
        parts = self.parts or self.so.emu_segment_sums_parts(start.numel(), delta.shape[1], max_length, 132)
        scratch = [torch.full((parts, start.numel(), delta.shape[1]) + extra, float("nan")) if parts > 1 else None
                   for extra in ((A.shape[1],), ())]
        strides = [(ctypes.c_int64 * 2)(*t.stride()[:2]) for t in (delta, x, z if z is not None else x, bc)]
        emu_call(self.so, "emu_segment_sums", int(forward), DTYPE_CODE[delta.dtype], int(bc.dtype == torch.float32),
                 *delta.shape, A.shape[1], start.numel(), int(softplus), ptr(delta), strides[0], ptr(x), strides[1],
                 ptr(z), strides[2], ptr(bc), strides[3], ptr(A), ptr(delta_bias), ptr(start), ptr(length),
                 ptr(sums), ptr(dt_sums), parts, ptr(scratch[0]), ptr(scratch[1]))


def run_emulated_bwd(so, inputs, pos, softplus, saved, dout, segments=1):
    u, delta, A, B, C, D, z, db = inputs
    batch, dim, L = u.shape
    groups, dstate = B.shape[1], B.shape[2]
    nan = float("nan")
    out_rec, du, ddelta = torch.full_like(u, nan), torch.full_like(u, nan), torch.full_like(u, nan)
    dz = torch.full_like(u, nan) if z is not None else None
    # an empty segment writes nothing: its rows must start at zero (as ops.selective_scan_interface allocates them)
    rows = batch * segments
    dA = torch.full((rows, dim, dstate), nan) if segments == 1 else torch.zeros(rows, dim, dstate)
    dB, dC = torch.zeros(batch, groups, dstate, L), torch.zeros(batch, groups, dstate, L)
    dD = (torch.full((rows, dim), nan) if segments == 1 else torch.zeros(rows, dim)) if D is not None else None
    ddb = (torch.full((rows, dim), nan) if segments == 1 else torch.zeros(rows, dim)) if db is not None else None
    EmulatedExt(so).scan_bwd(u, delta, A, B, C, D, z, db, pos, softplus, saved, dout, out_rec, du, ddelta, dz, dA,
                             dB, dC, dD, ddb, None, segments)
    grads = (du, ddelta, dA.sum(0), dB.to(B.dtype), dC.to(C.dtype), None if dD is None else dD.sum(0), dz,
             None if ddb is None else ddb.sum(0))
    return out_rec, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[3]], ids=lambda c: f"b{c[0]}d{c[1]}n{c[2]}L{c[3]}g{c[4]}")
@pytest.mark.parametrize("has_z", [True, False], ids=["z", "noz"])
def test_emulated_backward_gradients_and_recomputed_output(emulator, fwd_lanes, seed, dtype, case, has_z):
    """The backward starts from the forward's saved states: its gradients match float64 autograd, and the output
    it recomputes (recompute_out) is the forward's, bit for bit, whatever the forward's layout (the two sum over
    states in the same tree)."""
    batch, dim, dstate, L, groups, kinds = case
    u = torch.randn(batch, dim, L).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, L) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    B, C = torch.randn(batch, groups, dstate, L).to(dtype), torch.randn(batch, groups, dstate, L).to(dtype)
    z = torch.randn(batch, dim, L).to(dtype) if has_z else None
    inputs = (u, delta, A, B, C, torch.randn(dim), z, 0.5 * torch.randn(dim))
    rows = [lengths_mix(L, kinds[i % len(kinds)]) for i in range(batch)]
    pos = position_ids_for(rows, "cpu").int().contiguous()
    out, saved = run_emulated(emulator, *inputs, pos, True)
    dout = torch.randn_like(out)
    out_rec, grads = run_emulated_bwd(emulator, inputs, pos, True, saved, dout)
    assert torch.equal(out_rec, out)
    _, _, ref_grads = scan_ref_grads(inputs, pos, True, dout)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-3}[dtype]
    for name, g, rg in zip(GRAD_NAMES, grads, ref_grads):
        if rg is None:
            assert g is None, name
            continue
        assert not g.isnan().any(), name
        assert kernel_err(g, rg) <= tol, (name, kernel_err(g, rg))
        assert_elementwise(g, rg, name, floor=1e-4)


@pytest.fixture
def cuda_path_on_cpu(emulator, monkeypatch):
    """ops.selective_scan_interface's CUDA functions (_scan_fwd_cuda / _scan_bwd_cuda) on CPU tensors, with the
    emulated kernels as the extension."""
    from ops import backends, selective_scan_interface as ssi

    monkeypatch.setattr(backends, "implementation", lambda *a, **k: "cuda")
    monkeypatch.setattr(backends, "load_kernels", lambda: EmulatedExt(emulator))
    return ssi


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_misaligned_inputs_are_not_staged_with_cp_async(cuda_path_on_cpu, seed, dtype):
    """Contiguous 16-bit inputs that start 2 bytes past a 4-byte boundary (even L) must not reach cp.async, whose
    4-byte copies would fault on the GPU ("misaligned address"): the kernels take them with plain loads."""
    ssi = cuda_path_on_cpu
    batch, dim, dstate, L = 2, 32, 16, 96
    u = torch.randn(batch, dim, L).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, L) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    B, C = torch.randn(batch, dstate, L).to(dtype), torch.randn(batch, dstate, L).to(dtype)
    D, z, db = torch.randn(dim), torch.randn(batch, dim, L).to(dtype), 0.5 * torch.randn(dim)
    pos = position_ids_for([lengths_mix(L, "mixed"), lengths_mix(L, "tiny")], "cpu")
    dout = torch.randn(batch, dim, L).to(dtype)
    want_out, want_saved, _ = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True)
    want_grads = ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, want_saved, dout)
    m = [misaligned_copy(t) for t in (u, delta, B, C, z, dout)]
    out, saved, _ = ssi._scan_fwd_cuda(m[0], m[1], A, m[2], m[3], D, m[4], db, pos, True)
    grads = ssi._scan_bwd_cuda(m[0], m[1], A, m[2], m[3], D, m[4], db, pos, True, saved, m[5])
    assert torch.equal(out, want_out) and torch.equal(saved, want_saved)
    for name, g, w in zip(GRAD_NAMES, grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)   # dB / dC: float atomics, any order


def twice_deterministic(run):
    """run() twice under torch.use_deterministic_algorithms(True)."""
    torch.use_deterministic_algorithms(True)
    try:
        return [run() for _ in range(2)]
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("groups,dim", [(2, 40), (2, 64), (1, 48)], ids=["20-per-group", "32-per-group", "one-group"])
def test_cuda_path_on_emulated_kernels(cuda_path_on_cpu, seed, groups, dim):
    """The Python side of the CUDA path with the kernels' own code: group-by-group launches (groups that are not
    whole blocks), B/C without a group dim, fp32 B/C with bf16 activations, and the deterministic mode (its
    per-block partials summed over each group's blocks: the same bits twice, and the default mode's values)."""
    ssi = cuda_path_on_cpu
    batch, dstate, L, dtype = 2, 16, 150, torch.bfloat16
    u = torch.randn(batch, dim, L).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, L) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    shape = (batch, dstate, L) if groups == 1 else (batch, groups, dstate, L)
    B, C = torch.randn(shape), torch.randn(shape)   # float32 B / C
    D, z, db = torch.randn(dim), torch.randn(batch, dim, L).to(dtype), 0.5 * torch.randn(dim)
    pos = position_ids_for([lengths_mix(L, "mixed"), lengths_mix(L, "padded")], "cpu")
    out, saved, _ = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True)
    ref_out, _, _ = ssi._scan_fwd_reference(u.float(), delta.float(), A, B, C, D, z.float(), db, pos, True)
    assert kernel_err(out, ref_out.double()) <= 2e-3
    dout = torch.randn(batch, dim, L).to(dtype)
    default = ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, saved, dout, True)
    det = twice_deterministic(lambda: ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, saved, dout, True))
    assert torch.equal(default[8], out)   # the recomputed output
    for name, a, b, c in zip(GRAD_NAMES + ["out"], default, det[0], det[1]):
        assert torch.equal(b, c), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype,dim,groups,L", [(torch.bfloat16, 48, 1, 150), (torch.float32, 40, 2, 150),
                                               (torch.bfloat16, 32, 1, 151)], ids=["bf16", "fp32-20-per-group", "odd-L"])
def test_channel_major_layout_on_emulated_kernels(cuda_path_on_cpu, seed, dtype, dim, groups, L):
    """u, delta, z and dout laid out as (d, b, L) (the fused mixer's layout, ops.contract.is_channel_major): the
    kernels read and write it in place (x_bs / x_ds), every (b, d, L) output comes in it, with the bits of the
    contiguous call (dB / dC: float atomics, any order); also group by group and with an odd L (plain loads)."""
    ssi = cuda_path_on_cpu
    batch, dstate = 3, 16
    u = torch.randn(batch, dim, L).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, L) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    B, C = torch.randn(batch, groups, dstate, L).to(dtype), torch.randn(batch, groups, dstate, L).to(dtype)
    D, z, db = torch.randn(dim), torch.randn(batch, dim, L).to(dtype), 0.5 * torch.randn(dim)
    pos = position_ids_for([lengths_mix(L, "mixed"), lengths_mix(L, "tiny"), lengths_mix(L, "padded")], "cpu")
    dout = torch.randn(batch, dim, L).to(dtype)
    want_out, want_saved, _ = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True)
    want = ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, want_saved, dout, True)
    out, saved, _ = ssi._scan_fwd_cuda(cm(u), cm(delta), A, B, C, D, cm(z), db, pos, True)
    got = ssi._scan_bwd_cuda(cm(u), cm(delta), A, B, C, D, cm(z), db, pos, True, saved, cm(dout), True)
    layout = cm(u).stride()
    assert out.stride() == layout and torch.equal(out, want_out) and torch.equal(saved, want_saved)
    for name, g, w in zip(GRAD_NAMES + ["out"], got, want):
        if name in ("du", "ddelta", "dz", "out"):
            assert g.stride() == layout and torch.equal(g, w), name
        else:
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("dtype,batch,L,pieces", [(torch.float32, 1, 3 * 64 + 37, 4), (torch.bfloat16, 1, 3 * 64 + 37, 4),
                                                  (torch.float32, 2, 4 * 64, 2)],
                         ids=["fp32-tail", "bf16-tail", "fp32-two-rows"])
def test_cut_along_time_on_emulated_kernels(cuda_path_on_cpu, monkeypatch, seed, dtype, batch, L, pieces):
    """Rows of one sequence cut along time (ops/time_split.py) through the CUDA path's Python side on the kernels'
    own code: the pieces, each continued from the state the reductions give it (their torch references here), with
    the layout chosen for the pieces, reproduce the uncut output and every gradient (the backward's pieces start
    from the forward's saved chunk states, their ends take the gradients of the pieces after them)."""
    from ops.boundaries import shared_row_positions, single_sequence_rows

    ssi = cuda_path_on_cpu
    dim, dstate, piece = 40, 16, 64 * (-(-L // (64 * pieces)))
    u = torch.randn(batch, dim, L).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, L) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    B, C = torch.randn(batch, dstate, L).to(dtype), torch.randn(batch, dstate, L).to(dtype)
    D, z, db = torch.randn(dim), torch.randn(batch, dim, L).to(dtype), 0.5 * torch.randn(dim)
    pos = shared_row_positions(batch, L, "cpu")
    dout = torch.randn(batch, dim, L).to(dtype)

    def run():
        out, saved, _ = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True)
        return (out,) + tuple(ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, saved, dout, True)[:9])

    whole = run()   # on the CPU the interface never cuts: the uncut kernels
    calls = []

    def cut(which, u_, pos_, B_, slots):
        calls.append(which)
        return (-(-L // piece), piece) if slots is None and single_sequence_rows(pos_) else None

    monkeypatch.setattr(ssi, "_time_split", cut)
    got = run()
    assert calls == ["fwd", "bwd"]
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    for name, a, b in zip(["out"] + GRAD_NAMES + ["out recomputed"], got, whole):
        assert not a.float().isnan().any(), name
        err = ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
        assert err <= tol, (name, err)
    # the check can fail: pieces from zero states differ
    monkeypatch.setattr(ssi.time_split, "piece_prefix", lambda forward, s, d, A_: torch.zeros_like(s))
    assert (run()[0].float() - whole[0].float()).abs().max() > 1e-2


# ---------------------------------------------------------------------------------------------------------------
# segments: a row cut at sequence starts into segments run side by side (ops/contract.py, scan_segments)

def segment_bounds_twin(pos_row: list, segments: int) -> list:
    """selective_scan.cu's segment_bound in Python: segment k of K starts at the first sequence start at or after
    k L / K (0 for the first; L where there is none) and ends where the next one starts."""
    L = len(pos_row)

    def bound(k):
        if k <= 0:
            return 0
        if k >= segments:
            return L
        return next((t for t in range(k * L // segments, L) if pos_row[t] == 0), L)

    return [(bound(k), bound(k + 1)) for k in range(segments)]


def segment_rows(L: int) -> list:
    """Rows that put sequence starts on, just before and just after the places a row is cut (L / K), one long
    sequence (later segments empty), padding, length 1 and runs of length-1 sequences."""
    quarter = L // 4
    return [
        lengths_mix(L, "mixed"),
        [L],                                            # one sequence: one segment does it all
        [quarter, quarter - 1, 1, L - 2 * quarter],     # starts on a cut, one before a cut, one after it
        lengths_mix(L, "tiny"),
        [3, L - 3],                                     # a cut inside a long sequence: the next segments are empty
        lengths_mix(L, "padded"),
    ]


@pytest.mark.parametrize("lanes", [1, 8], ids=lambda k: f"lanes{k}")
@pytest.mark.parametrize("segments", [2, 3, 8], ids=lambda k: f"seg{k}")
@pytest.mark.parametrize("dtype,L", [(torch.float32, 203), (torch.bfloat16, 256)], ids=["fp32-L203", "bf16-L256"])
def test_emulated_segments_give_the_bits_of_one_pass(emulator, seed, lanes, segments, dtype, L):
    """Cut at sequence starts into segments that run side by side, the forward gives one pass's output and saved
    states bit for bit, and so does the backward for everything per timestep (du, ddelta, dz, the recomputed output,
    dB / dC); dA / dD / ddelta_bias, summed per segment, match float64. Rows: starts on and beside the cuts, one long
    sequence (later segments empty), length 1, padding; L not a multiple of the runs (8) or chunks (64)."""
    dim, dstate = 40, 16
    rows = segment_rows(L)
    batch = len(rows)
    pos = position_ids_for(rows, "cpu").int().contiguous()
    for r in range(batch):   # the twin's cuts fall where the rows were built to put them
        bounds = segment_bounds_twin(pos[r].tolist(), segments)
        assert bounds[0][0] == 0 and bounds[-1][1] == L
        assert all(a[1] == b[0] for a, b in zip(bounds[:-1], bounds[1:]))
        assert all(lo == hi or pos[r, lo] == 0 for lo, hi in bounds)
    u = torch.randn(batch, dim, L).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, L) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    B, C = torch.randn(batch, 1, dstate, L).to(dtype), torch.randn(batch, 1, dstate, L).to(dtype)
    z = torch.randn(batch, dim, L).to(dtype)
    inputs = (u, delta, A, B, C, torch.randn(dim), z, 0.5 * torch.randn(dim))
    emulator.emu_set_fwd_lanes(lanes)
    try:
        out1, saved1 = run_emulated(emulator, *inputs, pos, True)
        out, saved = run_emulated(emulator, *inputs, pos, True, segments=segments)
    finally:
        emulator.emu_set_fwd_lanes(0)
    assert torch.equal(out, out1) and torch.equal(saved, saved1)
    dout = torch.randn_like(out)
    rec1, grads1 = run_emulated_bwd(emulator, inputs, pos, True, saved1, dout)
    rec, grads = run_emulated_bwd(emulator, inputs, pos, True, saved, dout, segments=segments)
    assert torch.equal(rec, out1)
    _, _, ref_grads = scan_ref_grads(inputs, pos, True, dout)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-3}[dtype]
    for name, g, g1, rg in zip(GRAD_NAMES, grads, grads1, ref_grads):
        if name in ("du", "ddelta", "dz"):
            assert torch.equal(g, g1), name
        elif name in ("dB", "dC"):   # float atomics over the channel blocks: any order
            torch.testing.assert_close(g, g1, rtol=1e-5, atol=1e-5, msg=name)
        assert not g.isnan().any(), name
        assert kernel_err(g, rg) <= tol, (name, kernel_err(g, rg))


def test_emulated_segments_keep_inf_in_its_sequence(emulator):
    """An inf in one sequence stays there when the row runs as segments: a segment starting after it, or computing
    the tail of the sequence before its own start, sees none of it (forward and backward)."""
    batch, dim, dstate, L = 1, 32, 16, 128
    rows = [[40, 30, 58]]
    pos = position_ids_for(rows, "cpu").int().contiguous()
    u = torch.randn(batch, dim, L)
    u[..., 20] = float("inf")   # in the first sequence, [0, 40)
    delta = 0.5 * torch.randn(batch, dim, L) - 1.0
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    B, C = torch.randn(batch, 1, dstate, L), torch.randn(batch, 1, dstate, L)
    inputs = (u, delta, A, B, C, torch.randn(dim), None, 0.5 * torch.randn(dim))
    for segments in (2, 4):   # cuts at 64 (inside the third sequence) and at 32, 64, 96
        out, saved = run_emulated(emulator, *inputs, pos, True, segments=segments)
        assert torch.isfinite(out[..., 40:]).all(), segments
        dout = torch.randn_like(out)
        _, grads = run_emulated_bwd(emulator, inputs, pos, True, saved, dout, segments=segments)
        du, ddelta, dB = grads[0], grads[1], grads[3]
        assert torch.isfinite(du[..., 40:]).all() and torch.isfinite(ddelta[..., 40:]).all(), segments
        assert torch.isfinite(dB[..., 40:]).all(), segments


def test_cuda_path_plans_segments_and_sums_their_rows(cuda_path_on_cpu, monkeypatch, seed):
    """The Python side with segments planned (as on a GPU with few channels): dA / dD / ddelta_bias come in
    batch x segments rows and are summed, the deterministic mode too; the results are those of one pass."""
    ssi = cuda_path_on_cpu
    batch, dim, dstate, L, dtype = 2, 32, 16, 160, torch.float32
    u = torch.randn(batch, dim, L).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, L) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    B, C = torch.randn(batch, dstate, L), torch.randn(batch, dstate, L)
    D, z, db = torch.randn(dim), torch.randn(batch, dim, L).to(dtype), 0.5 * torch.randn(dim)
    pos = position_ids_for([lengths_mix(L, "mixed"), lengths_mix(L, "tiny")], "cpu")
    dout = torch.randn(batch, dim, L).to(dtype)
    out1, saved1, _ = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True)
    one = ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, saved1, dout, True)
    monkeypatch.setattr(ssi, "scan_fwd_segments", lambda *a: 4)
    monkeypatch.setattr(ssi, "scan_bwd_segments", lambda *a: 3)
    out, saved, _ = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True)
    assert torch.equal(out, out1) and torch.equal(saved, saved1)
    cut = ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, saved, dout, True)
    det = twice_deterministic(lambda: ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, saved, dout, True))
    for name, a, b, c, d in zip(GRAD_NAMES + ["out"], one, cut, det[0], det[1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(c, d), name
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5, msg=name)


def test_scan_segment_plan():
    """ops.contract's plan: no segments where the grid fills the GPU; powers of two up to the warps (forward) or
    blocks (backward) it aims at, none planned shorter than SCAN_MIN_SEGMENT."""
    from ops.contract import SCAN_MIN_SEGMENT, scan_bwd_segments, scan_fwd_segments

    assert scan_fwd_segments(8, 4096, 4096, 132) == 1 and scan_bwd_segments(8, 4096, 4096, 132) == 1
    assert scan_fwd_segments(2, 5120, 4096, 132) == 4        # 320 warps -> 1280 against 924
    assert scan_bwd_segments(2, 5120, 4096, 132) == 2        # 640 blocks -> 1280 against 792
    assert scan_fwd_segments(1, 1024, 2048, 132) == 8        # capped: 8 segments of 256
    assert scan_fwd_segments(1, 1024, 300, 132) == 1         # too short to cut
    for batch, dim, L in ((1, 32, 4096), (2, 768, 1024), (4, 1536, 2048), (3, 2560, 511)):
        for k in (scan_fwd_segments(batch, dim, L, 132), scan_bwd_segments(batch, dim, L, 132)):
            assert k & (k - 1) == 0 and (k == 1 or L // k >= SCAN_MIN_SEGMENT)


# ---------------------------------------------------------------------------------------------------------------
# causal conv1d: the layouts and dtypes ops.packed_causal_conv1d takes (issue: "every combination causal-conv1d
# accepts"), through ops.conv1d_interface's CUDA path on the emulated kernels

def conv_input(layout: str, batch: int, dim: int, L: int, dtype) -> torch.Tensor:
    """x (batch, dim, L) in a memory layout: channel-first "cf", channel-last "cl", "padded" (a slice of a wider
    channel-last buffer: strides the kernels do not take, copied by the op), "cl-slice" (timesteps 2 .. L + 1 of longer
    channel-last rows), "misaligned-cf" / "misaligned-cl" (dense, data starting one element past an aligned address)."""
    v = torch.randn(batch, dim, L).to(dtype)
    if layout == "cf":
        return v
    if layout == "cl":
        return v.transpose(1, 2).contiguous().transpose(1, 2)
    if layout == "padded":
        buf = torch.zeros(batch, L, dim + 64, dtype=dtype)
        buf[..., :dim] = v.transpose(1, 2)
        return buf[..., :dim].transpose(1, 2)
    if layout == "cl-slice":   # dense channel-last for batch 1 (any batch stride), copied for more rows
        buf = torch.zeros(batch, L + 5, dim, dtype=dtype)
        buf[:, 2:2 + L] = v.transpose(1, 2)
        return buf[:, 2:2 + L].transpose(1, 2)
    return misaligned_copy(v, transpose=layout == "misaligned-cl")


CONV_LAYOUTS = ["cf", "cl", "padded", "cl-slice", "misaligned-cf", "misaligned-cl"]
# odd dim and L; the vector kernels' sizes (two channel-last blocks along time, the second part full); batch 1
CONV_SHAPES = [(2, 37, 67), (2, 64, 320), (1, 24, 136)]
CONV_CASES = [(dtype, layout, CONV_SHAPES[i % 3], 2 + i % 3, ["cf", "cl", "padded"][i % 3 - 1],
               torch.float32 if i % 2 else dtype)
              for i, (dtype, layout) in enumerate((d, lay) for d in (torch.float32, torch.float16, torch.bfloat16)
                                                  for lay in CONV_LAYOUTS)]


@pytest.mark.parametrize("dtype,layout,shape,width,dout_layout,wdtype", CONV_CASES,
                         ids=[f"{str(c[0])[6:]}-{c[1]}-{'x'.join(map(str, c[2]))}-w{c[3]}-g{c[4]}-{str(c[5])[6:]}"
                              for c in CONV_CASES])
def test_conv_layouts_on_emulated_kernels(cuda_path_on_cpu, seed, dtype, layout, shape, width, dout_layout, wdtype):
    """Every layout of x and of the incoming gradient, every dtype of x with fp32 or x-dtype weights, widths 2-4,
    sequences shorter than the width, batch 1, odd dim and L: the CUDA path (its copies to a layout a kernel takes,
    the kernel each picks) against float64, and no access the GPU would fault on."""
    from ops import conv1d_interface as ci

    batch, dim, L = shape
    x = conv_input(layout, batch, dim, L, dtype)
    weight, bias = (0.5 * torch.randn(dim, width)).to(wdtype), torch.randn(dim).to(wdtype)
    rows = [lengths_mix(L, kind) for kind in ("tiny", "padded", "mixed")[:batch]]
    pos = position_ids_for(rows, "cpu")
    xk = ci.kernel_layout(x)
    out = ci._conv_fwd_cuda(xk, weight, bias, pos, True)
    assert out.stride() == xk.stride()
    dout = conv_input(dout_layout, batch, dim, L, dtype)
    dx, dweight, dbias = ci._conv_bwd_cuda(xk, weight, bias, pos, True, dout)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, weight, bias)]
    ref = conv_ref64(leaves[0], leaves[1], leaves[2], pos, "silu")
    ref.backward(dout.double())
    tol = TOL[dtype]
    assert kernel_err(out, ref) <= tol, kernel_err(out, ref)
    assert kernel_err(dx, leaves[0].grad) <= tol, kernel_err(dx, leaves[0].grad)
    wtol = TOL[wdtype]   # dweight / dbias come in the weights' dtype
    assert kernel_err(dweight, leaves[1].grad) <= wtol and kernel_err(dbias, leaves[2].grad) <= wtol
    for name, got, want in (("out", out, ref), ("dx", dx, leaves[0].grad), ("dweight", dweight, leaves[1].grad),
                            ("dbias", dbias, leaves[2].grad)):
        assert_elementwise(got, want, name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["cf", "cl", "misaligned-cf"])
@pytest.mark.parametrize("L", [136, 1032])
def test_conv_without_activation_on_emulated_kernels(cuda_path_on_cpu, seed, layout, dtype, L):
    """activation=None on each kernel family (channel-first vector, channel-last, channel-first register) against
    float64. The vector and channel-last backward kernels take silu as a compile-time switch, so their instantiations
    without it need their own check (the vector kernels: one run a thread up to 1024 steps, two beyond)."""
    from ops import conv1d_interface as ci

    batch, dim = 2, 12
    x = conv_input(layout, batch, dim, L, dtype)
    weight, bias = 0.5 * torch.randn(dim, 4), torch.randn(dim)
    pos = position_ids_for([lengths_mix(L, kind) for kind in ("tiny", "mixed")], "cpu")
    xk = ci.kernel_layout(x)
    out = ci._conv_fwd_cuda(xk, weight, bias, pos, False)
    dout = conv_input("cf", batch, dim, L, dtype)
    dx, dweight, dbias = ci._conv_bwd_cuda(xk, weight, bias, pos, False, dout)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, weight, bias)]
    ref = conv_ref64(leaves[0], leaves[1], leaves[2], pos, None)
    ref.backward(dout.double())
    for name, got, want, tol in (("out", out, ref, TOL[dtype]), ("dx", dx, leaves[0].grad, TOL[dtype]),
                                 ("dweight", dweight, leaves[1].grad, TOL[torch.float32]),
                                 ("dbias", dbias, leaves[2].grad, TOL[torch.float32])):
        assert kernel_err(got, want) <= tol, (name, kernel_err(got, want))
        assert_elementwise(got, want, name)


@pytest.mark.parametrize("silu", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("L,tiles", [(4104, 3), (6152, 2)])
def test_conv_backward_tile_sizes_on_long_rows(cuda_path_on_cpu, monkeypatch, seed, dtype, silu, L, tiles):
    """Rows longer than 4096 steps: the channel-first backward takes 4096-step tiles (4 runs a thread) where the
    last one is more than half full (6152 steps: 4096 + 2056), else 2048-step tiles (4104 steps: 2048 + 2048 + 8).
    One dweight slot per tile and row; sequence starts at and next to every tile edge; every gradient against
    float64."""
    from ops import conv1d_interface as ci

    slots = []
    conv_bwd = EmulatedExt.conv_bwd
    monkeypatch.setattr(EmulatedExt, "conv_bwd", lambda self, *a: slots.append(conv_bwd(self, *a)) or slots[-1])
    batch, dim = 2, 2
    x = conv_input("cf", batch, dim, L, dtype)
    weight, bias = 0.5 * torch.randn(dim, 4), torch.randn(dim)
    pos = position_ids_for([tile_edge_row(L), lengths_mix(L, "mixed")], "cpu")   # starts at every tile edge
    dout = torch.randn(batch, dim, L).to(dtype)
    dx, dweight, dbias = ci._conv_bwd_cuda(ci.kernel_layout(x), weight, bias, pos, silu, dout)
    assert slots == [batch * tiles], slots
    leaves = [t.detach().double().requires_grad_(True) for t in (x, weight, bias)]
    conv_ref64(leaves[0], leaves[1], leaves[2], pos, "silu" if silu else None).backward(dout.double())
    for name, got, want, tol in (("dx", dx, leaves[0].grad, TOL[dtype]),
                                 ("dweight", dweight, leaves[1].grad, TOL[torch.float32]),
                                 ("dbias", dbias, leaves[2].grad, TOL[torch.float32])):
        assert kernel_err(got, want) <= tol, (name, kernel_err(got, want))
        assert_elementwise(got, want, name)


@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_conv_dweight_sums_many_slots_in_a_fixed_order(cuda_path_on_cpu, monkeypatch, seed, layout):
    """The backward's dweight / dbias: more block slots than the sum kernel loads at once (8), no bias, and the same
    bits on a second run (the slots are added in slot order, no atomics)."""
    from ops import conv1d_interface as ci
    from ops.contract import CONV_SLOT_STEPS

    slots = []
    conv_bwd = EmulatedExt.conv_bwd
    monkeypatch.setattr(EmulatedExt, "conv_bwd", lambda self, *a: slots.append(conv_bwd(self, *a)) or slots[-1])
    # channel-first: one slot per row and 2048-step tile (9 rows); channel-last: one per 128 steps of a row
    batch, dim, L, width = (9, 5, 1168, 4) if layout == "cf" else (3, 5, 9 * CONV_SLOT_STEPS + 16, 4)
    x = ci.kernel_layout(conv_input(layout, batch, dim, L, torch.float32))
    weight = 0.5 * torch.randn(dim, width)
    pos = position_ids_for([lengths_mix(L, "mixed") for _ in range(batch)], "cpu")
    dout = torch.randn(batch, dim, L)
    dx, dweight, dbias = ci._conv_bwd_cuda(x, weight, None, pos, True, dout)
    assert dbias.numel() == 0 and dweight.shape == (dim, width)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, weight)]
    conv_ref64(leaves[0], leaves[1], None, pos, "silu").backward(dout.double())
    assert kernel_err(dweight, leaves[1].grad) <= TOL[torch.float32], kernel_err(dweight, leaves[1].grad)
    assert kernel_err(dx, leaves[0].grad) <= TOL[torch.float32]
    again = ci._conv_bwd_cuda(x, weight, None, pos, True, dout)
    assert torch.equal(again[0], dx) and torch.equal(again[1], dweight)
    assert slots[0] > 8, slots


def runmask_twin(pos_row: list, seqlen: int) -> list:
    """Pure-Python twin of the conv's boundary words (ops/contract.py, conv_runmask): bit i of word r is set when
    token 8r - 4 + i starts a sequence or lies outside the row."""
    words = []
    for r in range(-(-seqlen // 8)):
        m = 0
        for i in range(16):
            t = 8 * r - 4 + i
            if t <= 0 or t >= seqlen or pos_row[t] == 0:
                m |= 1 << i
        words.append(m - (1 << 16) if m >= 1 << 15 else m)
    return words + [0] * (conv_mask_stride(seqlen) - len(words))


@pytest.mark.parametrize("seqlen", [1, 3, 8, 9, 67, 136, 320])
def test_conv_runmask_kernel_reference_and_twin_agree(emulator, seed, seqlen):
    """The boundary words three ways: the CUDA kernel (emulated), the op's reference (torch) and a Python twin, on
    rows with length-1 sequences, sequences shorter than a run and one sequence a row; every word of the padded row
    is written (the words past the last run are 0)."""
    from ops import conv1d_interface as ci

    rows = [lengths_mix(seqlen, kind) for kind in ("tiny", "mixed", "one")]
    pos = position_ids_for(rows, "cpu").to(torch.int32)
    got = EmulatedExt(emulator).conv_runmask(pos)
    ref = ci._runmask_reference(pos)
    assert got.shape == ref.shape == (3, conv_mask_stride(seqlen))
    assert torch.equal(got, ref)
    for b in range(3):
        assert got[b].tolist() == runmask_twin(pos[b].tolist(), seqlen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_with_a_given_runmask_gives_the_same_bits(cuda_path_on_cpu, seed, dtype):
    """A forward and its backward handed conv_runmask's words (made once) give the bits of the ops that make them
    themselves; the channel-last kernels, which read position_ids, ignore them."""
    from ops import conv1d_interface as ci

    batch, dim, L, width = 2, 16, 320, 4
    pos = position_ids_for([lengths_mix(L, kind) for kind in ("tiny", "mixed")], "cpu").to(torch.int32)
    runmask = ci._conv_runmask_cuda(pos)
    assert torch.equal(runmask, ci._runmask_reference(pos))
    weight, bias = 0.5 * torch.randn(dim, width), torch.randn(dim)
    dout = torch.randn(batch, dim, L).to(dtype)
    for layout in ("cf", "cl"):
        x = ci.kernel_layout(conv_input(layout, batch, dim, L, dtype))
        if layout == "cf":   # the kernels that read the words: a wrong word must change the output
            wrong = runmask.clone()
            wrong[:, 1:20] = 0
            assert not torch.equal(ci._conv_fwd_cuda(x, weight, bias, pos, True, wrong),
                                   ci._conv_fwd_cuda(x, weight, bias, pos, True))
        with_mask = (ci._conv_fwd_cuda(x, weight, bias, pos, True, runmask),
                     *ci._conv_bwd_cuda(x, weight, bias, pos, True, dout, runmask))
        without = (ci._conv_fwd_cuda(x, weight, bias, pos, True),
                   *ci._conv_bwd_cuda(x, weight, bias, pos, True, dout))
        for a, b in zip(with_mask, without):
            assert torch.equal(a, b)


# ---- carried states (state_slots / initial_state / final_state): the kernels against the float64 reference ----------

def random_state_slots(pos: torch.Tensor, p_init: float = 0.6):
    """ops.states.state_slots for random flags, every sequence's final state asked for; (slots, number of sequences)."""
    from ops.states import state_slots
    count = int((pos == 0).sum())
    has = torch.rand(count) < p_init
    return state_slots(pos, has, True), count


@pytest.mark.parametrize("dtype,segments", [(torch.float32, 1), (torch.bfloat16, 4)], ids=["fp32-whole",
                                                                                        "bf16-segments4"])
def test_emulated_states_match_float64(cuda_path_on_cpu, fwd_lanes, monkeypatch, seed, dtype, segments):
    """The kernels with initial and final states (length-1 sequences, starts at run and chunk edges, rows cut into
    segments) against the float64 reference: the output, the final states, every gradient including the initial
    states', with a gradient flowing into the final states; and the same bits as the plain kernels where no
    sequence starts from a state."""
    ssi = cuda_path_on_cpu
    monkeypatch.setattr(ssi, "scan_fwd_segments", lambda *a: segments)
    monkeypatch.setattr(ssi, "scan_bwd_segments", lambda *a: segments)
    batch, dim, dstate, L = 2, 24, 13, 140   # 12 channels a group: the group-by-group launches
    u = torch.randn(batch, dim, L).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, L) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    B, C = torch.randn(batch, 2, dstate, L).to(dtype), torch.randn(batch, 2, dstate, L).to(dtype)
    D, z, db = torch.randn(dim), torch.randn(batch, dim, L).to(dtype), 0.5 * torch.randn(dim)
    rows = [[64, 1, 7, 56, 1, 1, 10], [8, 60, 3, 2, 67]]
    pos = position_ids_for(rows, "cpu").int().contiguous()
    slots, count = random_state_slots(pos)
    h0 = torch.randn(count, dim, dstate)
    out, saved, final = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True, slots, h0, count)
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    args64 = [f64(t) for t in (u, delta, A, B, C, D, z, db)]
    ref_out, _, ref_final = ssi._scan_fwd_reference(*args64, pos, True, slots, h0.double(), count)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-3}[dtype]
    assert kernel_err(out, ref_out) <= tol
    assert kernel_err(final, ref_final) <= 1e-5 and final.dtype == torch.float32
    dout, dfinal = torch.randn_like(out), torch.randn(count, dim, dstate)
    grads = ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, saved, dout, True, slots, h0, dfinal)
    ref = ssi._scan_bwd_reference(*args64, pos, True, saved, dout.double(), True, slots, h0.double(),
                                  dfinal.double())
    for name, g, rg in zip(GRAD_NAMES + ["out", "dinitial_state"], grads, ref):
        assert not g.isnan().any(), name
        assert kernel_err(g, rg) <= (1e-5 if name == "dinitial_state" and dtype == torch.float32 else tol), (
            name, kernel_err(g, rg))
    assert torch.equal(grads[8], out)   # the recomputed output is the forward's, with states too
    # no sequence starts from a state: the bits of the plain kernels (the states variant adds no arithmetic)
    none = torch.stack([torch.full_like(slots[0], -1), slots[1]])
    out_plain, saved_plain, _ = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True)
    out_none, saved_none, _ = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True, none, h0, count)
    assert torch.equal(out_none, out_plain) and torch.equal(saved_none, saved_plain)


@pytest.mark.parametrize("layout", ["dense", "one-slot-a-sub-chunk"])
def test_emulated_states_in_every_sub_chunk(cuda_path_on_cpu, seed, layout):
    """The backward handles a slot in a sub-chunk of 16 steps apart from the plain code (a rolled path for only the
    sub-chunks that hold one): slots at every sub-chunk position of a chunk, at a sub-chunk's first and last step,
    several in one sub-chunk, or one alone among plain sub-chunks; every gradient against float64 (fp32, 1e-5)."""
    ssi = cuda_path_on_cpu
    batch, dim, dstate, L = 2, 16, 16, 192
    if layout == "dense":   # short sequences: starts and ends in every sub-chunk of every chunk
        rows = [[], []]
        for r in rows:
            while sum(r) < L:
                r.append(min(int(torch.randint(1, 24, ())), L - sum(r)))
    else:   # one continued sequence starting at sub-chunk k of chunk k (k = 1, 2), nothing else in its sub-chunk
        rows = [[16 + 64, L - 80], [32 + 128, L - 160]]
    pos = position_ids_for(rows, "cpu").int().contiguous()
    count = int((pos == 0).sum())
    from ops.states import state_slots
    has = torch.rand(count) < 0.6 if layout == "dense" else torch.tensor([False, True] * (count // 2))
    slots = state_slots(pos, has, layout == "dense")
    if layout == "dense":   # every sub-chunk position of a chunk holds a slot somewhere
        at = ((slots[0] >= 0) | (slots[1] >= 0)).nonzero()[:, 1]
        assert set((at % 64 // 16).tolist()) == {0, 1, 2, 3}
    u = torch.randn(batch, dim, L)
    delta = 0.5 * torch.randn(batch, dim, L) - 1.0
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    B, C = torch.randn(batch, dstate, L), torch.randn(batch, dstate, L)
    D, z, db = torch.randn(dim), torch.randn(batch, dim, L), 0.5 * torch.randn(dim)
    h0 = torch.randn(count, dim, dstate)
    num_final = count if layout == "dense" else 0
    out, saved, _ = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True, slots, h0, num_final)
    dout = torch.randn_like(out)
    dfinal = torch.randn(count, dim, dstate) if layout == "dense" else None
    grads = ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, saved, dout, True, slots, h0, dfinal)
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    ref = ssi._scan_bwd_reference(*[f64(t) for t in (u, delta, A, B, C, D, z, db)], pos, True, saved,
                                  dout.double(), True, slots, h0.double(), f64(dfinal))
    for name, g, rg in zip(GRAD_NAMES + ["out", "dinitial_state"], grads, ref):
        assert kernel_err(g, rg) <= 1e-5, (name, kernel_err(g, rg))
    assert torch.equal(grads[8], out)


@pytest.mark.parametrize("dtype,segments,L", [(torch.float32, 1, 150), (torch.float32, 3, 128),
                                              (torch.bfloat16, 4, 97), (torch.float32, 1, 1)],
                         ids=["fp32-150", "fp32-segments3-128", "bf16-segments4-97", "fp32-length1"])
def test_emulated_row_edge_states(cuda_path_on_cpu, fwd_lanes, monkeypatch, seed, dtype, segments, L):
    """Row-edge slots ((2, batch): context parallelism's chunks) run the plain kernels, which load a row's initial
    state before its first token and store its final state after its last: the output, saved states, final states
    and every gradient (the initial states', with a gradient into the final states) equal those of the same states
    given per token (the states variant) and the float64 reference; rows of one sequence and packed rows, lengths
    past and at a chunk's end, rows cut into segments, rows without an initial or a final state; and the bits of the
    plain kernels where no row has one."""
    ssi = cuda_path_on_cpu
    from ops.states import token_slots
    monkeypatch.setattr(ssi, "scan_fwd_segments", lambda *a: segments)
    monkeypatch.setattr(ssi, "scan_bwd_segments", lambda *a: segments)
    batch, dim, dstate = 4, 24, 13
    rows = [[L]] * 4 if L < 8 else [[L], [5, 1, 60, L - 66], [L - 3, 3], [1, L - 1]]
    pos = position_ids_for(rows, "cpu").int().contiguous()
    u = torch.randn(batch, dim, L).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, L) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    B, C = torch.randn(batch, 2, dstate, L).to(dtype), torch.randn(batch, 2, dstate, L).to(dtype)
    D, z, db = torch.randn(dim), torch.randn(batch, dim, L).to(dtype), 0.5 * torch.randn(dim)
    # row 0: both states; row 1: an initial state only; row 2: a final state only; row 3: both (slots crossed)
    edges = torch.tensor([[2, 0, -1, 1], [0, -1, 2, 1]], dtype=torch.int32)
    per_token = token_slots(edges, L).contiguous()
    assert per_token.shape == (2, batch, L) and int((per_token >= 0).sum()) == int((edges >= 0).sum())
    h0, dfinal = torch.randn(4, dim, dstate), torch.randn(4, dim, dstate)   # slot 3: no row's
    got = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True, edges, h0, 4)
    want = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True, per_token, h0, 4)
    f64 = lambda t: None if t is None else t.double()  # noqa: E731
    args64 = [f64(t) for t in (u, delta, A, B, C, D, z, db)]
    ref = ssi._scan_fwd_reference(*args64, pos, True, edges, h0.double(), 4)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-3}[dtype]
    for name, g, w, r in zip(["out", "saved", "final_state"], got, want, ref):
        assert torch.equal(g, w), name   # the same arithmetic in the same order as the states variant
        assert kernel_err(g, r) <= (tol if name == "out" else 1e-5), (name, kernel_err(g, r))
    out, saved, final = got
    assert torch.equal(final[3], torch.zeros_like(final[3])) and bool((final[:3] != 0).all())
    dout = torch.randn_like(out)
    for dfin in (dfinal, None):
        grads = ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, saved, dout, True, edges, h0, dfin)
        grads_tok = ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, saved, dout, True, per_token, h0,
                                       dfin)
        ref_grads = ssi._scan_bwd_reference(*args64, pos, True, saved, dout.double(), True, edges, h0.double(),
                                            f64(dfin))
        for name, g, gt, rg in zip(GRAD_NAMES + ["out", "dinitial_state"], grads, grads_tok, ref_grads):
            assert not g.isnan().any(), name
            assert kernel_err(g, rg) <= (1e-5 if name == "dinitial_state" and dtype == torch.float32 else tol), (
                name, kernel_err(g, rg))
            if name in ("du", "ddelta", "dz", "out", "dinitial_state", "dA", "dD", "ddelta_bias"):
                torch.testing.assert_close(g, gt, rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(grads[8], out)   # the recomputed output is the forward's
        assert torch.equal(grads[9][3], torch.zeros_like(grads[9][3]))   # slot 3 starts no row: a zero gradient
    # no row has a state: the plain kernels' bits
    none = torch.full_like(edges, -1)
    plain = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True)
    got_none = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True, none, h0, 4)
    assert torch.equal(got_none[0], plain[0]) and torch.equal(got_none[1], plain[1])
    assert torch.equal(got_none[2], torch.zeros_like(got_none[2]))
    # without z (the row-edge variant is compiled for the gated scan only) the slots go per token
    no_z = ssi._scan_fwd_cuda(u, delta, A, B, C, D, None, db, pos, True, edges, h0, 4)
    no_z_tok = ssi._scan_fwd_cuda(u, delta, A, B, C, D, None, db, pos, True, per_token, h0, 4)
    assert all(torch.equal(a, b) for a, b in zip(no_z, no_z_tok))


def test_emulated_states_in_deterministic_mode(cuda_path_on_cpu, seed):
    """The backward with carried states in deterministic mode (dB / dC per block, no atomics): the same bits twice,
    the initial states' gradient the same bits as in the default mode (stored, never added), the rest equal to it."""
    ssi = cuda_path_on_cpu
    batch, dim, dstate, L = 2, 32, 16, 100
    dtype = torch.bfloat16
    u = torch.randn(batch, dim, L).to(dtype)
    delta = (0.5 * torch.randn(batch, dim, L) - 1.0).to(dtype)
    A = -torch.exp(0.5 * torch.randn(dim, dstate))
    B, C = torch.randn(batch, dstate, L).to(dtype), torch.randn(batch, dstate, L).to(dtype)
    D, z, db = torch.randn(dim), torch.randn(batch, dim, L).to(dtype), 0.5 * torch.randn(dim)
    pos = position_ids_for([[30, 1, 69], [100]], "cpu").int().contiguous()
    slots, count = random_state_slots(pos, p_init=1.0)
    h0, dfinal = torch.randn(count, dim, dstate), torch.randn(count, dim, dstate)
    out, saved, _ = ssi._scan_fwd_cuda(u, delta, A, B, C, D, z, db, pos, True, slots, h0, count)
    dout = torch.randn_like(out)
    run = lambda: ssi._scan_bwd_cuda(u, delta, A, B, C, D, z, db, pos, True, saved, dout, False, slots, h0,  # noqa
                                     dfinal)
    default = run()
    det = twice_deterministic(run)
    for name, a, b, c in zip(GRAD_NAMES + ["out", "dinitial_state"], det[0], det[1], default):
        assert torch.equal(a, b), name
        torch.testing.assert_close(a.float(), c.float(), rtol=2e-2, atol=2e-2, msg=name)
    assert torch.equal(det[0][9], default[9])


# ---------------------------------------------------------------------------------------------------------------
# the conv's carried states (conv_states.cu), through ops.conv1d_interface's CUDA path on the emulated kernels

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("layout,out_layout", [("cf", "cf"), ("cl", "cl"), ("cl-slice", "padded"),
                                               ("misaligned-cf", "misaligned-cl")])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_conv_states_on_emulated_kernels(cuda_path_on_cpu, seed, dtype, layout, out_layout, width):
    """The conv's carried-state fix-up, forward and backward, against its reference (the same op run in float64):
    sequences of length 1 and shorter than the width, one a whole row, sequences with and without a state, every
    layout of x and of the output / gradient it fixes up, widths 2-4, with and without silu and bias. The fix-up
    touches only the continued sequences' first width - 1 tokens (elsewhere the output is unchanged, bit for bit),
    and the backward zeroes the gradient exactly there."""
    from ops import conv1d_interface as ci

    batch, dim, L = 2, 37, 20
    k = width - 1
    x = conv_input(layout, batch, dim, L, dtype)
    # flat spans: row 0 [1 | 2 | 5 | 12], row 1 [20]
    start, length = torch.tensor([0, 1, 3, 8, 20]), torch.tensor([1, 2, 5, 12, 20])
    has = torch.tensor([True, True, False, True, True])
    init = torch.randn(5, dim, k).to(dtype)
    for silu, with_bias in ((True, True), (False, False)):
        weight = 0.5 * torch.randn(dim, width)
        bias = torch.randn(dim) if with_bias else None
        out = conv_input(out_layout, batch, dim, L, dtype)
        before = out.clone()
        final = ci._conv_states_fwd_cuda(out, x, weight, bias, silu, init, start, length, has)
        want = before.double()
        want_final = ci._conv_states_fwd_reference(want, x.double(), weight.double(), None if bias is None else
                                                   bias.double(), silu, init.double(), start, length, has)
        assert torch.equal(final, want_final.to(dtype))   # copied inputs, bit for bit
        touched = torch.zeros(batch * L, dtype=torch.bool)
        for s, n in zip(start.tolist(), length.tolist()):
            if has[len([t for t in start.tolist() if t < s])]:
                touched[s:s + min(k, n)] = True
        touched = touched.reshape(batch, L)[:, None, :].expand_as(out)
        assert torch.equal(out[~touched], before[~touched])
        assert_elementwise(out[touched], want[touched], "out")
        dout = conv_input(out_layout, batch, dim, L, dtype)
        g = dout.clone()
        dx_head, dweight, dbias, dinit = ci._conv_states_bwd_cuda(dout, x, weight, bias, silu, init, start, length,
                                                                  has, True)
        ref = g.double()
        r_head, r_dw, r_db, r_init = ci._conv_states_bwd_reference(
            ref, x.double(), weight.double(), None if bias is None else bias.double(), silu, init.double(), start,
            length, has, True)
        assert torch.equal(dout, ref.to(dtype)) and bool((dout[touched] == 0).all())
        outs = [t for t in (dx_head, dweight, dbias, dinit) if t.numel()]   # a custom op returns no aliases
        assert len({t.untyped_storage().data_ptr() for t in outs}) == len(outs)
        for name, got, want_t in (("dx_head", dx_head, r_head), ("dweight", dweight, r_dw), ("dinit", dinit, r_init)):
            assert got.dtype == torch.float32
            assert_elementwise(got, want_t, name)
        if with_bias:
            assert_elementwise(dbias, r_db, "dbias")
        else:
            assert dbias.numel() == 0
        _, _, _, none = ci._conv_states_bwd_cuda(g.clone(), x, weight, bias, silu, init, start, length, has, False)
        assert none.numel() == 0


class _Passthrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: what a tracer runs under (the custom ops must run, not direct calls)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["cf", "cl"])
def test_functional_conv_eager_path_on_emulated_kernels(cuda_path_on_cpu, monkeypatch, seed, dtype, layout):
    """ops.packed_causal_conv1d in eager mode on the CUDA kernels runs a plain autograd Function over the CUDA
    implementations (not the custom op's dispatch layers): the kernels' outputs and gradients (x, weight, bias)
    against float64, with position_ids= and boundaries=; a dispatch mode (what a tracer runs under) takes the custom
    op."""
    import ops
    from ops import conv1d_interface as ci

    batch, dim, L, width = 2, 24, 40, 4
    x = conv_input(layout, batch, dim, L, dtype).requires_grad_(True)
    weight, bias = (0.5 * torch.randn(dim, width)).requires_grad_(True), torch.randn(dim).requires_grad_(True)
    pos = position_ids_for([lengths_mix(L, "tiny"), lengths_mix(L, "mixed")], "cpu")
    dout = torch.randn(batch, dim, L).to(dtype)
    leaves = [t.detach().double().requires_grad_(True) for t in (x, weight, bias)]
    ref = conv_ref64(leaves[0], leaves[1], leaves[2], pos, "silu")
    ref.backward(dout.double())
    monkeypatch.setattr(ops.backends, "DIRECT_DEVICE_TYPES", ("cpu",))
    applied = []
    real = ci._ConvEagerFn.apply
    monkeypatch.setattr(ci._ConvEagerFn, "apply", lambda *a: applied.append(1) or real(*a))
    for kw in ({"position_ids": pos}, {"boundaries": ops.PackedBoundaries.resolve(position_ids=pos)}):
        x.grad = weight.grad = bias.grad = None
        out = ops.packed_causal_conv1d(x, weight, bias, "silu", **kw)
        out.backward(dout)
        for name, got, want in (("out", out, ref), ("dx", x.grad, leaves[0].grad),
                                ("dweight", weight.grad, leaves[1].grad), ("dbias", bias.grad, leaves[2].grad)):
            assert_elementwise(got, want, name)
    assert len(applied) == 2

    with _Passthrough():
        ops.packed_causal_conv1d(x.detach(), weight.detach(), bias.detach(), "silu", position_ids=pos)
    assert len(applied) == 2   # the custom op (its reference here), not the eager Function


def _carry_batch(rows):
    """rows: per row, (length, doc_id, piece_index, continues_after) segments -> a batch with the carry keys."""
    pos = torch.stack([torch.cat([torch.arange(s[0]) for s in row]) for row in rows])
    flat = [s for row in rows for s in row]
    return {"position_ids": pos,
            "piece_doc_ids": torch.tensor([s[1] for s in flat], dtype=torch.int64),
            "piece_index": torch.tensor([s[2] for s in flat], dtype=torch.int32),
            "has_initial_state": torch.tensor([s[1] >= 0 and s[2] > 0 for s in flat]),
            "continues_after": torch.tensor([s[3] for s in flat])}


@pytest.mark.parametrize("mixer", ["plain", "carry"])
def test_fused_mixers_call_the_kernels_directly_on_emulated_kernels(cuda_path_on_cpu, monkeypatch, seed, mixer):
    """In plain eager mode the fused mixers (PackedMambaInnerFn; CarriedMambaInnerFn with a chain of pieces over
    three rows, pieces shorter than the conv width) call the kernels' implementations without the custom ops
    (ops.kernel_calls): the emulated kernels then run (counted), and outputs and every gradient match the custom ops'
    path (their float32 reference here); under a dispatch mode the custom ops run again (no kernel call)."""
    import ops
    from ops import backends
    from ops.carry import carried_mamba_inner

    calls = []
    real_ext = backends.load_kernels()

    class Counting:
        def __getattr__(self, name):
            fn = getattr(real_ext, name)
            return lambda *a: calls.append(name) or fn(*a)

    monkeypatch.setattr(backends, "load_kernels", lambda: Counting())
    torch.manual_seed(seed)
    layer = ops.PackedMamba(16, d_state=4, d_conv=4, expand=2, layer_idx=0)
    if mixer == "plain":
        batch = {"position_ids": position_ids_for([lengths_mix(40, "mixed"), lengths_mix(40, "tiny")], "cpu")}
    else:
        batch = _carry_batch([[(2, 5, 0, True), (5, 6, 0, True), (33, -1, 0, False)],
                              [(1, 5, 1, True), (3, 6, 1, True), (36, -1, 0, False)],
                              [(30, 5, 2, False), (10, 6, 2, False)]])
    h = torch.randn(len(batch["position_ids"]), 40, 16, requires_grad=True)
    weights = torch.randn(h.shape)

    def run():
        if mixer == "plain":
            y = layer(h, position_ids=batch["position_ids"])
        else:
            y = carried_mamba_inner(layer, h, batch["position_ids"], ops.CarryStep(batch, ops.StateCache()),
                                    fused=True)
        return [y] + list(torch.autograd.grad((y * weights).sum(), [h] + list(layer.parameters())))

    want = run()
    assert not calls   # CPU tensors: the custom ops (their reference bodies)
    monkeypatch.setattr(ops.backends, "DIRECT_DEVICE_TYPES", ("cpu",))
    got = run()
    expected = {"conv_fwd", "conv_bwd", "scan_fwd", "scan_bwd"} | (
        {"conv_states_fwd", "conv_states_bwd"} if mixer == "carry" else set())
    assert expected <= set(calls), sorted(set(calls))
    names = ["out", "h"] + [n for n, _ in layer.named_parameters()]
    for name, g, w in zip(names, got, want):
        assert_elementwise(g, w, name, floor=1e-4)

    calls.clear()
    with _Passthrough():
        run()
    assert not calls


# --------------------------------------------------------------------------------------------------
# reductions over token segments (segment_sums.cu; ops/time_split.py): the cut along time and the chains of carried
# pieces give each piece its initial state (forward) and its end its gradient (backward) with them

def test_emulated_softplus_matches_float64(emulator):
    """The kernels' softplus (``dtype_utils.cuh``: max(x, 0) + log1p(e^-|x|), log1p by a degree-9 polynomial) against
    float64 over [-40, 40], densest near 0, with the host's exact exponential: within 3e-7 relatively, as float32's
    own log1p(exp(x)) (2e-7; the GPU's exponential adds its own 2^-22 either way). A wrong coefficient or sign fails
    it by orders of magnitude."""
    x = torch.cat([torch.linspace(-40, 40, 400001), torch.logspace(-7, 1, 20001), -torch.logspace(-7, 1, 20001),
                   torch.tensor([0.0, 20.0, 20.5, -20.0, 88.0])]).float().contiguous()
    y = torch.empty_like(x)
    emu_call(emulator, "emu_softplus", ptr(x), ptr(y), ctypes.c_int64(x.numel()))
    ref = torch.nn.functional.softplus(x.double(), threshold=1e30)
    rel = ((y.double() - ref).abs() / ref).max().item()
    assert rel < 3e-7, rel


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_emulated_segment_sums_match_float64(emulator, seed, dtype, parts):
    """The segment reductions against their float64 reference (``segment_sums_ref``), both directions: segments of
    any length anywhere in a row (one token, a partial tile at either end, a whole row, longer than a tile), strided
    inputs (x and z halves of one tensor, B / C a part of another, as the fused mixer has them), dstate below 16,
    with and without z / bias / softplus, bc in float32 or in the inputs' dtype; each segment in one part or cut into
    2 or 3 (segments shorter than the parts leave some empty). fp32 within 1e-5 of the largest sum; bf16 inputs
    (rounded before the reference sees them) within 1e-5 too: the arithmetic is fp32 either way."""
    from ops import time_split as ts
    g = torch.Generator().manual_seed(seed)
    ext = EmulatedExt(emulator)
    ext.parts = parts
    batch, L = 3, 300
    start = torch.tensor([0 * L + 7, 1 * L + 0, 1 * L + 299, 2 * L + 40, 0 * L + 100, 2 * L + 0])
    length = torch.tensor([90, L, 1, 200, 64, 1])
    for dim, dstate, has_bias, softplus, bc_f32 in [(20, 16, True, True, False), (9, 5, False, False, True)]:
        xz = torch.randn(batch, 2 * dim, L, generator=g).to(dtype)
        dbl = torch.randn(batch, L, 2 * dstate + 3, generator=g).transpose(1, 2)
        dbl = dbl if bc_f32 else dbl.to(dtype)
        delta = (torch.randn(batch, dim, L, generator=g) * 0.5 - 1 if softplus
                 else torch.rand(batch, dim, L, generator=g) * 0.05).to(dtype)
        A = -torch.rand(dim, dstate, generator=g) * 4 - 0.05
        bias = torch.randn(dim, generator=g) * 0.3 if has_bias else None
        for forward in (True, False):
            for gated in ((False,) if forward else (True, False)):
                args = (delta, bias, A, xz[:, :dim], xz[:, dim:] if gated else None, dbl[:, 3:3 + dstate], softplus)
                s, d = ts._segment_sums_ext(ext, forward, *args, start, length, L)
                s_r, d_r = ts.segment_sums_ref(forward, *[a.double() if torch.is_tensor(a) else a for a in args],
                                               start, length, L)
                err_s = ((s.double() - s_r).abs().max() / s_r.abs().max()).item()
                err_d = ((d.double() - d_r).abs().max() / d_r.abs().max()).item()
                assert err_s < 1e-5 and err_d < 1e-5, (dim, dstate, forward, gated, err_s, err_d)
    # a check that can fail: a sum over the wrong tokens is far off
    s_bad, _ = ts._segment_sums_ext(ext, True, delta, bias, A, xz[:, :dim], None, dbl[:, 3:3 + dstate], softplus,
                                       start + 1, length, L)
    s_r, _ = ts.segment_sums_ref(True, *[a.double() if torch.is_tensor(a) else a
                                         for a in (delta, bias, A, xz[:, :dim], None, dbl[:, 3:3 + dstate])],
                                 softplus, start, length, L)
    assert ((s_bad.double() - s_r).abs().max() / s_r.abs().max()).item() > 1e-2


def test_segment_sums_follow_the_scans_backend_rule(cuda_path_on_cpu, monkeypatch):
    """``time_split.segment_sums`` runs the kernel where the scan runs its kernels, and the reference under
    ``ops.use_backend("reference")``. Before, it decided by the device alone: on CUDA tensors the carried mixer's
    reference run still ran the compiled reduction (and needed the extension); here, CPU tensors never reached it."""
    import ops
    from ops import backends, time_split as ts
    monkeypatch.setattr(backends, "DIRECT_DEVICE_TYPES", ("cuda", "cpu"))   # the emulated kernels take CPU tensors
    # the fixture's rule, CPU tensors as CUDA ones, with the real rule's override
    monkeypatch.setattr(backends, "implementation",
                        lambda *a, **k: "reference" if backends.get_backend() == "reference" else "cuda")
    calls = []
    real = EmulatedExt.segment_sums
    monkeypatch.setattr(EmulatedExt, "segment_sums", lambda self, *a: (calls.append(1), real(self, *a))[1])
    g = torch.Generator().manual_seed(0)
    batch, dim, dstate, L = 2, 12, 16, 150
    args = (torch.randn(batch, dim, L, generator=g) * 0.5 - 1, torch.randn(dim, generator=g) * 0.3,
            -torch.rand(dim, dstate, generator=g) * 4 - 0.05, torch.randn(batch, dim, L, generator=g), None,
            torch.randn(batch, dstate, L, generator=g), True)
    start, length = torch.tensor([3, L + 20]), torch.tensor([140, 100])
    want, want_dt = ts.segment_sums_ref(True, *args, start, length, 140)
    got, got_dt = ts.segment_sums(True, *args, start, length, 140)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(got_dt, want_dt, rtol=1e-5, atol=1e-6)
    with ops.use_backend("reference"):
        ref, _ = ts.segment_sums(True, *args, start, length, 140)
    assert calls == [1], "the reference backend ran the kernel"
    assert torch.equal(ref, want)
