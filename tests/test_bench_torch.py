"""The PyTorch eager peer (mtpkern/bench_torch.py) on CPU torch: its device argument, the
backend arrays it shares through DLPack (what benchmarks/gpu_bench.py hands it on the
device: BF16 as uint16 bits), and its step timer. Skipped without torch."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mtpkern.backends import get_backend  # noqa: E402
from mtpkern.bench_torch import TorchMtp, as_torch, module_weights, step_timer, torch_device  # noqa: E402
from mtpkern.weights import load_weights  # noqa: E402


def test_torch_device_names_what_it_refuses():
    assert torch_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device: expected 'cpu' or 'cuda"):
        torch_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch.cuda.is_available"):
            torch_device("cuda")


def test_as_torch_shares_memory_and_views_bf16_bits():
    bits = np.array([[0x3F80, 0xC000, 0x0001], [0x7F80, 0x4049, 0x8000]], np.uint16)   # 1, -2, tiny, inf, 3.14, -0
    t = as_torch(bits)
    assert t.dtype == torch.bfloat16 and t.shape == (2, 3)
    assert np.array_equal(t.view(torch.int16).numpy().view(np.uint16), bits)
    assert t[0, 0].item() == 1.0 and t[0, 1].item() == -2.0 and t[1, 0].item() == float("inf")
    bits[0, 0] = 0x4000                                      # shared, not copied
    assert t[0, 0].item() == 2.0
    f = np.arange(6, dtype=np.float32)[::2]                   # strided
    tf = as_torch(f)
    assert tf.dtype == torch.float32 and tf.tolist() == [0.0, 2.0, 4.0]
    ro = np.ones(3, np.float32)
    ro.flags.writeable = False                                # DLPack cannot export it: a copy
    assert as_torch(ro).tolist() == [1.0, 1.0, 1.0]


def test_module_weights_from_backend_arrays_match_the_checkpoint_peer(tiny_ckpt, tiny_cfg):
    """The cpu backend holds BF16 as uint16 bits, as CuPy does on the device: converted by
    module_weights they are bit for bit the tensors the checkpoint peer loads, the shared
    embedding stays one tensor, and both peers draft the same tokens."""
    mods = load_weights(tiny_ckpt, tiny_cfg, get_backend("cpu")).modules
    assert mods[0].w_qkv.dtype == np.uint16
    tw = module_weights(mods, torch.bfloat16, "cpu")
    assert tw[0].w_qkv.dtype == torch.bfloat16 and tw[0].enorm.dtype == torch.float32
    assert (tw[0].embed is tw[1].embed) == (mods[0].embed is mods[1].embed)
    ref = TorchMtp.from_checkpoint(tiny_ckpt, tiny_cfg, torch.bfloat16, device="cpu")
    assert torch.equal(tw[0].w_qkv.view(torch.int16), ref.w[0].w_qkv.view(torch.int16))
    peer = TorchMtp(tiny_cfg, tw, torch.bfloat16, device="cpu")
    B, H, D, Hkv, L = 3, tiny_cfg.hidden_size, tiny_cfg.head_dim, tiny_cfg.num_key_value_heads, 5
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, tiny_cfg.vocab_size, (B,), generator=g)
    h = torch.randn(B, H, generator=g).to(torch.bfloat16)
    kv = torch.randn(2, B, L + 1, Hkv, D, generator=g).to(torch.bfloat16)
    pos = torch.full((B,), L)
    out = [p.module(0, tok, h, pos, kv[0].clone(), kv[1].clone(), L) for p in (peer, ref)]
    assert torch.equal(out[0][1], out[1][1]) and torch.equal(out[0][0], out[1][0])


def test_module_weights_refuses_a_bad_device(tiny_ckpt, tiny_cfg):
    mods = load_weights(tiny_ckpt, tiny_cfg, get_backend("numpy")).modules
    with pytest.raises(ValueError, match="device"):
        module_weights(mods, torch.float32, "metal")
    with pytest.raises(ValueError, match="modules: expected"):
        TorchMtp(tiny_cfg, module_weights(mods[:1], torch.float32), torch.float32)


def test_step_timer_runs_every_step_on_the_device(tiny_ckpt, tiny_cfg):
    """One timing per call, of `runs` steps after `warmup`; the hook runs before each step
    (the GPU benchmark's L2 flush), untimed; k is checked against the modules."""
    mods = load_weights(tiny_ckpt, tiny_cfg, get_backend("numpy")).modules
    peers = [TorchMtp(tiny_cfg, module_weights(mods, dt, "cpu"), dt, "cpu") for dt in (torch.bfloat16, torch.float32)]
    calls = []
    time_step = step_timer(peers, before=lambda: calls.append(1))
    t = time_step(2, 4, 1, 3, context=40)
    assert t.runs == 3 and 0 < t.p20_us <= t.median_us <= t.p80_us
    assert len(calls) == 2 * (1 + 3)                          # both peers, warm-up included
    with pytest.raises(ValueError, match="k: expected 1 .. 3"):
        time_step(4, 1, 0, 1)
    with pytest.raises(ValueError, match="peers"):
        step_timer([])
