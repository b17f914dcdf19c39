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


# -- objects an engine may hand over that are neither NumPy nor CuPy --------------------------

class HostTensor:
    """A framework's host tensor seen only through DLPack: ``__dlpack__`` and
    ``__dlpack_device__``, no ``shape``, no ``__array__`` (what NumPy alone cannot read)."""

    def __init__(self, a):
        self._a = np.asarray(a)

    def __dlpack__(self, stream=None, **kw):
        return self._a.__dlpack__()

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


class CudaDlpack(HostTensor):
    """A DLPack tensor that says it lives on CUDA device 0 (its capsule, read only for its
    shape, is the host array's)."""

    def __dlpack_device__(self):
        return (dlpack.KDL_CUDA, 0)


class CudaArrayInterface:
    """A Numba-style device array: only ``__cuda_array_interface__`` and a shape."""

    def __init__(self, shape, typestr="<f4"):
        self.shape = tuple(shape)
        self.__cuda_array_interface__ = {"shape": self.shape, "typestr": typestr, "data": (1 << 40, False),
                                         "version": 3, "strides": None}


def test_host_array_and_shape_without_a_framework():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    got = dlpack.host_array("x", HostTensor(a))
    assert np.shares_memory(got, a) and np.array_equal(got, a)          # zero-copy
    assert dlpack.shape(HostTensor(a)) == (3, 4)
    assert dlpack.shape(CudaArrayInterface((2, 5))) == (2, 5)
    assert dlpack.shape([[1, 2, 3]]) == (1, 3)
    for dev, where in ((CudaDlpack(a), "CUDA device 0"), (CudaArrayInterface((3, 4)), "__cuda_array_interface__")):
        with pytest.raises(TypeError, match=f"x: got a {type(dev).__name__} on .*{where}.*copy it to the host"):
            dlpack.host_array("x", dev)


@pytest.mark.parametrize("backend", ["numpy", "cpu"])
def test_host_backends_take_dlpack_arguments(make_prop, backend):
    """Hiddens, token ids and grammar masks given as host DLPack tensors draft what the same
    NumPy arrays draft; device ones are refused naming the argument and the device, and the
    refused call changes nothing."""
    rng = np.random.default_rng(3)
    props = [make_prop("exact", backend=backend) for _ in range(2)]
    H, V = props[0].config.hidden_size, props[0].config.vocab_size
    toks = rng.integers(0, V, 6).astype(np.int32)
    hid = rng.standard_normal((7, H)).astype(np.float32)
    mask = np.full((V + 31) // 32, -1, np.int32)
    mask[0] = 0                                                          # tokens 0..31 not allowed
    runs = []
    for prop, wrap in zip(props, (lambda a: a, HostTensor)):
        st = prop.alloc_state()
        prop.prefill_drafter(wrap(toks), wrap(hid[:6]), st)
        d = prop.propose(int(toks[-1]), wrap(hid[5]), 6, 2, st, grammar_bitmask=wrap(mask))
        prop.after_verify(1, st)
        prop.catchup_drafter(wrap(np.asarray(d[:1], np.int32)), wrap(hid[6:7]), st)
        d2 = prop.propose(int(toks[0]), wrap(hid[6:7]), 8, 2, st)     # a [1, H] hidden
        runs.append((d, d2, prop.drafter_rows(st)))
        if wrap is HostTensor:
            prop.after_verify(0, st)
            rows = prop.drafter_rows(st)
            for kw, arg in (({"target_hidden": CudaDlpack(hid[7 - 1])}, "target_hidden"),
                            ({"target_hidden": CudaArrayInterface((H,))}, "target_hidden"),
                            ({"grammar_bitmask": CudaArrayInterface(mask.shape, "<i4")}, "grammar_bitmask")):
                args = dict(last_token=int(toks[1]), target_hidden=hid[6], position=8, num_drafts=2, state=st)
                args.update(kw)
                with pytest.raises(TypeError, match=f"{arg}: got a .* on .*CUDA.*on the host"):
                    prop.propose(**args)
                assert prop.drafter_rows(st) == rows
            with pytest.raises(TypeError, match="hiddens: got a CudaDlpack on CUDA device 0"):
                prop.catchup_drafter([int(toks[1])], CudaDlpack(hid[6:7]), st)
            with pytest.raises(TypeError, match="tokens: got a CudaDlpack on CUDA device 0"):
                prop.catchup_drafter(CudaDlpack(toks[:1]), hid[6:7], st)
            assert prop.drafter_rows(st) == rows
    assert runs[0] == runs[1]
    assert all(t >= 32 for t in runs[0][0])                              # the mask was read
