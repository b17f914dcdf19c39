"""mtpkern.backends.dlpack: reading DLPack capsules without a framework (for BF16,
which NumPy cannot import and CuPy 13 crashes on). The reader is the same for host
and device tensors; host tensors (PyTorch CPU, when importable) test it here, the
device path runs in tests/test_gpu.py."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

from mtpkern.backends import dlpack, get_backend
from mtpkern.backends.base import on_cuda_device


def test_numpy_arrays_read_back():
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    for x in (a, a[1:], a[:, 2:5], a.T):
        info = dlpack.export(x)
        assert (info.device_type, info.code, info.bits, info.lanes) == (dlpack.KDL_CPU, dlpack.KDL_FLOAT, 32, 1)
        assert info.ptr == x.ctypes.data and info.shape == x.shape
        assert info.strides in (None, x.strides)
    assert dlpack.host_bfloat16(a) is None                 # FP32: not this reader's business
    assert not on_cuda_device(a)


def test_torch_bfloat16_host_tensors():
    torch = pytest.importorskip("torch")
    t = torch.randn(5, 8).to(torch.bfloat16)
    for x in (t, t[1:], t[:, 1:7], t.T, t[::2]):
        info = dlpack.export(x)
        assert info.is_bfloat16 and info.ptr == x.data_ptr() and info.shape == tuple(x.shape)
        got = dlpack.host_bfloat16(x)
        assert got.dtype == np.float32 and np.array_equal(got, x.float().numpy())
    view = np.asarray(dlpack.uint16_view(dlpack.export(t)))
    del t
    gc.collect()                                           # the view's capsule keeps the memory alive
    assert view.dtype == np.uint16 and view.shape == (5, 8)
    assert not on_cuda_device(torch.zeros(2))


def test_host_backends_take_torch_bfloat16():
    torch = pytest.importorskip("torch")
    be = get_backend("numpy")
    t = torch.randn(3, 16).to(torch.bfloat16)
    got = be.ingest_float("hiddens", t)
    assert np.array_equal(got, t.float().numpy())
    assert np.array_equal(be.ingest_float("hiddens", t.float()), t.float().numpy())
    with pytest.raises(TypeError, match="hiddens: expected dtype float32 or bfloat16, got int64"):
        be.ingest_float("hiddens", torch.zeros(3, 16, dtype=torch.int64))


def test_host_bf16_numpy():
    be = get_backend("numpy")
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(ml_dtypes.bfloat16)
    assert np.array_equal(be.ingest_float("h", x), x.astype(np.float32))
