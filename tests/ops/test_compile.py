"""torch.compile of packed models: no graph breaks, the eager result.

CPU (CI): ``torch._dynamo.explain`` of a tiny ``PackedMamba`` (fused and composed paths) and of a tiny model converted
by ``ops.enable_packing`` (the MambaLMHeadModel mirror of tests/ops/_helpers.py, Mamba-1 and Mamba-2 mixers) counts 0
graph breaks; ``torch.compile(..., backend="aot_eager", fullgraph=True)`` runs forward + backward and matches eager
(float64: the same ops run, so to the last bits or nearly).

GPU (marked ``gpu``): ``torch.compile(PackedMamba, fullgraph=True)`` (inductor) forward + backward against eager under
bf16 autocast, ``mode="reduce-overhead"`` (CUDA graphs), 0 graph breaks, ``torch.library.opcheck`` of the four ops on
CUDA tensors, and a converted mamba-ssm ``MambaLMHeadModel`` compiled with ``fullgraph=True`` (skipped without
mamba_ssm). Tolerance under bf16 autocast: compiled vs eager, relative (||a - b|| / ||b||) 2e-2 on outputs and
gradients: inductor fuses and reorders the elementwise work around the kernels, each bf16 rounding is 4e-3.
"""
from __future__ import annotations

import pytest
import torch

import ops
from ops import PackedMamba, enable_packing

from ._helpers import MambaLMHeadModel, positions

F64 = torch.float64
ROWS = [[1, 5, 2, 4], [12], [3, 3, 3, 3]]  # a length-1 sequence, one sequence per row, shorter than the conv


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def fwd_bwd(fn, inp, params, dout, **kw):
    x = inp.detach().clone().requires_grad_(inp.is_floating_point())
    out = fn(x, **kw)
    wrt = ([x] if x.requires_grad else []) + list(params)
    grads = torch.autograd.grad(out, wrt, dout.to(out.dtype))
    return out.detach(), grads


def assert_same(eager, compiled, rtol, atol):
    (o1, g1), (o2, g2) = eager, compiled
    torch.testing.assert_close(o2, o1, rtol=rtol, atol=atol)
    for i, (a, b) in enumerate(zip(g2, g1)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"gradient {i}: {m}")


# ---------------------------------------------------------------------------------------------------------------
# CPU

@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("fast", [True, False], ids=["fused", "composed"])
def test_packed_mamba_compiles_whole_on_cpu(seed, fast):
    layer = PackedMamba(8, d_state=4, d_conv=4).double()
    layer.use_fast_path = fast
    h = torch.randn(3, 12, 8, dtype=F64)
    pos = positions(ROWS)
    dout = torch.randn(3, 12, 8, dtype=F64)

    def fn(x, position_ids):
        return layer(x, position_ids=position_ids)

    explained = torch._dynamo.explain(fn)(h, pos)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    params = list(layer.parameters())
    assert_same(fwd_bwd(fn, h, params, dout, position_ids=pos), fwd_bwd(compiled, h, params, dout, position_ids=pos),
                rtol=1e-12, atol=1e-12)
    # another length and layout: recompiles (or reuses a dynamic graph), still whole, still the eager result
    pos2 = positions([[2, 7], [9], [1, 1, 7]])
    h2, d2 = torch.randn(3, 9, 8, dtype=F64), torch.randn(3, 9, 8, dtype=F64)
    assert_same(fwd_bwd(fn, h2, params, d2, position_ids=pos2), fwd_bwd(compiled, h2, params, d2, position_ids=pos2),
                rtol=1e-12, atol=1e-12)


def test_converted_model_compiles_whole_on_cpu(seed):
    model = MambaLMHeadModel(d_model=8, n_layer=3, vocab_size=40, mixers=("Mamba1", "Mamba2"), d_state=4).double()
    enable_packing(model)
    ids = torch.randint(0, 40, (3, 12))
    pos = positions(ROWS)
    dout = torch.randn(3, 12, 40, dtype=F64)
    params = list(model.parameters())
    for kw in ({"position_ids": pos}, {"seq_idx": ops.position_ids_to_seq_idx(pos)},
               {"cu_seqlens": ops.position_ids_to_cu_seqlens(pos)[0]}):
        torch._dynamo.reset()

        def fn(input_ids, bounds):
            return model(input_ids, **bounds).logits

        explained = torch._dynamo.explain(fn)(ids, kw)
        assert explained.graph_break_count == 0, (list(kw), explained.break_reasons)
        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        assert_same(fwd_bwd(lambda x: fn(x, kw), ids, params, dout),
                    fwd_bwd(lambda x: compiled(x, kw), ids, params, dout), rtol=1e-12, atol=1e-12)


def test_no_validation_and_no_sync_inside_a_compiled_model(monkeypatch):
    """Inside the compiled region the boundaries are not validated (that needs a host sync): a malformed
    position_ids passes, where eager mode raises. Validate outside the compiled step if the ids are not trusted."""
    layer = PackedMamba(8, d_state=4)
    bad = torch.tensor([[0, 1, 3, 0]])
    h = torch.randn(1, 4, 8)
    with pytest.raises(ops.BoundaryError):
        layer(h, position_ids=bad)
    compiled = torch.compile(lambda x, p: layer(x, position_ids=p), backend="aot_eager", fullgraph=True)
    assert compiled(h, bad).shape == (1, 4, 8)


# ---------------------------------------------------------------------------------------------------------------
# GPU

BF16 = torch.bfloat16
GPU_TOL = 2e-2


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if "cuda" not in ops.available_backends():
        pytest.skip("the CUDA kernels cannot be built here")
    return torch.device("cuda")


def gpu_case(device, d_model=256, batch=2, seqlen=1024):
    torch.manual_seed(0)
    layer = PackedMamba(d_model, device=device)
    lens = [[1, 2, 3, 200, 318, 500], [seqlen], [64] * (seqlen // 64)][:batch]
    pos = positions(lens).to(device)
    h = torch.randn(batch, seqlen, d_model, device=device)
    dout = torch.randn(batch, seqlen, d_model, device=device)
    return layer, h, pos, dout


def autocast_step(fn, layer, h, pos, dout):
    with torch.autocast("cuda", dtype=BF16):
        return fwd_bwd(fn, h, list(layer.parameters()), dout, position_ids=pos)


def assert_close_rel(eager, compiled, tol, what):
    (o1, g1), (o2, g2) = eager, compiled
    errs = {"out": rel(o2, o1)}
    errs.update({f"grad{i}": rel(a, b) for i, (a, b) in enumerate(zip(g2, g1))})
    print(what, {k: f"{v:.1e}" for k, v in errs.items()})
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"{what}: relative error above {tol}: {bad}"


@pytest.mark.gpu
def test_gpu_packed_mamba_fullgraph_matches_eager(cuda):
    layer, h, pos, dout = gpu_case(cuda, batch=3)

    def fn(x, position_ids):
        return layer(x, position_ids=position_ids)

    with torch.autocast("cuda", dtype=BF16):
        explained = torch._dynamo.explain(fn)(h, pos)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(fn, fullgraph=True)
    assert_close_rel(autocast_step(fn, layer, h, pos, dout), autocast_step(compiled, layer, h, pos, dout), GPU_TOL,
                     "compiled (inductor) vs eager, bf16 autocast")


@pytest.mark.gpu
def test_gpu_packed_mamba_reduce_overhead(cuda):
    layer, h, pos, dout = gpu_case(cuda)

    def fn(x, position_ids):
        return layer(x, position_ids=position_ids)

    compiled = torch.compile(fn, mode="reduce-overhead", fullgraph=True)
    eager = autocast_step(fn, layer, h, pos, dout)
    for _ in range(3):  # warm-up, record, replay
        got = autocast_step(compiled, layer, h, pos, dout)
        torch.cuda.synchronize()
    assert_close_rel(eager, got, GPU_TOL, "compiled (reduce-overhead) vs eager, bf16 autocast")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_gpu_opcheck(cuda, dtype):
    torch.manual_seed(0)
    b, d, n, L = 2, 32, 16, 130
    pos = positions([[1, 2, 127], [130]]).to(cuda, torch.int32)
    u = torch.randn(b, d, L, device=cuda).to(dtype).requires_grad_(True)
    delta = (0.5 * torch.randn(b, d, L, device=cuda)).to(dtype).requires_grad_(True)
    A = (-torch.rand(d, n, device=cuda)).requires_grad_(True)
    B = torch.randn(b, 2, n, L, device=cuda).to(dtype).requires_grad_(True)
    C = torch.randn(b, 2, n, L, device=cuda).to(dtype).requires_grad_(True)
    D = torch.randn(d, device=cuda, requires_grad=True)
    z = torch.randn(b, d, L, device=cuda).to(dtype).requires_grad_(True)
    db = torch.randn(d, device=cuda, requires_grad=True)
    torch.library.opcheck(torch.ops.packloader.selective_scan_fwd, (u, delta, A, B, C, D, z, db, pos, True))
    args = tuple(t.detach() for t in (u, delta, A, B, C, D, z, db))
    out, saved, _ = torch.ops.packloader.selective_scan_fwd(*args, pos, True)
    torch.library.opcheck(torch.ops.packloader.selective_scan_bwd, (*args, pos, True, saved, torch.randn_like(out)))
    # carried states: initial states (with their gradient) and final states
    from ops.states import state_slots
    slots = state_slots(pos, torch.tensor([True, False, True, True], device=cuda), True)
    h0 = torch.randn(4, d, n, device=cuda)
    torch.library.opcheck(torch.ops.packloader.selective_scan_fwd,
                          (u, delta, A, B, C, D, z, db, pos, True, slots, h0.requires_grad_(True), 4))
    out, saved, _ = torch.ops.packloader.selective_scan_fwd(*args, pos, True, slots, h0.detach(), 4)
    torch.library.opcheck(torch.ops.packloader.selective_scan_bwd,
                          (*args, pos, True, saved, torch.randn_like(out), False, slots, h0.detach(),
                           torch.randn(4, d, n, device=cuda)))
    for channel_last in (False, True):
        x = torch.randn(b, L, d, device=cuda).to(dtype).transpose(1, 2) if channel_last else \
            torch.randn(b, d, L, device=cuda).to(dtype)
        w = torch.randn(d, 4, device=cuda)
        cb = torch.randn(d, device=cuda)
        torch.library.opcheck(torch.ops.packloader.causal_conv1d_fwd,
                              (x.requires_grad_(True), w.requires_grad_(True), cb.requires_grad_(True), pos, True))
        torch.library.opcheck(torch.ops.packloader.causal_conv1d_bwd,
                              (x.detach(), w.detach(), cb.detach(), pos, True, torch.randn(b, d, L, device=cuda)))
        runmask = torch.ops.packloader.conv_runmask(pos)
        torch.library.opcheck(torch.ops.packloader.conv_runmask, (pos,))
        torch.library.opcheck(torch.ops.packloader.causal_conv1d_fwd,
                              (x.requires_grad_(True), w.requires_grad_(True), cb.requires_grad_(True), pos, True,
                               runmask))
        torch.library.opcheck(torch.ops.packloader.causal_conv1d_bwd,
                              (x.detach(), w.detach(), cb.detach(), pos, True, torch.randn(b, d, L, device=cuda),
                               runmask))


@pytest.mark.gpu
@pytest.mark.parametrize("fused_norms", [False, True], ids=["torch_norms", "fused_triton_norms"])
def test_gpu_converted_mamba_lm_fullgraph(cuda, fused_norms):
    """With mamba-ssm's default config the blocks also run its Triton RMSNorm (fused_add_norm): should that break
    the graph, the printed break reasons name it (it is upstream's code, not ours)."""
    pytest.importorskip("mamba_ssm", exc_type=ImportError)
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel as UpstreamLM

    torch.manual_seed(0)
    cfg = MambaConfig(d_model=256, n_layer=4, vocab_size=1024, ssm_cfg={}, rms_norm=fused_norms,
                      fused_add_norm=fused_norms)
    model = enable_packing(UpstreamLM(cfg, device=cuda))
    ids = torch.randint(0, 1024, (2, 1024), device=cuda)
    pos = positions([[1, 2, 3, 200, 318, 500], [1024]]).to(cuda)
    dout = torch.randn(2, 1024, 1024, device=cuda)

    def fn(input_ids, position_ids):
        return model(input_ids, position_ids=position_ids).logits

    with torch.autocast("cuda", dtype=BF16):
        explained = torch._dynamo.explain(fn)(ids, pos)
    print("graph breaks:", explained.graph_break_count, explained.break_reasons)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(fn, fullgraph=True)
    params = list(model.parameters())

    def step(f):
        with torch.autocast("cuda", dtype=BF16):
            return fwd_bwd(lambda x: f(x, pos), ids, params, dout)

    assert_close_rel(step(fn), step(compiled), GPU_TOL, "converted MambaLMHeadModel, compiled vs eager")


def test_bench_compile_quick_smoke(tmp_path):
    """``benchmarks/bench_compile.py --quick`` runs on the CPU, finds 0 graph breaks and writes its JSON."""
    import importlib.util
    import json
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_compile.py"
    spec = importlib.util.spec_from_file_location("bench_compile", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "compile.json"
    mod.main(["--quick", "--device", "cpu", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["graph_breaks"] == 0
    assert [r["variant"] for r in res["rows"]] == ["eager", "compile"]
    assert all(r["ms"] > 0 for r in res["rows"])
    assert res["rows"][1]["rel_err_out"] <= 1e-6 and res["rows"][1]["rel_err_dh"] <= 1e-6


def test_states_compile_whole_on_cpu(seed):
    """The scan and the conv with initial and final states under torch.compile(fullgraph=True): no graph break, the
    forward and every gradient (the states' included) equal to eager; the ops pass torch.library.opcheck with states."""
    from ops.states import state_slots
    b, d, n, L, w = 2, 4, 3, 12, 4
    pos = positions([[1, 4, 7], [2, 10]])
    u, delta = torch.randn(b, d, L, requires_grad=True), torch.rand(b, d, L, requires_grad=True)
    A, B, C = -torch.rand(d, n), torch.randn(b, n, L), torch.randn(b, n, L)
    h0 = torch.randn(5, d, n, requires_grad=True)
    c0 = torch.randn(5, d, w - 1, requires_grad=True)
    weight = torch.randn(d, w, requires_grad=True)
    has = torch.tensor([True, False, True, True, False])

    def fn(u, delta, h0, c0, weight):
        xc, cfin = ops.packed_causal_conv1d(u, weight, None, "silu", position_ids=pos, initial_state=c0,
                                            has_initial_state=has, output_final_state=True)
        y, hfin = ops.packed_selective_scan(xc, delta, A, B, C, position_ids=pos, initial_state=h0,
                                            has_initial_state=has, output_final_state=True)
        return y.sum() + (hfin * hfin).sum() + (cfin * cfin).sum()

    leaves = (u, delta, h0, c0, weight)
    want = torch.autograd.grad(fn(*leaves), leaves)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    got = torch.autograd.grad(compiled(*leaves), leaves)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    slots = state_slots(pos.int(), has, True)
    torch.library.opcheck(torch.ops.packloader.selective_scan_fwd,
                          (u, delta, A, B, C, None, None, None, pos.int(), False, slots, h0, 5))
