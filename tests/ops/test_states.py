"""Carried states (ops.states and the ops' initial_state / output_final_state): a document cut into pieces, each
piece packed among other sequences in a later call and started from the state the piece before ended with, gives
the outputs and every gradient of the whole document run alone (float64, the reference), and the slots and errors
are right. The kernels on these arguments: tests/ops/test_kernel_emulation.py (CPU) and test_cuda_kernels.py (GPU)."""
from __future__ import annotations

import random

import pytest
import torch

import ops
from ops.states import sequence_spans, state_slots, token_slots

F64 = torch.float64


def test_state_slots_and_spans():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 0, 0, 1, 2]])
    has = torch.tensor([True, False, True, False, True, False])
    slots = state_slots(pos, has, True)
    assert slots.dtype == torch.int32 and slots.shape == (2, 2, 6)
    assert slots[0].tolist() == [[0, -1, -1, -1, -1, 2], [-1, -1, 4, -1, -1, -1]]
    assert slots[1].tolist() == [[-1, -1, 0, -1, 1, 2], [-1, 3, 4, -1, -1, 5]]
    assert state_slots(pos, None, False).eq(-1).all()
    start, length = sequence_spans(pos, 6)
    assert start.tolist() == [0, 3, 5, 6, 8, 9] and length.tolist() == [3, 2, 1, 2, 1, 3]


def test_row_edge_slots_spread_over_the_tokens():
    edges = torch.tensor([[3, -1, 0], [-1, 2, 1]], dtype=torch.int32)
    tok = token_slots(edges, 4)
    assert tok.dtype == torch.int32 and tok.shape == (2, 3, 4)
    assert tok[0].tolist() == [[3, -1, -1, -1], [-1, -1, -1, -1], [0, -1, -1, -1]]
    assert tok[1].tolist() == [[-1, -1, -1, -1], [-1, -1, -1, 2], [-1, -1, -1, 1]]
    assert token_slots(edges, 1)[:, :, 0].tolist() == edges.tolist()
    assert token_slots(tok, 4) is tok   # per-token slots pass through


def test_rows_of_one_sequence_hand_the_scan_row_edge_slots(seed, monkeypatch):
    """Rows known to be one sequence each (validated ids): the functional scan gives the op row-edge slots (2, batch),
    whose kernels run the plain loops; outputs, final states and every gradient equal those of per-token slots."""
    from ops import selective_scan_interface as ssi
    batch, dim, n, L = 3, 4, 3, 7
    t = lambda *s: torch.randn(*s, dtype=F64).requires_grad_(True)  # noqa: E731
    inputs = [t(batch, dim, L), (0.5 * torch.randn(batch, dim, L, dtype=F64)).requires_grad_(True),
              (-torch.rand(dim, n, dtype=F64)).requires_grad_(True), t(batch, n, L), t(batch, n, L), t(dim),
              t(batch, dim, L), t(dim)]
    h0, has = t(batch, dim, n), torch.tensor([True, False, True])
    pos = torch.arange(L).expand(batch, L).contiguous()
    seen = []
    real = ssi.selective_scan_fwd
    monkeypatch.setattr(ssi, "selective_scan_fwd", lambda *a: seen.append(a[10]) or real(*a))

    def run():
        out, final = ops.packed_selective_scan(*inputs, True, position_ids=pos, initial_state=h0,
                                               has_initial_state=has, output_final_state=True)
        loss = (out * torch.linspace(-1, 1, L, dtype=F64)).sum() + (final ** 2).sum()
        return (out, final) + torch.autograd.grad(loss, inputs + [h0])

    got = run()
    assert seen[-1].shape == (2, batch) and seen[-1].tolist() == [[0, -1, 2], [0, 1, 2]]
    monkeypatch.setattr(ssi, "single_sequence_rows", lambda p: False)
    want = run()
    assert seen[-1].shape == (2, batch, L)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _doc_inputs(dim, dstate, N):
    """A document's scan inputs (float64 leaves, batch 1) and the shared parameters."""
    t = lambda *s: torch.randn(*s, dtype=F64).requires_grad_(True)  # noqa: E731
    doc = {"u": t(1, dim, N), "delta": (0.5 * torch.randn(1, dim, N, dtype=F64) - 1).requires_grad_(True),
           "B": t(1, dstate, N), "C": t(1, dstate, N), "z": t(1, dim, N)}
    params = {"A": (-torch.exp(0.5 * torch.randn(dim, dstate, dtype=F64))).requires_grad_(True), "D": t(dim),
              "delta_bias": (0.5 * torch.randn(dim, dtype=F64)).requires_grad_(True)}
    return doc, params


def _packed_call(doc, a, b, rows, at, L):
    """A packed batch of ``rows`` rows of ``L`` tokens holding the document's tokens ``a..b`` in row ``at[0]`` from
    column ``at[1]``, random short sequences everywhere else. Returns (inputs, position_ids, the piece's sequence
    number, the piece's token positions)."""
    lens_rows, inputs = [], {k: [] for k in doc}
    n = b - a
    seq_no, count = None, 0
    for r in range(rows):
        lens, col = [], 0
        while col < L:
            if r == at[0] and col == at[1]:
                seq_no = count
                lens.append(n)
                for k, v in doc.items():
                    inputs[k].append(v[..., a:b])
                col += n
            else:
                stop = at[1] if (r == at[0] and col < at[1]) else L
                m = min(random.randint(1, 5), stop - col)
                lens.append(m)
                for k, v in doc.items():
                    inputs[k].append(torch.randn(1, v.shape[1], m, dtype=F64))
                col += m
            count += 1
        lens_rows.append(lens)
    out = {}
    for k, parts in inputs.items():   # parts are in row-major order: cut them back into rows of L
        flat = torch.cat(parts, -1)
        out[k] = torch.cat([flat[..., r * L:(r + 1) * L] for r in range(rows)], 0)
    pos = torch.stack([torch.cat([torch.arange(m) for m in lens]) for lens in lens_rows])
    return out, pos, seq_no, count


@pytest.mark.parametrize("cuts", [[7, 8, 10, 23], [1, 2, 3, 23], [22, 23], [23]], ids=str)
def test_pieces_in_later_calls_give_the_whole_documents_outputs_and_gradients(seed, cuts):
    dim, dstate, L, N = 3, 4, 16, 23
    doc, params = _doc_inputs(dim, dstate, N)
    whole = ops.selective_scan_ref(doc["u"], doc["delta"], params["A"], doc["B"], doc["C"], params["D"], doc["z"],
                                   params["delta_bias"], delta_softplus=True)
    g = torch.randn_like(whole)
    want = torch.autograd.grad((whole * g).sum(), list(doc.values()) + list(params.values()))
    state, outs, a = None, [], 0
    loss = 0
    for k, b in enumerate(cuts):
        n = b - a
        rows = random.randint(1, 3)
        at = (random.randrange(rows), random.randint(0, L - n) if n <= L else 0)
        width = max(L, n)
        batch, pos, seq_no, count = _packed_call(doc, a, b, rows, at, width)
        has = torch.zeros(count, dtype=torch.bool)
        init = torch.randn(count, dim, dstate, dtype=F64)   # rows not flagged are not read
        if state is not None:
            has[seq_no] = True
            init = torch.cat([init[:seq_no], state[None], init[seq_no + 1:]])
        out, final = ops.packed_selective_scan(
            batch["u"], batch["delta"], params["A"], batch["B"], batch["C"], params["D"], batch["z"],
            params["delta_bias"], True, position_ids=pos, initial_state=init, has_initial_state=has,
            output_final_state=True)
        piece = out[at[0], :, at[1]:at[1] + n]
        torch.testing.assert_close(piece, whole[0, :, a:b], rtol=1e-12, atol=1e-12)
        loss = loss + (piece * g[0, :, a:b]).sum()
        state = final[seq_no]
        a = b
    got = torch.autograd.grad(loss, list(doc.values()) + list(params.values()))
    for name, x, y in zip(list(doc) + list(params), got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12, msg=name)


def test_final_state_gradient_reaches_the_inputs_and_an_unflagged_state_is_not_read(seed):
    """The final state of each sequence equals the whole-sequence scan's last state, its gradient reaches the
    inputs (against float64 autograd of the plain reference), and initial states without the flag are ignored."""
    dim, dstate = 2, 3
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 0]])
    args = [torch.randn(1, dim, 8, dtype=F64, requires_grad=True), torch.rand(1, dim, 8, dtype=F64),
            -torch.rand(dim, dstate, dtype=F64), torch.randn(1, dstate, 8, dtype=F64),
            torch.randn(1, dstate, 8, dtype=F64)]
    init = torch.randn(4, dim, dstate, dtype=F64, requires_grad=True)
    out, final = ops.packed_selective_scan(*args, position_ids=pos, initial_state=init,
                                           has_initial_state=torch.tensor([False, True, False, False]),
                                           output_final_state=True)
    for i, (s, e) in enumerate([(0, 4), (4, 6), (6, 7), (7, 8)]):
        sl = [t[..., s:e] if t.dim() == 3 else t for t in args]
        h0 = init[i:i + 1].detach() if i == 1 else None
        _, last = ops.selective_scan_ref(*sl, return_last_state=True)
        if h0 is not None:   # the reference with h0: the state's contribution decays through the piece
            dt = args[1][..., s:e]
            last = last + torch.exp(dt.sum(-1)[..., None] * args[2]) * h0
        torch.testing.assert_close(final[i:i + 1], last, rtol=1e-12, atol=1e-12)
    gf = torch.randn_like(final)
    du, dinit = torch.autograd.grad((final * gf).sum() + out.sum(), [args[0], init])
    assert dinit[[0, 2, 3]].abs().max() == 0 and dinit[1].abs().max() > 0
    eps = 1e-6   # the gradient of the flagged state, checked against finite differences
    i, d, n = 1, 1, 2
    bump = torch.zeros_like(init)
    bump[i, d, n] = eps
    f = lambda h: sum(x.sum() for x in ops.packed_selective_scan(  # noqa: E731
        *[t.detach() for t in args], position_ids=pos, initial_state=h,
        has_initial_state=torch.tensor([False, True, False, False]), output_final_state=True)[0:1]) + (
        ops.packed_selective_scan(*[t.detach() for t in args], position_ids=pos, initial_state=h,
                                  has_initial_state=torch.tensor([False, True, False, False]),
                                  output_final_state=True)[1] * gf).sum()
    fd = (f(init.detach() + bump) - f(init.detach() - bump)) / (2 * eps)
    assert abs(float(fd) - float(dinit[i, d, n])) < 1e-6


def test_bad_states_are_refused_with_the_argument_named():
    u = torch.randn(1, 2, 6)
    args = (u, torch.rand(1, 2, 6), -torch.rand(2, 3), torch.randn(1, 3, 6), torch.randn(1, 3, 6))
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with pytest.raises(ValueError, match="initial_state must be"):
        ops.packed_selective_scan(*args, position_ids=pos, initial_state=torch.zeros(2, 2, 4))
    with pytest.raises(ValueError, match="initial_state must be torch.float32"):
        ops.packed_selective_scan(*args, position_ids=pos, initial_state=torch.zeros(2, 2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="3 given, but the rows hold 2 sequences"):
        ops.packed_selective_scan(*args, position_ids=pos, initial_state=torch.zeros(3, 2, 3))
    with pytest.raises(ValueError, match="has_initial_state"):
        ops.packed_selective_scan(*args, position_ids=pos, initial_state=torch.zeros(2, 2, 3),
                                  has_initial_state=torch.ones(3, dtype=torch.bool))
    out = ops.packed_selective_scan(*args, position_ids=pos)
    same = ops.packed_selective_scan(*args, position_ids=pos, initial_state=torch.randn(2, 2, 3),
                                     has_initial_state=torch.zeros(2, dtype=torch.bool))
    assert torch.equal(out, same)


@pytest.mark.parametrize("cuts", [[1, 2, 4, 9, 23], [5, 6, 23], [23]], ids=str)
@pytest.mark.parametrize("width", [2, 4])
def test_conv_pieces_in_later_calls_give_the_whole_documents_outputs_and_gradients(seed, cuts, width):
    """The conv with initial / final states: pieces shorter than the conv width (their final state reaches into the
    initial state), each packed among other sequences; outputs and the gradients of x, weight and bias equal the
    whole document's (float64)."""
    dim, L, N = 3, 16, 23
    doc = {"x": torch.randn(1, dim, N, dtype=F64, requires_grad=True)}
    w = torch.randn(dim, width, dtype=F64, requires_grad=True)
    bias = torch.randn(dim, dtype=F64, requires_grad=True)
    whole = ops.causal_conv1d_ref(doc["x"], w, bias, "silu")
    g = torch.randn_like(whole)
    want = torch.autograd.grad((whole * g).sum(), [doc["x"], w, bias])
    state, a, loss = None, 0, 0
    for b in cuts:
        n = b - a
        rows = random.randint(1, 3)
        at = (random.randrange(rows), random.randint(0, L - n) if n <= L else 0)
        batch, pos, seq_no, count = _packed_call(doc, a, b, rows, at, max(L, n))
        has = torch.rand(count) < 0.5   # other sequences start from random states too
        has[seq_no] = state is not None
        init = torch.randn(count, dim, width - 1, dtype=F64)
        if state is not None:
            init = torch.cat([init[:seq_no], state[None], init[seq_no + 1:]])
        out, final = ops.packed_causal_conv1d(batch["x"], w, bias, "silu", position_ids=pos, initial_state=init,
                                              has_initial_state=has, output_final_state=True)
        piece = out[at[0], :, at[1]:at[1] + n]
        torch.testing.assert_close(piece, whole[0, :, a:b], rtol=1e-12, atol=1e-12)
        loss = loss + (piece * g[0, :, a:b]).sum()
        state, a = final[seq_no], b
    got = torch.autograd.grad(loss, [doc["x"], w, bias])
    for name, x, y in zip(["dx", "dweight", "dbias"], got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12, msg=name)


def test_conv_states_of_other_sequences_match_a_per_sequence_oracle(seed):
    """Every sequence of a packed batch, with or without its initial state, against the plain conv run on the state
    followed by the sequence (float64): outputs, final states, and the gradients of x and of the initial states."""
    width, dim = 4, 2
    lens = [[1, 2, 5, 8], [3, 3, 9, 1]]
    pos = torch.stack([torch.cat([torch.arange(m) for m in r]) for r in lens])
    x = torch.randn(2, dim, 16, dtype=F64, requires_grad=True)
    w, bias = torch.randn(dim, width, dtype=F64), torch.randn(dim, dtype=F64)
    init = torch.randn(8, dim, width - 1, dtype=F64, requires_grad=True)
    has = torch.tensor([True, False, True, True, False, True, True, False])
    out, final = ops.packed_causal_conv1d(x, w, bias, "silu", position_ids=pos, initial_state=init,
                                          has_initial_state=has, output_final_state=True)
    go, gf = torch.randn_like(out), torch.randn_like(final)
    dx, dinit = torch.autograd.grad((out * go).sum() + (final * gf).sum(), [x, init])
    i = 0
    for r, row in enumerate(lens):
        c = 0
        for m in row:
            xi = x[r:r + 1, :, c:c + m].detach().requires_grad_(True)
            h = (init[i:i + 1] if has[i] else torch.zeros(1, dim, width - 1, dtype=F64)).detach().requires_grad_(True)
            ext = torch.cat([h, xi], -1)
            want = ops.causal_conv1d_ref(ext, w, bias, "silu")[..., width - 1:]
            want_final = ext[..., -(width - 1):]
            torch.testing.assert_close(out[r:r + 1, :, c:c + m], want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(final[i:i + 1], want_final, rtol=0, atol=0)
            gx, gh = torch.autograd.grad((want * go[r:r + 1, :, c:c + m]).sum() + (want_final * gf[i:i + 1]).sum(),
                                         [xi, h])
            torch.testing.assert_close(dx[r:r + 1, :, c:c + m], gx, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(dinit[i:i + 1], gh if has[i] else torch.zeros_like(gh), rtol=1e-12, atol=1e-12)
            c += m
            i += 1


def test_initial_state_without_flags_is_used_by_every_sequence(seed):
    """initial_state alone: every sequence starts from its state (the flags default to all), in the scan and the
    conv; output_final_state under torch.compile without a count is a clear error."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    args = (torch.randn(1, 2, 6, dtype=F64), torch.rand(1, 2, 6, dtype=F64), -torch.rand(2, 3, dtype=F64),
            torch.randn(1, 3, 6, dtype=F64), torch.randn(1, 3, 6, dtype=F64))
    h0 = torch.randn(2, 2, 3, dtype=F64)
    got = ops.packed_selective_scan(*args, position_ids=pos, initial_state=h0)
    want = ops.packed_selective_scan(*args, position_ids=pos, initial_state=h0,
                                     has_initial_state=torch.ones(2, dtype=torch.bool))
    assert torch.equal(got, want) and not torch.equal(got, ops.packed_selective_scan(*args, position_ids=pos))
    c0 = torch.randn(2, 2, 3, dtype=F64)
    w = torch.randn(2, 4, dtype=F64)
    got = ops.packed_causal_conv1d(args[0], w, position_ids=pos, initial_state=c0)
    want = ops.packed_causal_conv1d(args[0], w, position_ids=pos, initial_state=c0,
                                    has_initial_state=torch.ones(2, dtype=torch.bool))
    assert torch.equal(got, want)
    f = torch.compile(lambda *a: ops.packed_selective_scan(*a, position_ids=pos, output_final_state=True)[1],
                      backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="needs the number of sequences"):
        f(*args)
    g = torch.compile(lambda *a: ops.packed_selective_scan(
        *a, position_ids=pos, has_initial_state=torch.zeros(2, dtype=torch.bool), output_final_state=True)[1],
        backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(g(*args), ops.packed_selective_scan(*args, position_ids=pos,
                                                                   output_final_state=True)[1])
