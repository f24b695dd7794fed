"""ops.carry: a stack of PackedMamba layers trained on a long document cut into pieces gives the whole document's
outputs and gradients where the pieces share a step (the state chained inside the forward), its outputs where a piece
continues in a later step (the state from the cache), and the cache resumes exactly; bad continuations are refused.
float64 on the reference kernels."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ops

F64 = torch.float64


class Stack(torch.nn.Module):
    """Residual PackedMamba layers (layer_idx 0..n-1)."""

    def __init__(self, d_model=8, n=2):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            ops.PackedMamba(d_model, d_state=4, d_conv=4, expand=2, layer_idx=i, dtype=F64) for i in range(n))

    def forward(self, h, position_ids, carry=None):
        for layer in self.layers:
            h = h + layer(h, position_ids=position_ids, carry=carry)
        return h


def assert_grad_close(got, want, name):
    """float64 gradients to 1e-9; those of the float32 parameters (A_log and D are always float32) to float32's
    rounding: each scan's contribution to them is rounded to float32 once, and the carry sums more contributions."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9, msg=name)
    else:
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10, msg=name)


def _batch(rows, segs):
    """rows: per row, a list of (length, doc_id, piece_index, continues_after) segments; the carry keys follow."""
    pos = torch.stack([torch.cat([torch.arange(s[0]) for s in row]) for row in rows])
    flat = [s for row in rows for s in row]
    return {
        "position_ids": pos,
        "piece_doc_ids": torch.tensor([s[1] for s in flat], dtype=torch.int64),
        "piece_index": torch.tensor([s[2] for s in flat], dtype=torch.int32),
        "has_initial_state": torch.tensor([s[1] >= 0 and s[2] > 0 for s in flat]),
        "continues_after": torch.tensor([s[3] for s in flat]),
    }


def _tokens_of(h_doc, rows, doc_id, d_model, fill):
    """The hidden states of a batch: the document's pieces at their places, random tokens elsewhere."""
    out, used = [], 0
    for row in rows:
        parts = []
        for n, doc, piece, _ in row:
            if doc == doc_id:
                parts.append(h_doc[used:used + n])
                used += n
            else:
                parts.append(fill(n))
        out.append(torch.cat(parts))
    return torch.stack(out), used


@pytest.mark.parametrize("pieces_rows", [
    [[(5, 9, 0, True)], [(12, 9, 1, True)], [(3, 9, 2, False), (9, -1, 0, False)]],     # one step, three rows
    [[(4, -1, 0, False), (2, 9, 0, True)], [(1, 9, 1, True), (13, -1, 0, False)], [(14, 9, 2, False)]],
], ids=["whole-rows", "short-pieces"])
def test_pieces_in_one_step_give_the_whole_documents_outputs_and_gradients(seed, pieces_rows):
    torch.manual_seed(seed)
    model = Stack()
    L = max(sum(s[0] for s in r) for r in pieces_rows)
    rows = [r + ([(L - sum(s[0] for s in r), -1, 0, False)] if sum(s[0] for s in r) < L else []) for r in pieces_rows]
    N = sum(s[0] for r in rows for s in r if s[1] == 9)
    doc = torch.randn(N, 8, dtype=F64, requires_grad=True)
    whole = model(doc[None], torch.arange(N)[None])[0]
    g = torch.randn_like(whole)
    params = list(model.parameters())
    want = torch.autograd.grad((whole * g).sum(), [doc] + params)
    batch = _batch(rows, None)
    h, used = _tokens_of(doc, rows, 9, 8, lambda n: torch.randn(n, 8, dtype=F64))
    assert used == N
    cache = ops.StateCache()
    out = model(h, batch["position_ids"], carry=cache.step(batch))
    got_doc = torch.cat([out[r, sum(s[0] for s in row[:i]):sum(s[0] for s in row[:i + 1])]
                         for r, row in enumerate(rows) for i, s in enumerate(row) if s[1] == 9])
    torch.testing.assert_close(got_doc, whole, rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad((got_doc * g).sum(), [doc] + params)
    for name, x, y in zip(["doc"] + [n for n, _ in model.named_parameters()], got, want):
        assert_grad_close(x, y, name)
    assert len(cache.state_dict()["states"]) == 0   # the document ended in this step: nothing kept


def test_pieces_across_steps_continue_from_the_cache_and_resume_exactly(seed):
    """Step 1 holds pieces 0-1 of a document, step 2 piece 2: step 2's outputs equal the whole document's; the cache
    saved after step 1 and loaded into a fresh one gives the same step 2 (exact resume)."""
    torch.manual_seed(seed)
    model = Stack()
    step1 = [[(6, 4, 0, True), (10, -1, 0, False)], [(16, 4, 1, True)]]
    step2 = [[(3, -1, 0, False), (11, 4, 2, False), (2, -1, 0, False)]]
    N = 6 + 16 + 11
    doc = torch.randn(N, 8, dtype=F64)
    whole = model(doc[None], torch.arange(N)[None])[0].detach()
    cache = ops.StateCache()
    h1, _ = _tokens_of(doc, step1, 4, 8, lambda n: torch.randn(n, 8, dtype=F64))
    b1 = _batch(step1, None)
    out1 = model(h1, b1["position_ids"], carry=cache.step(b1))
    torch.testing.assert_close(out1[1], whole[6:22], rtol=1e-10, atol=1e-10)
    saved = cache.state_dict()
    assert list(saved["states"]) == [4] and set(saved["states"][4]) == {0, 1}
    for layer in (0, 1):   # the cache holds the continuing piece's states only, not the step's other slots (piece 0)
        for t in cache.get(4, layer):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    h2, _ = _tokens_of(doc[22:], step2, 4, 8, lambda n: torch.randn(n, 8, dtype=F64))
    b2 = _batch(step2, None)
    out2 = model(h2, b2["position_ids"], carry=cache.step(b2))
    torch.testing.assert_close(out2[0, 3:14], whole[22:], rtol=1e-10, atol=1e-10)
    resumed = ops.StateCache()
    resumed.load_state_dict(saved)
    again = model(h2, b2["position_ids"], carry=resumed.step(b2))
    assert torch.equal(again, out2)
    cache.commit()
    assert len(cache) == 0   # the document ended: its state is dropped


def test_a_continuation_without_its_predecessor_is_refused():
    model = Stack()
    rows = [[(5, 3, 2, False), (11, -1, 0, False)]]
    b = _batch(rows, None)
    with pytest.raises(ops.CarryError, match="continues document 3 .piece 2."):
        ops.StateCache().step(b)
    bad = dict(b, piece_index=torch.tensor([2], dtype=torch.int32))
    with pytest.raises(ops.CarryError, match="one entry per segment"):
        ops.StateCache().step(bad)
    layer = ops.PackedMamba(8, layer_idx=None, dtype=F64)
    b_ok = _batch([[(5, 3, 0, True), (11, -1, 0, False)]], None)
    with pytest.raises(ops.CarryError, match="layer_idx"):
        layer(torch.randn(1, 16, 8, dtype=F64), position_ids=b_ok["position_ids"], carry=ops.StateCache().step(b_ok))
    del model


def test_a_batch_without_continuations_runs_the_plain_path(seed, monkeypatch):
    """No piece continues or goes on: the fused mixer runs, with the bits of a call without carry."""
    model = Stack()
    rows = [[(5, -1, 0, False), (11, -1, 0, False)]]
    b = _batch(rows, None)
    h = torch.randn(1, 16, 8, dtype=F64)
    import ops.carry as carry_mod
    monkeypatch.setattr(carry_mod, "carried_mamba_inner", lambda *a: (_ for _ in ()).throw(AssertionError("used")))
    assert torch.equal(model(h, b["position_ids"], carry=ops.StateCache().step(b)), model(h, b["position_ids"]))



def _lm_batch_case():
    rows = [[(4, -1, 0, False), (8, 7, 0, True)], [(12, 7, 1, False)]]
    ids = torch.randint(0, 50, (2, 12))
    return rows, ids, _batch(rows, None)


def test_converted_lm_carries_the_state_between_rows_of_a_step(seed):
    """A mamba-ssm MambaLMHeadModel converted by enable_packing takes carry= through its mixer kwargs: the logits of
    a document cut across two rows equal the document run alone, and so do the gradients of its weights."""
    from ._helpers import MambaLMHeadModel
    torch.manual_seed(seed)
    model = ops.enable_packing(MambaLMHeadModel(d_model=8, n_layer=2, vocab_size=50, d_state=4).double())
    rows, ids, batch = _lm_batch_case()
    doc = torch.cat([ids[0, 4:], ids[1]])
    whole = model(doc[None], position_ids=torch.arange(20)[None]).logits[0]
    params = list(model.parameters())
    want = torch.autograd.grad(whole.square().sum(), params)
    out = model(ids, position_ids=batch["position_ids"], carry=ops.StateCache().step(batch)).logits
    got_doc = torch.cat([out[0, 4:], out[1]])
    torch.testing.assert_close(got_doc, whole, rtol=1e-10, atol=1e-10)
    got = torch.autograd.grad(got_doc.square().sum(), params)
    for (name, _), x, y in zip(model.named_parameters(), got, want):
        assert_grad_close(x, y, name)


def test_layers_that_cannot_carry_refuse_a_continuation():
    """A Mamba-2 mixer, or an attention layer left unconverted, raises on a batch with continuations (it would start
    them from zero) and runs a batch without any."""
    from ._helpers import MambaLMHeadModel
    rows, ids, batch = _lm_batch_case()
    plain = dict(batch, has_initial_state=torch.zeros(3, dtype=torch.bool),
                 continues_after=torch.zeros(3, dtype=torch.bool))
    for mixers, strict in ((("Mamba1", "Mamba2"), True), (("Mamba1", "MHA"), False)):
        model = ops.enable_packing(MambaLMHeadModel(d_model=8, n_layer=2, vocab_size=50, mixers=mixers, d_state=4)
                                   .double(), strict=strict)
        with pytest.raises(ops.CarryError, match="cannot carry its state"):
            model(ids, position_ids=batch["position_ids"], carry=ops.StateCache().step(batch))
        model(ids, position_ids=batch["position_ids"], carry=ops.StateCache().step(plain))


# a batch whose pieces continue from the cache and from each other (a middle piece of one token, a piece shorter
# than the conv width, a chain of three rows); one whose chains start with pieces shorter than the conv's width; one whose continuations all come from the cache (one piece of a
# document a step: no autograd through the conv's states), with pieces of 1 and 2 tokens, shorter than the
# conv's width - 1, and one continuing after; and one whose in-batch predecessors sit in rows 0 and 2
_FIRST = [[(6, 5, 0, True), (4, 7, 0, True), (3, 8, 0, True), (3, -1, 0, False)]]
_SECOND = {
    "chains": [[(2, 5, 1, True), (5, 6, 0, True), (9, -1, 0, False)], [(1, 6, 1, True), (15, 5, 2, False)],
               [(16, 6, 2, True)], [(4, 6, 3, False), (12, -1, 0, False)]],
    "from_cache": [[(1, 7, 1, False), (15, -1, 0, False)], [(9, 5, 1, True), (7, -1, 0, False)],
                   [(2, 8, 1, False), (14, -1, 0, False)], [(16, -1, 0, False)]],
    # the in-batch predecessors in rows 0 and 2 only (rows that are not consecutive: the first pass gathers them)
    # a chain from zero whose first pieces are shorter than the conv's width - 1 together (1 + 1 tokens before the
    # third piece: its conv state reaches back past the document's start), and one from the cache through a 1-token
    # piece (2 tokens before: one from the cached state)
    "short_heads": [[(1, 9, 0, True), (1, 7, 1, True), (14, -1, 0, False)], [(1, 9, 1, True), (15, 7, 2, False)],
                    [(16, 9, 2, False)], [(16, -1, 0, False)]],
    "gapped": [[(4, 5, 1, True), (12, -1, 0, False)], [(3, 5, 2, False), (13, -1, 0, False)],
               [(6, -1, 0, False), (10, 7, 1, True)], [(5, 7, 2, False), (11, 8, 1, False)]],
    # the loader's layout (every continuation piece a whole row): a chain from a piece 0 that ends its row, kept
    # after the step at a row's end, and a piece 0 kept from inside a row (the scan's slots at row edges both ways)
    "row_edges": [[(5, -1, 0, False), (11, 11, 0, True)], [(16, 11, 1, True)], [(16, 11, 2, True)],
                  [(7, 12, 0, True), (9, -1, 0, False)]],
    # ... a chain from a piece 0 inside a row (the backward per token) and a cached piece of 2 tokens kept from inside
    # its row
    "row_edges_mid_head": [[(11, 13, 0, True), (5, -1, 0, False)], [(16, 13, 1, True)],
                           [(2, 7, 1, True), (14, -1, 0, False)], [(16, -1, 0, False)]],
    # the step after _FIRST as one piece of a document a step goes on: every continuation from the cache (the fused
    # mixer keeps the cache's own states for its backward), and a new document's first piece that goes on
    "cache_and_new_doc": [[(3, 5, 1, True), (5, 9, 0, True), (8, -1, 0, False)], [(2, 7, 1, False), (14, -1, 0, False)],
                       [(16, 8, 1, False)], [(16, -1, 0, False)]],
}


@pytest.mark.parametrize("layout", sorted(_SECOND))
def test_fused_mixer_with_states_matches_the_composed_one(seed, layout):
    """CarriedMambaInnerFn (the fused mixer, hand-written backward through the chain) against the functional ops
    composed with autograd, float64, on the batches above: outputs, every gradient and the states kept."""
    from ops.carry import carried_mamba_inner
    torch.manual_seed(seed)
    cache = ops.StateCache()
    layer = ops.PackedMamba(8, d_state=4, layer_idx=0, dtype=F64)
    b1 = _batch(_FIRST, None)
    carried_mamba_inner(layer, torch.randn(1, 16, 8, dtype=F64), b1["position_ids"], cache.step(b1))
    rows = _SECOND[layout]
    b2 = _batch(rows, None)
    cache.commit()
    h = torch.randn(4, 16, 8, dtype=F64, requires_grad=True)
    weights = torch.randn(4, 16, 8, dtype=F64)
    res = {}
    for fused in (True, False):
        step = ops.CarryStep(b2, cache)
        y = carried_mamba_inner(layer, h, b2["position_ids"], step, fused=fused)
        grads = torch.autograd.grad((y * weights).sum(), [h] + list(layer.parameters()))
        res[fused] = (y, grads, step.finals())
    torch.testing.assert_close(res[True][0], res[False][0], rtol=1e-12, atol=1e-12)
    for (name, _), a, b in zip([("h", None)] + list(layer.named_parameters()), res[True][1], res[False][1]):
        assert_grad_close(a, b, name)
    for doc in res[False][2]:   # the states kept for the next step agree too
        for x, y in zip(res[True][2][doc][0], res[False][2][doc][0]):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout,forward,backward", [("row_edges", True, True), ("row_edges_mid_head", True, False),
                                                     ("from_cache", True, True), ("chains", False, False)])
def test_the_fused_scan_takes_row_edge_slots_where_the_states_sit_there(layout, forward, backward):
    """Where every state in starts a row, the fused mixer's scan takes row-edge slots (its plain loops); the
    backward too where every in-batch predecessor ends a row. They name the same initial states as the per-token
    slots, final states at the rows' ends, and the stored slots ending inside a row are completed apart (``mid``)."""
    from ops.carry import carried_mamba_inner
    from ops.states import token_slots
    cache = ops.StateCache()
    b1 = _batch(_FIRST, None)
    carried_mamba_inner(ops.PackedMamba(8, d_state=4, layer_idx=0, dtype=F64), torch.randn(1, 16, 8, dtype=F64),
                        b1["position_ids"], cache.step(b1))
    cache.commit()
    step = ops.CarryStep(_batch(_SECOND[layout], None), cache)
    g = step.geometry(torch.device("cpu"))
    assert (g["fwd_slots"].dim() == 2) == forward and (g["bwd_slots"].dim() == 2) == backward
    if not forward:
        assert g["fwd_slots"] is g["slots"] and g["mid"] is None
        return
    tok = token_slots(g["fwd_slots"], 16)
    assert torch.equal(tok[0], g["slots"][0])
    ends = tok[1] >= 0
    assert torch.equal(tok[1][ends], g["slots"][1][ends])
    stored = set(np.flatnonzero(step.store).tolist())
    mid = set() if g["mid"] is None else set(g["mid"]["slot"].tolist())
    assert stored == (set(tok[1][ends].tolist()) & stored) | mid and not (mid & set(tok[1][ends].tolist()))
    assert mid == {"row_edges": {3}, "row_edges_mid_head": {2}, "from_cache": {1}}[layout] or layout not in (
        "row_edges", "row_edges_mid_head", "from_cache")


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "composed"])
def test_gpu_pieces_in_one_step_match_the_whole_document(fused):
    """On the CUDA kernels (fp32): a 2000-token document cut over three rows of 1024 with other sequences around it
    gives the whole document's outputs and gradients within 1e-5, with the fused and with the composed mixer."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    dev = "cuda"
    layer = ops.PackedMamba(256, layer_idx=0, device=dev)
    layer.use_fast_path = fused
    L = 1024
    rows = [[(300, -1, 0, False), (724, 9, 0, True)], [(1024, 9, 1, True)], [(252, 9, 2, False), (L - 252, -1, 0,
                                                                                                        False)]]
    b = _batch(rows, None)
    N = 724 + 1024 + 252
    doc = torch.randn(N, 256, device=dev, requires_grad=True)
    whole = layer(doc[None], position_ids=torch.arange(N, device=dev)[None])[0]
    gout = torch.randn_like(whole)
    params = list(layer.parameters())
    want = torch.autograd.grad((whole * gout).sum(), [doc] + params)
    h, _ = _tokens_of(doc, rows, 9, 256, lambda n: torch.randn(n, 256, device=dev))
    out = layer(h, position_ids=b["position_ids"].to(dev), carry=ops.StateCache().step(b))
    got_doc = torch.cat([out[0, 300:], out[1], out[2, :252]])
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(got_doc, whole) <= 1e-5
    got = torch.autograd.grad((got_doc * gout).sum(), [doc] + params)
    for (name, _), x, y in zip([("doc", None)] + list(layer.named_parameters()), got, want):
        assert rel(x, y) <= 1e-5, (name, rel(x, y))



@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(_SECOND))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_fused_mixer_with_states_matches_the_reference_kernels(layout, dtype):
    """The fused mixer with carried states on the CUDA kernels (the conv's states by conv_states.cu) against the same
    mixer on the reference kernels, on the batches above at a width the kernels tile (d_inner 512): outputs, every
    gradient and the kept states within 1e-5 (fp32) / 2e-2 (bf16) relative."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from ops.carry import carried_mamba_inner
    torch.manual_seed(0)
    dev = "cuda"
    layer = ops.PackedMamba(256, d_state=16, layer_idx=0, device=dev, dtype=dtype)
    b1, b2 = _batch(_FIRST, None), _batch(_SECOND[layout], None)
    h1 = torch.randn(1, 16, 256, device=dev, dtype=dtype)
    h = torch.randn(4, 16, 256, device=dev, dtype=dtype, requires_grad=True)
    weights = torch.randn(4, 16, 256, device=dev, dtype=dtype)
    res = {}
    for backend in ("auto", "reference"):
        with ops.use_backend(backend):
            cache = ops.StateCache()
            carried_mamba_inner(layer, h1, b1["position_ids"].to(dev), cache.step(b1))
            cache.commit()
            step = ops.CarryStep(b2, cache)
            y = carried_mamba_inner(layer, h, b2["position_ids"].to(dev), step, fused=True)
            grads = torch.autograd.grad((y.float() * weights.float()).sum(), [h] + list(layer.parameters()))
        res[backend] = (y, grads, step.finals())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))  # noqa: E731
    assert rel(res["auto"][0], res["reference"][0]) <= tol
    for (name, _), a, b in zip([("h", None)] + list(layer.named_parameters()), res["auto"][1], res["reference"][1]):
        assert rel(a, b) <= tol, (name, rel(a, b))
    for doc, layers in res["reference"][2].items():
        for a, b in zip(res["auto"][2][doc][0], layers[0]):
            assert rel(a, b) <= tol, doc

@pytest.mark.gpu
def test_gpu_chained_step_waits_for_the_gpu_nowhere():
    """With its step's geometry made, the fused mixer on a batch whose pieces chain over three rows runs forward and
    backward without a host sync (``torch.cuda.set_sync_debug_mode("error")``): a boolean mask used as an index in
    the chain's backward made every layer wait for the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from ops.carry import carried_mamba_inner
    torch.manual_seed(0)
    dev = "cuda"
    layer = ops.PackedMamba(256, d_state=16, layer_idx=0, device=dev, dtype=torch.float32)
    b1, b2 = _batch(_FIRST, None), _batch(_SECOND["chains"], None)
    cache = ops.StateCache()
    carried_mamba_inner(layer, torch.randn(1, 16, 256, device=dev), b1["position_ids"].to(dev), cache.step(b1))
    cache.commit()
    h = torch.randn(4, 16, 256, device=dev, requires_grad=True)
    pos = b2["position_ids"].to(dev)
    step = ops.CarryStep(b2, cache)
    assert step.depth.max() >= 2   # a chain over three rows
    step.geometry(torch.device(dev))
    carried_mamba_inner(layer, h, pos, step).sum().backward()   # warm: kernels loaded, indices cached
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        carried_mamba_inner(layer, h, pos, step).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_layers_of_different_conv_widths_share_a_step(seed):
    """One CarryStep's geometry (and the gather / scatter indices it keeps) serves layers whose conv widths differ: the
    fused mixer equals the composed one for each (widths 4, 3, 2 in one stack)."""
    from ops.carry import carried_mamba_inner
    torch.manual_seed(seed)
    layers = [ops.PackedMamba(8, d_state=4, d_conv=w, layer_idx=i, dtype=F64) for i, w in enumerate((4, 3, 2))]
    b1 = _batch(_FIRST, None)
    b2 = _batch(_SECOND["from_cache"], None)
    h1, h2 = torch.randn(1, 16, 8, dtype=F64), torch.randn(4, 16, 8, dtype=F64)
    res = {}
    for fused in (True, False):
        cache = ops.StateCache()
        step = cache.step(b1)
        for layer in layers:
            carried_mamba_inner(layer, h1, b1["position_ids"], step, fused=fused)
        cache.commit()
        step = ops.CarryStep(b2, cache)
        res[fused] = [carried_mamba_inner(layer, h2, b2["position_ids"], step, fused=fused) for layer in layers]
    for a, b in zip(res[True], res[False]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_inference_mode_runs_the_composed_and_the_fused_paths():
    """Tensors made under torch.inference_mode keep no version counter: the cached boundaries and geometry are not
    used for them, and the layers run as before."""
    torch.manual_seed(0)
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
    h = torch.randn(1, 8, 8, dtype=F64)
    for fast in (True, False):
        m = ops.PackedMamba(8, d_state=4, layer_idx=0, dtype=F64, use_fast_path=fast)
        want = m(h, position_ids=pos)
        with torch.inference_mode():
            got = m(h, position_ids=pos.clone())
        torch.testing.assert_close(got, want.detach(), rtol=1e-12, atol=1e-12)
    with torch.inference_mode():
        from ops.context_parallel import _step_geometry
        g = _step_geometry((torch.arange(6) + 6).expand(2, 6), 1, 2, "cpu")
    assert bool(g["first"]["has"].all())


def _carried_forward(layout, fused=True):
    """(step, y, the layer) of one mixer on the second-step batch ``layout`` (``_SECOND``; ``"first"``: ``_FIRST``,
    whose pieces all start from zero and continue after), its cache filled by ``_FIRST``."""
    from ops.carry import carried_mamba_inner
    torch.manual_seed(0)
    cache = ops.StateCache()
    layer = ops.PackedMamba(8, d_state=4, layer_idx=0, dtype=F64)
    if layout == "first":
        b = _batch(_FIRST, None)
    else:
        b1 = _batch(_FIRST, None)
        carried_mamba_inner(layer, torch.randn(1, 16, 8, dtype=F64), b1["position_ids"], cache.step(b1))
        cache.commit()
        b = _batch(_SECOND[layout], None)
    step = ops.CarryStep(b, cache)
    h = torch.randn(b["position_ids"].shape + (8,), dtype=F64, requires_grad=True)
    return step, carried_mamba_inner(layer, h, b["position_ids"], step, fused=fused), layer


@pytest.mark.parametrize("layout", ["first"] + sorted(_SECOND))
def test_fused_mixer_saves_the_initial_states_of_the_slots_with_one_only(layout):
    """The states the fused mixer keeps for its backward (scan and conv) are those of the slots with a state in
    (cached or from an in-batch predecessor), not the zeros of the others; none where no slot has one."""
    step, y, layer = _carried_forward(layout)
    d_inner, d_state, width = layer.d_inner, layer.d_state, layer.d_conv
    with_state = sum(s != "none" for s in step.source)
    assert with_state < step.num_slots or layout in ("from_cache", "gapped")
    saved = [t for t in y.grad_fn.saved_tensors if t is not None]
    for shape in ((d_inner, d_state), (d_inner, width - 1)):
        states = [t for t in saved if t.dim() == 3 and tuple(t.shape[1:]) == shape]
        cached = [t for t in saved if tuple(t.shape) == shape and not t.requires_grad]   # the cache's, a slot each
        assert sum(t.shape[0] for t in states) + len(cached) == with_state, shape
        assert not (states and cached), shape


@pytest.mark.parametrize("layout", sorted(_SECOND))
def test_a_step_keeps_the_final_states_of_the_pieces_that_go_on_only(layout):
    """After the forward, the step holds (until the cache takes them) the final states of the slots whose document
    continues after the step, in their own storage: not every slot's; fused and composed mixers keep the same."""
    kept = {}
    for fused in (True, False):
        step, _, layer = _carried_forward(layout, fused)
        stored = int(step.store.sum())
        assert stored < step.num_slots
        conv, ssm = kept[fused] = step.final_states(0)
        assert conv.shape == (stored, layer.d_inner, layer.d_conv - 1)
        assert ssm.shape == (stored, layer.d_inner, layer.d_state)
        for t in (conv, ssm):
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
        assert sorted(step.finals()) == sorted(int(d) for d in step.doc_ids[step.store])
    for a, b in zip(kept[True], kept[False]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_a_step_whose_pieces_all_go_on_keeps_every_slot():
    """A generation's prefill (every prompt continues after, none continued) keeps every slot's final states."""
    step, _, layer = _carried_forward("first")
    assert bool(step.store.all())
    conv, ssm = step.final_states(0)
    assert conv.shape[0] == ssm.shape[0] == step.num_slots == 3


@pytest.mark.parametrize("layout", ["cache_and_new_doc", "from_cache", "gapped"])
def test_fused_mixer_keeps_the_caches_states_without_a_copy(layout):
    """Where every slot with a state in continues from the cache (one piece of a document a step), the states the
    fused mixer keeps for its backward are the cache's own tensors (no copy: each state is held once until the
    backward); where an in-batch predecessor hands one on, a copy of the slots' states. Either way the values are
    the same (``test_fused_mixer_with_states_matches_the_composed_one``) and the backward runs."""
    step, y, layer = _carried_forward(layout)
    cached = [step.cache.get(int(step.doc_ids[k]), 0) for k, src in enumerate(step.source) if src == "cache"]
    from_cache = all(src in ("cache", "none") for src in step.source)
    assert from_cache == (layout != "gapped")
    def where(t):
        return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()
    saved = {where(t) for t in y.grad_fn.saved_tensors if t is not None}
    for pair in cached:
        for t in pair:
            assert (where(t) in saved) == from_cache
    y.sum().backward()
