"""GPU tests of ``check_isolation`` (marked ``gpu``: skipped without CUDA; the tests of mamba-ssm's models skip
without mamba_ssm): it must not cry wolf on converted mamba-ssm LMs, and must still catch real leaks.

- converted 4-layer MambaLMHeadModel (d_model 256, fp32, our Mamba-1 kernels): default mode ok with the noise
  floor measured and reported (the scan's dB/dC backward adds with atomics); deterministic mode exactly 0;
- converted 2-layer Mamba-2 LM (mamba-ssm's chunked Triton kernels with seq_idx): ok, classified as rounding;
- the same models called without boundaries, a plain nn.Conv1d over the row and a 1e-3 leak of another
  sequence's state are leaks.

Run with ``-s`` to see the reports (the seed replays with PACKLOADER_TEST_SEED).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ops import PackedMamba, check_isolation, enable_packing

from ._helpers import positions

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
ROWS = [[50, 1, 3, 74], [100, 28], [128]]


@pytest.fixture
def mamba_ssm(cuda):
    return pytest.importorskip("mamba_ssm", exc_type=ImportError)


def make_lm(layer: str, n_layer: int):
    from mamba_ssm.models.config_mamba import MambaConfig
    from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

    ssm_cfg = {"layer": "Mamba2", "d_state": 64, "headdim": 64} if layer == "Mamba2" else {"d_state": 16}
    cfg = MambaConfig(d_model=256, n_layer=n_layer, vocab_size=1000, ssm_cfg=ssm_cfg, rms_norm=True,
                      fused_add_norm=True, residual_in_fp32=True, pad_vocab_size_multiple=8)
    return MambaLMHeadModel(cfg, device=DEVICE, dtype=torch.float32)


def lm_batch():
    return {"input_ids": torch.randint(0, 1000, (3, 128), device=DEVICE), "position_ids": positions(ROWS).to(DEVICE)}


def packed(model):
    return lambda b: model(b["input_ids"], position_ids=b["position_ids"])


def show(name, rep):
    print(f"{name}: {rep!r}\n{rep}")


def test_converted_mamba1_lm_default_mode_reports_the_floor(seed, mamba_ssm):
    model = enable_packing(make_lm("Mamba1", 4))
    batch = lm_batch()
    assert not torch.are_deterministic_algorithms_enabled()
    rep = check_isolation(packed(model), batch, max_targets=4)
    show("Mamba-1 LM, default mode", rep)
    assert rep.ok and rep.grads_checked and not rep.deterministic and rep.atol is None, str(rep)
    assert rep.classification in ("none", "rounding") and not rep.leaks
    assert rep.max_output_change == 0.0  # the forward kernels isolate exactly
    assert rep.grad_floor is not None and rep.grad_limit == 4 * rep.grad_floor
    assert f"grad_floor={rep.grad_floor:.3e}" in repr(rep) and f"max_grad_change={rep.max_grad_change:.3e}" in repr(rep)
    # the model without boundaries is caught
    leaky = check_isolation(lambda b: model(b["input_ids"]), batch, max_targets=2)
    show("Mamba-1 LM without boundaries", leaky)
    assert not leaky.ok and leaky.classification == "leak"


def test_converted_mamba1_lm_deterministic_mode_is_exactly_zero(seed, mamba_ssm):
    model = enable_packing(make_lm("Mamba1", 4))
    batch = lm_batch()
    rep = check_isolation(packed(model), batch, max_targets=4, deterministic=True)
    show("Mamba-1 LM, deterministic mode", rep)
    assert rep.ok and rep.deterministic and rep.classification == "none", str(rep)
    assert rep.output_floor == 0.0 and rep.grad_floor == 0.0 and rep.output_limit == rep.grad_limit == 0.0
    assert rep.max_output_change == 0.0 and rep.max_grad_change == 0.0
    assert not torch.are_deterministic_algorithms_enabled()  # turned on for the check only
    # the same through torch's own switch
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        again = check_isolation(packed(model), batch, max_targets=2)
    finally:
        torch.use_deterministic_algorithms(False)
    assert again.deterministic and again.max_output_change == 0.0 and again.max_grad_change == 0.0, str(again)


def test_converted_mamba2_lm_is_rounding_not_a_leak(seed, mamba_ssm):
    model = enable_packing(make_lm("Mamba2", 2))
    batch = lm_batch()
    rep = check_isolation(packed(model), batch, max_targets=4)
    show("Mamba-2 LM, default mode", rep)
    assert rep.ok and rep.classification == "rounding" and not rep.leaks, str(rep)
    assert rep.max_output_change > 0  # the chunk scan's rounding shows, and is told from a leak
    leaky = check_isolation(lambda b: model(b["input_ids"]), batch, max_targets=2)
    show("Mamba-2 LM without boundaries", leaky)
    assert not leaky.ok and leaky.classification == "leak"


def hidden_batch(dtype=torch.float32):
    rows = [[6, 1, 5, 20], [12, 20]]
    return {"hidden_states": torch.randn(2, 32, 64, device=DEVICE, dtype=dtype),
            "position_ids": positions(rows).to(DEVICE)}


def test_leaky_layers_are_caught_on_the_gpu(seed, cuda):
    batch = hidden_batch()
    conv = nn.Conv1d(64, 64, 4, groups=64, padding=3, device=DEVICE)  # causal over the whole row

    def plain_conv(b):
        x = b["hidden_states"]
        return conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)

    rep = check_isolation(plain_conv, batch)
    show("plain conv", rep)
    assert not rep.ok and rep.classification == "leak"

    layer = PackedMamba(64, d_state=16, device=DEVICE)
    plain = PackedMamba(64, d_state=16, device=DEVICE)
    safe = check_isolation(lambda b: layer(b["hidden_states"], position_ids=b["position_ids"]), batch)
    show("PackedMamba", safe)
    assert safe.ok and safe.max_output_change == 0.0, str(safe)
    tiny = check_isolation(
        lambda b: layer(b["hidden_states"], position_ids=b["position_ids"]) + 1e-3 * plain(b["hidden_states"]), batch)
    show("PackedMamba + 1e-3 of a layer without boundaries", tiny)
    assert not tiny.ok and tiny.classification == "leak"
