"""Safetensors loading of MTP modules, and synthetic checkpoints.

Module ``m`` is stored like a decoder layer appended after the target's
layers, under ``model.layers.{num_hidden_layers + m}.`` (docs/model.md).
Loading reads only the keys the drafter needs (lazily, through the shard
index when the checkpoint is sharded), checks every shape and dtype, and
hands each tensor to the backend's ``prepare_weight`` / ``prepare_vector``.

Layouts prepared at load time (one pass over memory per op later):

- ``w_qkv [(Hq + 2 Hkv) D, H]``: q, k and v projections stacked (bias likewise);
- ``w13 [2I, H]`` / ``[E, 2I, H]``: gate rows over up rows (dense, shared, routed);
- ``w2 [H, I]`` / ``[E, H, I]``: down projections.

The ``[V, H]`` embedding and LM-head matrices fall back to the target's
``model.embed_tokens.weight`` / ``lm_head.weight`` and are held once however
many modules (or keys with identical contents) refer to them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy; safetensors needs it for BF16)
import numpy as np

from .block import BlockSpec
from .config import MtpConfig
from .errors import CheckpointError, ConfigError
from .files import INDEX_JSON_CAP, check_member_name, read_json, require_regular_file
from .models import Family, family
from .ops.mla import split_kv_b_proj
from .quant import FP4_BLOCK, NVFP4_BLOCK, Fp4Weight, Fp8Weight, nan_codes, rope_first_order, take_units
from .shard import Shard

BF16 = np.dtype(ml_dtypes.bfloat16)
#: safetensors dtypes read through a map of the file: (stored as, viewed as)
_RAW = {"F8_E4M3": (np.uint8, ml_dtypes.float8_e4m3fn), "BF16": (np.uint16, BF16), "F32": (np.float32, np.float32),
        "F8_E8M0": (np.uint8, ml_dtypes.float8_e8m0fnu), "I8": (np.int8, np.int8), "U8": (np.uint8, np.uint8)}
_FLOAT_DTYPES = ("BF16", "F32")
_FP8 = "F8_E4M3"
#: safetensors dtypes its NumPy reader has no type for: read through ``_raw``
_RAW_ONLY = (_FP8, "F8_E8M0")
#: an FP8 weight's scales: FP32 / BF16, or E8M0 (DeepSeek-V4's ``scale_fmt: "ue8m0"``)
_FP8_SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")
#: the packed FP4 form of a projection (two E2M1 codes a byte; DeepSeek-V4 stores I8) and its scales
_FP4 = ("I8", "U8")
_FP4_SCALE_DTYPES = ("F8_E8M0", "U8")


def _is_projection(suffix: str) -> bool:
    """A module's projection weights: the GEMV operands an FP8 release quantizes
    (never the norms, the router's correction bias, the embedding or the LM head)."""
    return (suffix.endswith(("_proj.weight", "_proj_with_mqa.weight", "indexer.wq_b.weight", "indexer.wk.weight"))
            or suffix in ("mlp.gate.weight", GATE_UP, DOWN_PACKED))


def is_fp4(cfg: MtpConfig, suffix: str, dtype: str) -> bool:
    """A projection stored in the packed FP4 form under a config that announces it
    (``expert_quant == "fp4"``, DeepSeek-V4's ``expert_dtype: "fp4"``): loaded as an Fp4Weight."""
    return cfg.expert_quant == "fp4" and _is_projection(suffix) and dtype in _FP4


def fp4_scale_key(cfg: MtpConfig, rd: "CheckpointReader", key: str) -> str:
    """The checkpoint key of an FP4 weight's E8M0 scales: DeepSeek-V4's ``X.scale`` in its own
    layout (``Family.scale_dot_scale``), else ``weight_scale_inv`` (transformers' name for
    it), else ``weight_scale`` (vLLM's name for the experts')."""
    if family(cfg.family).scale_dot_scale:
        return family(cfg.family).scale_key(key, True)
    return key + "_scale" if rd.has(key + "_scale") and not rd.has(key + "_scale_inv") else key + "_scale_inv"


def scale_key(cfg: MtpConfig, key: str, rd: "CheckpointReader | None" = None) -> str:
    """The checkpoint key of an FP8 weight's scales: ``weight_scale_inv`` (block scales,
    DeepSeek-V3 / GLM FP8) or ``weight_scale`` (per-channel, compressed-tensors); DeepSeek-V4's
    ``X.scale`` in its family's layout (``Family.scale_key``). With ``rd``: block scales under
    ``weight_scale`` when the checkpoint has no ``weight_scale_inv`` (compressed-tensors'
    ``strategy: "block"`` names them so; both are the multiplier of the codes)."""
    k = family(cfg.family).scale_key(key, cfg.fp8_block != (0, 0))
    if rd is not None and k == key + "_scale_inv" and not rd.has(k) and rd.has(key + "_scale"):
        return key + "_scale"
    return k


def _canonical_scale_key(cfg: MtpConfig, key: str) -> str:
    """A scale's name in the canonical layout (what ``release_layout`` renames)."""
    return key + ("_scale_inv" if cfg.fp8_block != (0, 0) else "_scale")
#: tensors a container stores beside a projection that mtpkern reads and does not use: the
#: activations' scales (activations stay FP32)
_ACT_SCALES = ("input_global_scale", "input_scale")


@dataclass(frozen=True, slots=True)
class Stored:
    """How a container (``MtpConfig.quant_container``) stores one projection ``X.weight``:
    ``fmt`` "dense", "fp8" (E4M3 codes with FP32 / BF16 scales per channel or block, or E8M0
    scales per 32: MXFP8), "mxfp4" or "nvfp4"; the keys of its codes (or dense weight), scales
    and NVFP4 global scale; ``extra``: activation scales present, read by nothing."""

    fmt: str
    data: str
    scale: str = ""
    glob: str = ""
    extra: tuple = ()

    def keys(self) -> set[str]:
        return {k for k in (self.data, self.scale, self.glob, *self.extra) if k}


def present(rd: "CheckpointReader", key: str) -> bool:
    """A projection ``X.weight`` is in the checkpoint as itself or as compressed-tensors'
    packed ``X.weight_packed``."""
    return rd.has(key) or (key.endswith(".weight") and rd.has(key + "_packed"))


def ignored_by(cfg: MtpConfig, key: str) -> bool:
    """Whether the container's ``ignore`` (``exclude_modules``) names the module of ``key``:
    its name exactly, or a ``re:`` pattern matching it from the start (compressed-tensors' rule)."""
    name = key[:-len(".weight")] if key.endswith(".weight") else key
    for pat in cfg.quant_ignore:
        if pat.startswith("re:"):
            try:
                if re.match(pat[3:], name):
                    return True
            except re.error:
                continue
        elif pat == name:
            return True
    return False


def stored_form(cfg: MtpConfig, rd: "CheckpointReader", key: str) -> Stored | None:
    """How the container stores projection ``key``, from its tensors (None without a container).
    Refused, naming the tensor: a format the config does not announce, a missing scale, a scale
    of another dtype than the format's."""
    if not cfg.quant_container or not key.endswith(".weight"):
        return None
    base = key[:-len("weight")]
    extra = tuple(base + a for a in _ACT_SCALES if rd.has(base + a))
    where = f"tensor {key!r} in the checkpoint at {rd.path}"

    def announced(fmt: str, what: str) -> None:
        ok = fmt in cfg.quant_formats or (fmt == "fp8" and cfg.weight_quant == "fp8" and cfg.fp8_block != (1, 32))
        if not ok:
            raise CheckpointError(f"{where}: stored as {what}, a format its config does not announce "
                                  f"({cfg.quant_container} formats {list(cfg.quant_formats)}"
                                  f"{', fp8' if cfg.weight_quant == 'fp8' else ''})")

    def need(k: str, what: str) -> str:
        if not rd.has(k):
            raise CheckpointError(f"tensor {k!r} is missing from the checkpoint at {rd.path}: the {what} of the "
                                  f"weight {key!r} ({cfg.quant_container})")
        return k

    if cfg.quant_container == "compressed-tensors" and rd.has(key + "_packed"):
        sk = need(key + "_scale", "scales")
        sdt = rd.info(sk)[1]
        if sdt == _FP8:
            announced("nvfp4", "NVFP4 (E4M3 scales)")
            return Stored("nvfp4", key + "_packed", sk, need(key + "_global_scale", "NVFP4 global scale"), extra)
        if sdt in _FP4_SCALE_DTYPES:
            announced("mxfp4", "MXFP4 (E8M0 scales)")
            return Stored("mxfp4", key + "_packed", sk, "", extra)
        raise CheckpointError(f"tensor {sk!r} in {rd.file_of(sk)}: expected dtype F8_E4M3 (NVFP4) or F8_E8M0 / U8 "
                              f"(MXFP4), got {sdt}")
    if not rd.has(key):
        return Stored("dense", key, "", "", extra)
    dt = rd.info(key)[1]
    if cfg.quant_container == "modelopt" and dt in _FP4:
        announced("nvfp4", "NVFP4")
        return Stored("nvfp4", key, need(key + "_scale", "scales"), need(key + "_scale_2", "NVFP4 global scale"), extra)
    if dt == _FP8:
        if cfg.quant_container == "modelopt":
            raise CheckpointError(f"{where}: an FP8 weight under ModelOpt (per-tensor scales) is not supported; "
                                  f"expected NVFP4 or a dense weight")
        sk = need(key + "_scale", "scales")
        announced("mxfp8" if rd.info(sk)[1] in _FP4_SCALE_DTYPES else "fp8",
                  "MXFP8 (E8M0 scales)" if rd.info(sk)[1] in _FP4_SCALE_DTYPES else "FP8 E4M3")
        return Stored("fp8", key, sk, "", extra)
    return Stored("dense", key, "", "", extra)


_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointReader:
    """Lazy access to tensors of a single-file or sharded safetensors checkpoint.

    With ``model.safetensors.index.json`` the index says which file holds each key;
    its file names must lie inside the directory (``files.check_member_name``).
    Without one, every ``*.safetensors`` file is read and a key held by two files is
    refused: file-name order would otherwise decide silently which copy loads."""

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self._safe_open = safe_open
        self.path = Path(path)
        if not self.path.is_dir():
            what = "is a file, expected the directory that holds it" if self.path.exists() else "not found"
            raise CheckpointError(f"checkpoint directory {os.fspath(path)!r}: {what}")
        index = self.path / _INDEX
        # lexists: a dangling index symlink is an error to report, not a missing index
        self._key_file = self._index_map(index) if os.path.lexists(index) else self._scan_files()
        self._handles: dict[Path, Any] = {}
        self._headers: dict[Path, tuple[dict, int]] = {}
        self._abs_max: dict[str, float] = {}

    def _index_map(self, index: Path) -> dict[str, Path]:
        body = read_json(index, INDEX_JSON_CAP, CheckpointError)
        weight_map = body.get("weight_map") if isinstance(body, dict) else None
        if not isinstance(weight_map, dict):
            got = type(weight_map).__name__ if isinstance(body, dict) else f"a JSON {type(body).__name__}"
            raise CheckpointError(f"{index}: not a valid safetensors index: expected an object whose "
                                  f"'weight_map' is an object of tensor -> file name, got {got}")
        files: dict[str, Path] = {}    # each distinct file name is judged once
        key_file = {}
        for key, fname in weight_map.items():
            f = files.get(fname) if isinstance(fname, str) else None
            if f is None:
                check_member_name(fname, f"{index}: weight_map[{key!r}]", CheckpointError)
                f = files[fname] = self.path / fname
            key_file[key] = f
        return key_file

    def _scan_files(self) -> dict[str, Path]:
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{self.path}: no {_INDEX} and no *.safetensors file")
        key_file: dict[str, Path] = {}
        for f in files:
            for key in self._open(f).keys():
                if key in key_file:
                    raise CheckpointError(f"{self.path}: tensor {key!r} is in both {key_file[key].name} and "
                                          f"{f.name}; without {_INDEX} nothing says which one to load")
                key_file[key] = f
        return key_file

    def _open(self, f: Path):
        if not os.path.exists(f):
            if os.path.lexists(f):
                raise CheckpointError(f"{f}: a symlink to nothing (its target {os.readlink(f)!r} does not exist)")
            raise CheckpointError(f"{f}: shard listed in the index does not exist")
        require_regular_file(f, CheckpointError)
        try:
            return self._safe_open(os.fspath(f), framework="np")
        except Exception as e:  # safetensors raises its own error types for bad headers
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from None

    def _handle(self, key: str):
        f = self._key_file[key]
        h = self._handles.get(f)
        if h is None:
            h = self._handles[f] = self._open(f)
        return h

    def keys(self) -> Iterable[str]:
        return self._key_file.keys()

    def has(self, key: str) -> bool:
        return key in self._key_file

    def keys_under(self, prefix: str) -> list[str]:
        """Every key starting with ``prefix`` (e.g. one module's ``model.layers.46.``)."""
        return [k for k in self._key_file if k.startswith(prefix)]

    def file_of(self, key: str) -> Path:
        return self._key_file[key]

    def info(self, key: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string) without reading the data."""
        if key not in self._key_file:
            raise CheckpointError(f"tensor {key!r} is missing from the checkpoint at {self.path}")
        try:
            sl = self._handle(key).get_slice(key)
            return tuple(int(s) for s in sl.get_shape()), str(sl.get_dtype())
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"tensor {key!r} in {self.file_of(key)}: unreadable ({e})") from None

    def get(self, key: str, shape: tuple[int, ...], dtypes: tuple[str, ...] = _FLOAT_DTYPES,
            rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> np.ndarray:
        """Read ``key`` after checking its shape and dtype against the expectation; ``rows`` /
        ``cols``: only that range of its first / second dimension is read (a rank's shard)."""
        got_shape, got_dtype = self.info(key)
        where = f"tensor {key!r} in {self.file_of(key)}"
        if got_dtype in _FP4 and got_dtype not in dtypes:        # checked first: its shape is half the weight's
            raise CheckpointError(f"{where}: expected dtype {' or '.join(dtypes)}, got {got_dtype} (packed FP4 "
                                  f"reads as such only under expert_dtype 'fp4': docs/fp4.md)")
        if got_shape != tuple(shape):
            raise CheckpointError(f"{where}: expected shape {list(shape)}, got {list(got_shape)}")
        if got_dtype not in dtypes:
            raise CheckpointError(f"{where}: expected dtype {' or '.join(dtypes)}, got {got_dtype}")
        index = _index(got_shape, rows, cols)
        try:
            if got_dtype in _RAW_ONLY or isinstance(rows, np.ndarray):
                a = self._raw(key, got_dtype, index)
            elif index is None:
                a = self._handle(key).get_tensor(key)
            else:
                a = self._handle(key).get_slice(key)[index]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{where}: corrupt or truncated ({e})") from None
        if got_dtype in _FLOAT_DTYPES and not _all_finite(a):
            raise CheckpointError(f"{where}: holds NaN or infinite values")
        return a

    def abs_max(self, key: str) -> float:
        """max |w| over the whole of the dense tensor ``key`` as stored (inf or NaN when it holds
        one): read through a map of the file whatever rows a load takes, so every rank of a
        sharded head gets the same value; once per key (``abs_max_bits``)."""
        if key not in self._abs_max:
            shape, dt = self.info(key)
            f = self._key_file[key]
            header, base = self._header(f)
            b, e = header[key]["data_offsets"]
            if dt not in _MAGNITUDE:
                raise CheckpointError(f"tensor {key!r} in {f}: expected dtype {' or '.join(_MAGNITUDE)}, got {dt}")
            store = np.dtype(_MAGNITUDE[dt][0]).newbyteorder("<")
            n = int(np.prod(shape, dtype=np.int64))
            if e - b != n * store.itemsize or os.path.getsize(f) < base + e:
                raise CheckpointError(f"tensor {key!r} in {f}: truncated ({e - b} bytes for shape {list(shape)} {dt}, "
                                      f"or the file ends before its data)")
            mm = np.memmap(f, store, "r", offset=base + b, shape=(n,)) if n else np.zeros(0, store)
            self._abs_max[key] = abs_max_bits(mm, dt)
        return self._abs_max[key]

    def _raw_fp8(self, key: str, index: tuple | None = None) -> np.ndarray:
        return self._raw(key, _FP8, index)

    def _raw(self, key: str, dtype: str, index: tuple | None = None) -> np.ndarray:
        """A tensor's bytes read straight from the file at the header's offsets: an
        ``F8_E4M3`` one as ``float8_e4m3fn`` (safetensors' NumPy reader has no FP8 dtype), or
        any of ``_RAW`` with ``index`` (only those rows / columns, an array of rows included,
        through a read-only map of the file)."""
        f = self._key_file[key]
        header, base = self._header(f)
        info = header.get(key)
        b, e = info["data_offsets"]
        shape = [int(x) for x in info["shape"]]
        store, view = _RAW[dtype]
        if e - b != int(np.prod(shape, dtype=np.int64)) * np.dtype(store).itemsize:
            raise CheckpointError(f"tensor {key!r} in {f}: {e - b} bytes for shape {shape} {dtype}")
        if index is not None:
            if os.path.getsize(f) < base + e:
                raise CheckpointError(f"tensor {key!r} in {f}: truncated (the file ends before its data)")
            mm = np.memmap(f, np.dtype(store).newbyteorder("<"), "r", offset=base + b, shape=tuple(shape))
            return np.array(mm[index]).astype(store, copy=False).view(view)
        with open(f, "rb") as fh:
            fh.seek(base + b)
            buf = fh.read(e - b)
        if len(buf) != e - b:
            raise CheckpointError(f"tensor {key!r} in {f}: truncated ({len(buf)} of {e - b} bytes)")
        return np.frombuffer(buf, np.dtype(store).newbyteorder("<")).astype(store).reshape(shape).view(view)

    def _header(self, f: Path) -> tuple[dict, int]:
        """(the safetensors JSON header, the offset of the data) of file ``f``, read once."""
        cached = self._headers.get(f)
        if cached is None:
            with open(f, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if not 0 < n <= 100 << 20:                        # safetensors caps its header at 100 MB
                    raise CheckpointError(f"{f}: safetensors header of {n} bytes")
                cached = self._headers[f] = (json.loads(fh.read(n)), 8 + n)
        return cached


def _index(shape: tuple[int, ...], rows: Any, cols: tuple[int, int] | None) -> tuple | None:
    """The NumPy index of a tensor's ``rows`` (a range, or an array of rows) / ``cols`` range
    (None: the whole tensor)."""
    if rows is None and cols is None:
        return None
    if cols is not None and len(shape) < 2:
        raise ValueError(f"cols: a tensor of shape {list(shape)} has no second dimension")
    r = rows if isinstance(rows, np.ndarray) else slice(*rows) if rows is not None else slice(None)
    return (r,) if cols is None else (r, slice(*cols))


def _fp8_scale_slice(scale: np.ndarray, block: tuple[int, int] | None, rows: tuple[int, int] | None,
                     cols: tuple[int, int] | None, shape: tuple[int, ...], key: str) -> np.ndarray:
    """The scales of an FP8 weight's ``rows`` / ``cols`` (whole scale blocks only: a block
    cannot be cut, so a shard boundary must fall on one)."""
    N, K = shape
    if block is None:                                # per output channel: rows only
        return scale if rows is None else scale[rows[0]:rows[1]]
    bn, bk = block
    for name, rng, b, full in (("rows", rows, bn, N), ("columns", cols, bk, K)):
        if rng is not None and (rng[0] % b or (rng[1] % b and rng[1] != full)):
            raise CheckpointError(f"tensor {key!r}: a shard of {name} {rng[0]}:{rng[1]} cuts its FP8 scale "
                                  f"blocks of {b}; shard where the blocks allow (docs/distributed.md)")
    if rows is not None:
        scale = scale[rows[0] // bn: -(-rows[1] // bn)]
    if cols is not None:
        scale = scale[:, cols[0] // bk: -(-cols[1] // bk)]
    return scale


def _row_slice(w: Any, a: int, b: int) -> Any:
    """Rows ``a:b`` of a projection (dense, or FP8 with its scales: block scales only
    at block boundaries, since a block cannot be cut)."""
    if isinstance(w, Fp4Weight):                     # per-row scales: any rows
        return w.rows(a, b)
    if not isinstance(w, Fp8Weight):
        return w[a:b]
    if w.block is None:
        return Fp8Weight(w.data[a:b], w.scale[a:b], None)
    bn = w.block[0]
    if a % bn or (b % bn and b != w.shape[-2]):
        raise CheckpointError(f"an FP8 projection cannot be split at rows {a}:{b}: its scale blocks are {bn} rows")
    return Fp8Weight(w.data[a:b], w.scale[a // bn: -(-b // bn)], w.block)


def join_cols(a: Any, b: Any, what: str) -> Any:
    """Projections ``[N, Ka]`` and ``[N, Kb]`` joined along K (DeepSeek-V4's e_proj | h_proj):
    dense ones (BF16 when both are, else FP32), or FP8 ones with block scales of one block
    whose ``bk`` divides ``Ka`` (the scale blocks stay whole); anything else is refused,
    naming ``what``."""
    kinds = {_kind(a), _kind(b)}
    if kinds == {"dense"}:
        dt = BF16 if a.dtype == BF16 and b.dtype == BF16 else np.float32
        return np.concatenate([a.astype(dt, copy=False), b.astype(dt, copy=False)], axis=1)
    if kinds == {"FP8"} and a.block is not None and a.block == b.block and a.shape[-1] % a.block[1] == 0:
        return Fp8Weight(np.concatenate([a.data, b.data], axis=1), np.concatenate([a.scale, b.scale], axis=1), a.block)
    raise CheckpointError(f"{what}: cannot be joined into one projection: expected two dense weights, or two FP8 "
                          f"ones with one block whose columns divide the first's {a.shape[-1]}; got "
                          f"{_kind(a)} {getattr(a, 'block', '')} and {_kind(b)} {getattr(b, 'block', '')}")


def _kind(w: Any) -> str:
    """A projection's storage kind for messages: FP8, FP4 or dense."""
    return "FP8" if isinstance(w, Fp8Weight) else "FP4" if isinstance(w, Fp4Weight) else "dense"


def read_tensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint at ``path`` (FP8 ones as ``float8_e4m3fn``, E8M0 scales as
    ``float8_e8m0fnu``, packed FP4 ones as int8): for
    tests and tools; loading reads only what the modules need."""
    rd = CheckpointReader(path)
    out = {}
    for key in rd.keys():
        shape, dt = rd.info(key)
        out[key] = rd._raw(key, dt) if dt in _RAW_ONLY else rd._handle(key).get_tensor(key)
    return out


#: a BF16 / FP32 value's bits as an unsigned integer, the mask that clears its sign, the bits of +inf
_MAGNITUDE = {"BF16": (np.uint16, 0x7FFF, 0x7F80), "F32": (np.uint32, 0x7FFFFFFF, 0x7F800000)}


def abs_max_bits(bits: np.ndarray, dtype: str, chunk: int = 1 << 24) -> float:
    """max |w| of BF16 / FP32 values held as their raw bits (uint16 / uint32, any shape): with
    the sign bit cleared, the bits of non-negative floats order as their values (inf above
    every finite one, NaN above inf), so the largest masked integer is the largest magnitude:
    one vectorised integer pass, ``chunk`` elements at a time, nothing widened. 0.0 for no
    values; inf or NaN when one is there."""
    store, mask, inf_bits = _MAGNITUDE[dtype]
    flat = bits.reshape(-1).view(store)
    top = 0
    for i in range(0, flat.size, chunk):
        top = max(top, int((flat[i:i + chunk] & mask).max()))
    if top > inf_bits:
        return math.nan
    if dtype == "BF16":
        return float(np.array([top], np.uint16).view(BF16)[0])
    return float(np.array([top], np.uint32).view(np.float32)[0])


#: ``hidden_size * max|g| * max|W|`` (g a module's final norm as applied, W its LM head) must stay
#: below this, FLT_MAX / 4 (2^126), for every FP32 logit to be finite (docs/checkpoints.md)
LOGIT_BOUND = 2.0 ** 126


def _all_finite(a: np.ndarray, chunk: int = 1 << 24) -> bool:
    """Chunked, so a [V, H] BF16 matrix is not widened in one piece."""
    flat = a.reshape(-1)
    return all(np.isfinite(flat[i:i + chunk].astype(np.float32)).all() for i in range(0, flat.size, chunk))


@dataclass(slots=True, repr=False)
class ModuleWeights:
    """One module's prepared weights (backend arrays). Shapes in the module docstring."""

    embed: Any            # [V, H]  shared with other modules when identical
    head: Any             # [V, H]  shared likewise
    enorm: Any            # [H]
    hnorm: Any            # [H]
    eh_proj: Any          # [H, 2H]
    input_layernorm: Any  # [H]
    post_attention_layernorm: Any  # [H]
    w_qkv: Any            # [block.qkv_size, H]: q | k | v | gate rows (MLA: q_proj, or q_b_proj [.., q_lora_rank])
    b_qkv: Any | None     # [block.qkv_size]
    q_norm: Any | None    # [D]
    k_norm: Any | None    # [D]
    w_o: Any              # [H, Hq Dv] (None with a grouped output: w_o_a / w_o_b)
    shared_head_norm: Any  # [H]
    # MoE (when the module's block is)
    gate_w: Any | None = None        # [E, H]
    gate_bias: Any | None = None     # [E] FP32
    experts_w13: Any | None = None   # [E, 2I, H]
    experts_w2: Any | None = None    # [E, H, I]
    #: LatentMoE (moe_latent_size Lt > 0): the experts above are [E, 2I, Lt] / [E, Lt, I]
    latent_fc1: Any | None = None    # [Lt, H] fc1_latent_proj
    latent_fc2: Any | None = None    # [H, Lt] fc2_latent_proj
    latent_norm: Any | None = None   # [Lt] FP32 latent_norm (moe_latent_norm): of the experts' sum before fc2
    shared_w13: Any | None = None    # [2 I_s, H]
    shared_w2: Any | None = None     # [H, I_s]
    shared_gate: Any | None = None   # [1, H]: the shared output scaled by sigmoid(x . w) (shared_expert_gate)
    sinks: Any | None = None         # [Hq] FP32 attention sinks (attn_sinks)
    # dense MLP (when the module's block is not MoE)
    mlp_w13: Any | None = None       # [2I, H]
    mlp_w2: Any | None = None        # [H, I]
    # MLA (when the module's block is: mtpkern.ops.mla; L kv_lora_rank, R qk_rope_head_dim)
    mla_kv_a: Any | None = None      # [L + R (+ Hq Dv), H] kv_a_proj_with_mqa (| g_proj: an element-wise gate)
    mla_kv_a_norm: Any | None = None  # [L] kv_a_layernorm
    mla_q_a: Any | None = None       # [q_lora_rank, H] q_a_proj (None: q_proj, in w_qkv)
    mla_q_a_norm: Any | None = None  # [q_lora_rank] q_a_layernorm
    mla_uk: Any | None = None        # [Hq, P, L] kv_b_proj's key rows per head
    mla_uv: Any | None = None        # [Hq, Dv, L] kv_b_proj's value rows per head
    # DSA (when the block runs the indexer: mtpkern.ops.dsa; Hi index_n_heads, Di index_head_dim)
    idx_wq_b: Any | None = None      # [Hi Di, q_lora_rank] indexer.wq_b
    idx_wk: Any | None = None        # [Di, H] indexer.wk
    idx_k_norm_w: Any | None = None  # [Di] FP32 indexer.k_norm.weight (a LayerNorm)
    idx_k_norm_b: Any | None = None  # [Di] FP32 indexer.k_norm.bias
    idx_weights: Any | None = None   # [Hi, H] indexer.weights_proj
    idx_gate: Any | None = None      # [Di, H] indexer.index_kpool_compress_gate (a pooled indexer)
    idx_ape: Any | None = None       # [P, Di] FP32 indexer.index_kpool_compress_ape
    # hyper-connections (hc_mult m > 1: mtpkern.ops.hc): (fn, base, scale) of the attention's,
    # the FFN's and the LM head's collapse, FP32; hc_ones [m H] the unweighted norm of fn's input
    hc_attn: tuple | None = None     # ([(2 + m) m, m H], [(2 + m) m], [3])
    hc_ffn: tuple | None = None      # likewise
    hc_head: tuple | None = None     # ([m, m H], [m], [1])
    hc_ones: Any | None = None       # [m H] ones
    # DeepSeek-V4's attention in a GQA block (q_lora_rank: mla_q_a / mla_q_a_norm and q_b)
    q_b: Any | None = None           # [Hq D, q_lora_rank] q_b_proj
    w_o_a: list | None = None        # o_groups x [o_lora_rank, Hq Dv / o_groups] o_a_proj
    w_o_b: Any | None = None         # [H, o_groups o_lora_rank] o_b_proj

    def __repr__(self) -> str:
        kind = "moe" if self.gate_w is not None else "dense"
        return f"ModuleWeights({kind}, H={self.enorm.shape[0]}, V={self.embed.shape[0]})"


@dataclass(slots=True, repr=False)
class MtpWeights:
    config: MtpConfig
    modules: list[ModuleWeights]
    target_norm: Any | None          # [H], when apply_target_norm
    nbytes: int = 0                  # bytes read from the checkpoint
    distinct_vocab_matrices: int = 0  # how many [V, H] matrices are held
    notes: list[str] = field(default_factory=list)
    #: the rank's slice (mtpkern.shard) when loaded for a sharded head, else None
    shard: Shard | None = None
    #: a sharded head's draft vocabulary (sorted target ids) its LM heads were read for, else None
    head_ids: np.ndarray | None = None

    def __repr__(self) -> str:
        return (f"MtpWeights({len(self.modules)} modules, {self.nbytes} bytes read, "
                f"{self.distinct_vocab_matrices} [V, H] matrices held)")


#: transformers' packed experts (its ``*Experts`` modules' parameters, as Qwen3.6 releases them):
#: ``gate_up_proj`` [E, 2I, H], each expert's gate rows over its up rows (``F.linear(x, W[e])``
#: then ``chunk(2)``: gate first), and ``down_proj`` [E, H, I]; no ``.weight`` in the names
GATE_UP = "mlp.experts.gate_up_proj"
DOWN_PACKED = "mlp.experts.down_proj"


def experts_gate_up(cfg: MtpConfig, rd: "CheckpointReader", m: int) -> bool:
    """Whether module ``m``'s routed experts are stored as transformers' packed pair
    (``GATE_UP`` / ``DOWN_PACKED`` under the module's prefix, renamed by the family like any
    suffix) rather than one tensor per expert: read from the checkpoint, any family (one
    release of a family may pack them and the next not: Qwen3.5 / Qwen3.6)."""
    fam = family(cfg.family)
    if not cfg.block(m).moe or fam.packed_experts:
        return False
    layer = cfg.layer_index(m)
    return rd.has(module_key(fam, rd, layer, m, GATE_UP))


def _module_keys(cfg: MtpConfig, m: int, gate_up: bool = False) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Key suffix -> (shape, required) for module ``m`` (biases, norms, experts by config);
    ``gate_up``: its routed experts as transformers' packed pair (``experts_gate_up``)."""
    b = cfg.block(m)
    H, D, Hq = cfg.hidden_size, b.head_dim, b.num_attention_heads
    q_rows = b.q_size + (b.gate_size if b.q_gate else 0)   # + the gate q_proj carries
    keys: dict[str, tuple[tuple[int, ...], bool]] = {
        "enorm.weight": ((H,), True),
        "hnorm.weight": ((H,), True),
        "eh_proj.weight": ((H, 2 * H), True),
        "input_layernorm.weight": ((H,), True),
        "post_attention_layernorm.weight": ((H,), True),
    }
    if b.mla:
        keys.update(_mla_keys(b, H))
    else:
        keys.update(_gqa_keys(b, H, q_rows))
    if b.o_groups:                       # DeepSeek-V4's grouped low-rank output
        g, r = b.o_groups, b.o_lora_rank
        keys["self_attn.o_a_proj.weight"] = ((g * r, b.o_size // g), True)
        keys["self_attn.o_b_proj.weight"] = ((H, g * r), True)
    else:
        keys["self_attn.o_proj.weight"] = ((H, b.o_size), True)
    keys["shared_head.norm.weight"] = ((H,), True)
    if b.attn_gate == "headwise":
        keys["self_attn.g_proj.weight"] = ((Hq, H), True)
    if b.attn_sinks:
        keys["self_attn.sinks"] = ((Hq,), True)
    if cfg.attention_bias:
        keys["self_attn.q_proj.bias"] = ((q_rows,), True)
        keys["self_attn.k_proj.bias"] = ((b.k_size,), True)
        keys["self_attn.v_proj.bias"] = ((b.v_size,), True)
    if cfg.use_qk_norm:
        keys["self_attn.q_norm.weight"] = ((D,), True)
        keys["self_attn.k_norm.weight"] = ((D,), True)
    gated = b.mlp_act != "relu2"        # relu2 (Nemotron-H): no gate_proj, up_proj alone
    if b.moe:
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        keys["mlp.gate.weight"] = ((E, H), True)
        if cfg.moe_latent_size:                          # the experts' input and output width
            keys["mlp.fc1_latent_proj.weight"] = ((cfg.moe_latent_size, H), True)
            keys["mlp.fc2_latent_proj.weight"] = ((H, cfg.moe_latent_size), True)
            if cfg.moe_latent_norm:                      # the RMSNorm of the experts' latent sum
                keys["mlp.latent_norm.weight"] = ((cfg.moe_latent_size,), True)
        H, H_model = (cfg.moe_latent_size or H), H
        if cfg.router_bias:
            keys["mlp.gate.e_score_correction_bias"] = ((E,), True)
        packed = family(cfg.family).packed_experts or gate_up
        if gate_up and gated:                            # [E, 2I, H] gate over up, [E, H, I]
            keys[GATE_UP] = ((E, 2 * I, H), True)
            keys[DOWN_PACKED] = ((E, H, I), True)
        elif packed:                                     # one tensor per projection for every expert
            if gated:
                keys["mlp.experts.gate_proj.weight"] = ((E, I, H), True)
            keys["mlp.experts.up_proj.weight"] = ((E, I, H), True)
            keys["mlp.experts.down_proj.weight"] = ((E, H, I), True)
        for e in range(0 if packed else E):
            if gated:
                keys[f"mlp.experts.{e}.gate_proj.weight"] = ((I, H), True)
            keys[f"mlp.experts.{e}.up_proj.weight"] = ((I, H), True)
            keys[f"mlp.experts.{e}.down_proj.weight"] = ((H, I), True)
        H = H_model
        if cfg.n_shared_experts:
            Is = cfg.shared_intermediate_size
            if gated:
                keys["mlp.shared_experts.gate_proj.weight"] = ((Is, H), True)
            keys["mlp.shared_experts.up_proj.weight"] = ((Is, H), True)
            keys["mlp.shared_experts.down_proj.weight"] = ((H, Is), True)
            if cfg.shared_expert_gate:
                keys["mlp.shared_expert_gate.weight"] = ((1, H), True)
    else:
        I = cfg.intermediate_size
        if gated:
            keys["mlp.gate_proj.weight"] = ((I, H), True)
        keys["mlp.up_proj.weight"] = ((I, H), True)
        keys["mlp.down_proj.weight"] = ((H, I), True)
    if cfg.hc_mult > 1:
        keys.update(_hc_keys(cfg.hc_mult, H))
    fam = family(cfg.family)
    if fam.split_eh_proj:                # eh_proj's column halves as two projections (DeepSeek-V4)
        del keys["eh_proj.weight"]
        keys["e_proj.weight"] = keys["h_proj.weight"] = ((H, H), True)
    for suffix in fam.unit_norms:        # no weight in the release: ones
        keys.pop(suffix, None)
    keys["embed_tokens.weight"] = ((cfg.vocab_size, H), False)
    keys["shared_head.head.weight"] = ((cfg.vocab_size, H), False)
    return keys


#: a module's hyper-connection tensors (DeepSeek-V4's names under its prefix) -> their rows
#: ("w": (2 + m) m, "h": m) and kind; each is FP32 in the releases
HC_TENSORS = {"hc_attn_fn": ("w", "fn"), "hc_attn_base": ("w", "base"), "hc_attn_scale": (3, "scale"),
              "hc_ffn_fn": ("w", "fn"), "hc_ffn_base": ("w", "base"), "hc_ffn_scale": (3, "scale"),
              "hc_head_fn": ("h", "fn"), "hc_head_base": ("h", "base"), "hc_head_scale": (1, "scale")}


def _hc_keys(m: int, H: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    out = {}
    for name, (rows, kind) in HC_TENSORS.items():
        r = {"w": (2 + m) * m, "h": m}.get(rows, rows)
        out[name] = (((r, m * H) if kind == "fn" else (r,)), True)
    return out


def _gqa_keys(b, H: int, q_rows: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """A GQA block's query / key / value projections: q_proj, or (q_lora_rank) q_a_proj /
    q_a_layernorm / q_b_proj; k_proj and v_proj, or (shared_kv) one kv_proj."""
    if b.q_lora_rank:
        Q = b.q_lora_rank
        keys = {"self_attn.q_a_proj.weight": ((Q, H), True), "self_attn.q_a_layernorm.weight": ((Q,), True),
                "self_attn.q_b_proj.weight": ((b.q_size, Q), True)}
    else:
        keys = {"self_attn.q_proj.weight": ((q_rows, H), True)}
    if b.shared_kv:
        keys["self_attn.kv_proj.weight"] = ((b.k_size, H), True)
    else:
        keys.update({"self_attn.k_proj.weight": ((b.k_size, H), True),
                     "self_attn.v_proj.weight": ((b.v_size, H), True)})
    return keys


def _mla_keys(b, H: int) -> dict[str, tuple[tuple[int, ...], bool]]:
    """An MLA block's attention tensors as DeepSeek-V3 releases them (but ``o_proj``), and an
    element-wise output gate's ``g_proj`` [Hq Dv, H] (Kimi K3's gated MLA)."""
    L, R, Hq = b.kv_lora_rank, b.qk_rope_head_dim, b.num_attention_heads
    keys = {"self_attn.kv_a_proj_with_mqa.weight": ((L + R, H), True),
            "self_attn.kv_a_layernorm.weight": ((L,), True),
            "self_attn.kv_b_proj.weight": ((Hq * (b.qk_nope_head_dim + b.v_dim), L), True)}
    if b.q_lora_rank:
        Q = b.q_lora_rank
        keys.update({"self_attn.q_a_proj.weight": ((Q, H), True), "self_attn.q_a_layernorm.weight": ((Q,), True),
                     "self_attn.q_b_proj.weight": ((b.q_size, Q), True)})
    else:
        keys["self_attn.q_proj.weight"] = ((b.q_size, H), True)
    if b.attn_gate:                      # "elementwise" (the only MLA gate): Kimi K3's g_proj
        keys["self_attn.g_proj.weight"] = ((b.gate_size, H), True)
    if b.dsa:
        Hi, Di = b.index_n_heads, b.index_head_dim
        keys.update({"self_attn.indexer.wq_b.weight": ((Hi * Di, b.q_lora_rank), True),
                     "self_attn.indexer.wk.weight": ((Di, H), True),
                     "self_attn.indexer.k_norm.weight": ((Di,), True),
                     "self_attn.indexer.k_norm.bias": ((Di,), True),
                     "self_attn.indexer.weights_proj.weight": ((Hi, H), True)})
        if b.kpool:                      # GLM-5.3's pooled indexer: the rows' gate scores, the pools' bias
            keys.update({"self_attn.indexer.index_kpool_compress_gate": ((Di, H), True),
                         "self_attn.indexer.index_kpool_compress_ape": ((b.kpool, Di), True)})
    return keys


#: The config field that decides whether a tensor under a module's prefix is read:
#: (pattern on the key under the prefix, field). First match wins; FP8 scales come
#: first because they sit beside every quantized weight.
_TENSOR_FIELDS: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r".*\.(weight_scale_inv|weight_scale|input_scale|scale)$"), "quantization_config"),
    (re.compile(r"(^|\.)self_attn\.[qkv]_proj\.bias$"), "attention_bias"),
    (re.compile(r"(^|\.)self_attn\.[qk]_norm\.weight$"), "use_qk_norm"),
    (re.compile(r"(^|\.)self_attn\.g_proj\."), "attn_gate"),
    (re.compile(r"(^|\.)self_attn\.sinks$"), "attn_sinks"),
    (re.compile(r"(^|\.)self_attn\.indexer\."), "index_topk"),
    (re.compile(r"(^|\.)self_attn\.o_[ab]_proj\."), "o_groups"),
    (re.compile(r"(^|\.)self_attn\.kv_proj\."), "shared_kv"),
    (re.compile(r"(^|\.)hc_(attn|ffn|head)_"), "hc_mult"),
    (re.compile(r"(^|\.)self_attn\.q_(a_proj|a_layernorm|b_proj)\."), "q_lora_rank"),
    (re.compile(r"(^|\.)self_attn\.kv_(a_proj_with_mqa|a_layernorm|b_proj)\."), "kv_lora_rank"),
    (re.compile(r"(^|\.)mlp\.shared_experts\."), "n_shared_experts"),
    (re.compile(r"(^|\.)mlp\.(gate\.|experts\.|(gate|up|down)_proj\.)"), "n_routed_experts"),  # MoE, or dense MLP
    (re.compile(r"(^|\.)share_expert\."), "n_shared_experts"),                  # Step-3.5's names
    (re.compile(r"(^|\.)moe\."), "n_routed_experts"),
)


def _deciding_field(cfg: MtpConfig, suffix: str) -> str | None:
    """What decides whether the tensor ``suffix`` (under a module's prefix) is read, if known."""
    for pattern, name in _TENSOR_FIELDS:
        if pattern.search(suffix):
            if name == "quantization_config":
                return (f"it is a quantized weight's scale, and the config reads no weight of it as quantized "
                        f"(quantization_config: {cfg.weight_quant or 'none'}; expert_dtype: "
                        f"{cfg.expert_quant or 'not fp4'}: docs/fp8.md, docs/fp4.md)")
            return f"config.json has {name} = {getattr(cfg, name)!r}"
    return None


def _check_router_rows(cfg: MtpConfig, rd: CheckpointReader, key: str, m: int) -> None:
    """n_routed_experts against the router's header (``key``), before the keys of E
    experts are listed: a config asking for 2**30 experts must not build 3 * 2**30 key
    strings."""
    if not cfg.block(m).moe:
        return
    E, H = cfg.n_routed_experts, cfg.hidden_size
    if not present(rd, key):
        raise CheckpointError(f"tensor {key!r} is missing from the checkpoint at {rd.path}; "
                              f"config.json has n_routed_experts = {E} (an MoE module)")
    shape, _ = rd.info(key if rd.has(key) else key + "_packed")      # rows as stored (packed: K halved)
    if shape[:1] != (E,):
        raise CheckpointError(f"tensor {key!r}: expected shape [{E}, {H}] (one router row per expert, "
                              f"config.json n_routed_experts = {E}), got {list(shape)}")


def _checked_module_keys(cfg: MtpConfig, rd: CheckpointReader, m: int, allow_unused: bool,
                         notes: list[str]) -> dict[str, tuple[str, tuple[int, ...], bool]]:
    """Module ``m``'s tensors: canonical suffix -> (checkpoint key, shape, required), once
    the checkpoint is known to hold every required one and nothing else under the
    module's prefix.

    The loader reads exactly these keys when present (the optional ``embed_tokens`` /
    ``shared_head.head`` when there), so any other key under the prefix would be
    silently unused: refused unless ``allow_unused``."""
    fam = family(cfg.family)
    layer = cfg.layer_index(m)
    pre = fam.module_prefix(layer, m)
    _check_router_rows(cfg, rd, fam.key(layer, m, "mlp.gate.weight"), m)
    spec = {suffix: (module_key(fam, rd, layer, m, suffix), shape, req)
            for suffix, (shape, req) in _module_keys(cfg, m, experts_gate_up(cfg, rd, m)).items()}
    for suffix, (key, _, required) in spec.items():
        if required and not present(rd, key):
            why = _deciding_field(cfg, suffix)
            raise CheckpointError(f"tensor {key!r} is missing from the checkpoint at {rd.path} "
                                  f"(module {m} of {cfg.num_modules}){'; ' + why if why else ''}")
    ours = _read_keys(cfg, rd, spec)
    for other in range(cfg.num_modules):     # a prefix the modules share (Qwen3-Next's "mtp."):
        if other != m and fam.module_prefix(cfg.layer_index(other), other).startswith(pre):   # theirs are used
            ours |= _read_keys(cfg, rd, {sx: (module_key(fam, rd, cfg.layer_index(other), other, sx), sh, rq)
                                         for sx, (sh, rq) in _module_keys(
                                             cfg, other, experts_gate_up(cfg, rd, other)).items()}, check=False)
    unused = sorted(k for k in rd.keys_under(pre) if k not in ours)
    ignored: dict[str, list[str]] = {}
    for k in unused:                           # what the family says it does not read, and why
        why = fam.ignored_reason(k[len(pre):])
        if why is not None:
            ignored.setdefault(why, []).append(k)
    for why, keys in ignored.items():
        notes.append(f"module {m}: {len(keys)} tensor(s) not read ({why}): {', '.join(keys[:3])}"
                     f"{', ...' if len(keys) > 3 else ''}")
    unused = [k for k in unused if fam.ignored_reason(k[len(pre):]) is None]
    if unused:
        _refuse_or_note_unused(cfg, rd, m, pre, unused, allow_unused, notes)
    return spec


def module_key(fam: Family, rd: CheckpointReader, layer: int, m: int, suffix: str) -> str:
    """The checkpoint's name for module ``m``'s tensor ``suffix``: the one of the family's
    names for it (``Family.keys``: the release's, then the alternatives) that the
    checkpoint holds; the release's when it holds none (reported missing as that).
    Two of them at once are refused: which one is the tensor would be a guess."""
    names = fam.keys(layer, m, suffix)
    held = [k for k in names if present(rd, k)]
    if len(held) > 1:
        raise CheckpointError(f"tensors {held} in the checkpoint at {rd.path} are two names for one tensor of "
                              f"module {m} ({suffix!r}); expected exactly one of {list(names)}")
    return held[0] if held else names[0]


def _read_keys(cfg: MtpConfig, rd: CheckpointReader, spec: dict, check: bool = True) -> set[str]:
    """The checkpoint keys the loader reads for ``spec``: its keys and, with FP8 weights,
    their scales (``check``: a missing scale raises)."""
    ours = {key for key, _, _ in spec.values()}
    if cfg.quant_container:
        for suffix, (key, _, _) in spec.items():
            if _is_projection(suffix) and present(rd, key):
                try:
                    ours |= stored_form(cfg, rd, key).keys()
                except CheckpointError:
                    if check:
                        raise
        return ours
    if cfg.weight_quant == "fp8":
        for suffix, (key, _, _) in spec.items():
            if not (_is_projection(suffix) and rd.has(key)):
                continue
            dt = rd.info(key)[1]
            if dt == _FP8 or is_fp4(cfg, suffix, dt):
                sk, kind = (scale_key(cfg, key, rd), "FP8") if dt == _FP8 else (fp4_scale_key(cfg, rd, key), "FP4")
                if check and not rd.has(sk):
                    raise CheckpointError(f"tensor {sk!r} is missing from the checkpoint at {rd.path}: the scales "
                                          f"of the {kind} weight {key!r} (quantization_config)")
                ours.add(sk)
    return ours


def _check_own_vocab_matrices(cfg: MtpConfig, rd: CheckpointReader, fam: Family) -> None:
    """A module's own LM head (``shared_head.head``) or embedding (``embed_tokens``) is
    optional, and a module without one reads the target's; but when some modules have
    their own and another has not, that one would draft with ``lm_head`` (or embed with
    the target's table) while its siblings keep theirs: refused, naming the missing tensor."""
    for suffix, what in (("shared_head.head.weight", "LM head"), ("embed_tokens.weight", "embedding")):
        keys = [module_key(fam, rd, cfg.layer_index(m), m, suffix) for m in range(cfg.num_modules)]
        held = [rd.has(k) for k in keys]
        if any(held) and not all(held):
            m = held.index(False)
            have = [i for i, h in enumerate(held) if h]
            raise CheckpointError(f"tensor {keys[m]!r} is missing from the checkpoint at {rd.path}: module(s) {have} "
                                  f"have their own {what} and module {m} has none; expected every module's own "
                                  f"{what} or none (a module without one reads the target's)")


def _refuse_or_note_unused(cfg: MtpConfig, rd: CheckpointReader, m: int, pre: str, unused: list[str],
                           allow_unused: bool, notes: list[str]) -> None:
    if allow_unused:
        notes.append(f"module {m}: {len(unused)} unused tensor(s) not loaded (allow_unused_tensors=True): "
                     f"{', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''}")
        return
    first = unused[0]
    why = _deciding_field(cfg, first[len(pre):]) or "no config field reads it"
    more = f" (and {len(unused) - 1} more unused under {pre!r})" if len(unused) > 1 else ""
    raise CheckpointError(f"tensor {first!r} in {rd.file_of(first)} would not be used: {why}{more}; "
                          f"pass allow_unused_tensors=True to load without it")


def check_headers(path: str | os.PathLike, cfg: MtpConfig, apply_target_norm: bool = False
                  ) -> tuple[list[str], list[str]]:
    """What ``load_weights`` would refuse that the safetensors headers already show, read
    without any tensor's data: every tensor each module reads present (its own or the
    target's embedding and LM head, the target's norm with ``apply_target_norm``), with the
    shape and dtype the loader expects (``_module_keys``: the same table), an FP8 weight's
    scales present, no unused tensor under a module's prefix. Returns ``(problems, notes)``,
    one line each, every problem found (not only the first); values (NaN, corrupt data) are
    the loader's to find. ``mtpkern info`` reports these."""
    rd = CheckpointReader(path)
    fam = family(cfg.family)
    problems: list[str] = []
    notes: list[str] = []
    V, H = cfg.vocab_size, cfg.hidden_size

    def attempt(fn: Any) -> Any:
        try:
            return fn()
        except CheckpointError as e:
            if str(e) not in problems:
                problems.append(str(e))
            return None

    def header(key: str, shape: tuple[int, ...], dtypes: tuple[str, ...], why: str = "") -> None:
        got_shape, got_dtype = rd.info(key)
        where = f"tensor {key!r} in {rd.file_of(key)}"
        if got_shape != tuple(shape):
            problems.append(f"{where}: expected shape {list(shape)}{why}, got {list(got_shape)}")
        if got_dtype not in dtypes:
            problems.append(f"{where}: expected dtype {' or '.join(dtypes)}, got {got_dtype}")

    def one(m: int, layer: int, suffix: str, shape: tuple[int, ...], required: bool) -> None:
        key = module_key(fam, rd, layer, m, suffix)
        st = stored_form(cfg, rd, key) if _is_projection(suffix) and present(rd, key) else None
        if st is not None and st.fmt in ("mxfp4", "nvfp4"):
            N, K = shape[-2:]
            B = FP4_BLOCK if st.fmt == "mxfp4" else NVFP4_BLOCK
            header(st.data, tuple(shape[:-1]) + (K // 2,), _FP4, f" ({st.fmt}: two codes a byte of {list(shape)})")
            header(st.scale, tuple(shape[:-1]) + (-(-K // B),), (_FP8,) if st.fmt == "nvfp4" else _FP4_SCALE_DTYPES)
            return
        if st is not None and st.fmt == "fp8":
            header(st.data, shape, (_FP8,))
            return
        if not present(rd, key):
            if required:
                why = _deciding_field(cfg, suffix)
                problems.append(f"tensor {key!r} is missing from the checkpoint at {rd.path} (module {m} of "
                                f"{cfg.num_modules}){'; ' + why if why else ''}")
            return
        fp8 = cfg.weight_quant == "fp8" and _is_projection(suffix) and rd.info(key)[1] == _FP8
        fp4 = is_fp4(cfg, suffix, rd.info(key)[1])
        if fp4:                                        # [.., N, K / 2] as stored
            header(key, tuple(shape[:-1]) + (shape[-1] // 2,), _FP4, f" (FP4: two codes a byte of {list(shape)})")
        else:
            header(key, shape, (_FP8,) if fp8 else _FLOAT_DTYPES)
        if fp8 or fp4:
            sk = scale_key(cfg, key, rd) if fp8 else fp4_scale_key(cfg, rd, key)
            if not rd.has(sk):
                problems.append(f"tensor {sk!r} is missing from the checkpoint at {rd.path}: the scales "
                                f"of the {'FP8' if fp8 else 'FP4'} weight {key!r} (quantization_config)")
            elif fp8:
                header(sk, rd.info(sk)[0], _FP8_SCALE_DTYPES)
            else:
                header(sk, tuple(shape[:-1]) + (-(-shape[-1] // FP4_BLOCK),), _FP4_SCALE_DTYPES)

    attempt(lambda: _check_own_vocab_matrices(cfg, rd, fam))
    for m in range(cfg.num_modules):
        layer = cfg.layer_index(m)
        attempt(lambda: _checked_module_keys(cfg, rd, m, False, notes))      # the first missing / unused one
        keys = _module_keys(cfg, m, experts_gate_up(cfg, rd, m))
        for suffix, (shape, required) in keys.items():
            attempt(lambda: one(m, layer, suffix, shape, required))
        own = {s: attempt(lambda s=s: module_key(fam, rd, layer, m, s))
               for s in ("embed_tokens.weight", "shared_head.head.weight")}
        head_keys = [own["shared_head.head.weight"], fam.target_head] + \
            ([fam.target_embed] if cfg.tie_word_embeddings else [])
        for keys_, what in (([own["embed_tokens.weight"], fam.target_embed], f"module {m} embedding"),
                            (head_keys, f"module {m} LM head")):
            held = [k for k in keys_ if k is not None and rd.has(k)]
            if not held:
                problems.append(f"{what}: none of the tensors {[k for k in keys_ if k]} is in the checkpoint "
                                f"at {rd.path}")
            elif held[0] not in (own["embed_tokens.weight"], own["shared_head.head.weight"]):
                attempt(lambda: header(held[0], (V, H), _FLOAT_DTYPES, f" ([vocab_size, hidden_size], {what})"))
    if apply_target_norm:
        if not rd.has(fam.target_norm):
            problems.append(f"apply_target_norm=True needs the target's {fam.target_norm!r}, "
                            f"missing from the checkpoint at {rd.path}")
        else:
            attempt(lambda: header(fam.target_norm, (H,), _FLOAT_DTYPES))
    return list(dict.fromkeys(problems)), notes


def _check_logit_bound(rd: CheckpointReader, m: int, H: int, norm_key: str, g: np.ndarray,
                       head_key: str | None, folded: bool) -> None:
    """Refuse module ``m`` when its final norm ``g`` (as applied) and LM head ``head_key`` could
    give a logit that is not finite in FP32: the LM head reads ``y = rmsnorm(h) * g``, and
    ``sum_i |y_i| |W_vi| <= max|W| max|g| sum_i |h_i| / rms(h) <= H max|g| max|W|`` (Cauchy-
    Schwarz: ``sum_i |h_i| <= sqrt(H) ||h||``, ``rms(h) >= ||h|| / sqrt(H)``), so no partial sum
    of any order can overflow while that is below ``LOGIT_BOUND`` (its factor 4 below FLT_MAX
    covers the FP32 rounding of the norm and of the sums). Then every logit of a finite hidden
    is finite on every backend, and the backends' argmax and confidences agree within FP32
    rounding. ``max|W|`` is over the whole tensor as stored (``CheckpointReader.abs_max``): a
    vocabulary shard or a draft vocabulary holds a subset of its rows, and every rank of a
    sharded head computes the same value and refuses alike."""
    if head_key is None:                     # no LM head at all: vocab_matrix names what is missing
        return
    wmax = rd.abs_max(head_key)
    where = f"tensor {head_key!r} in {rd.file_of(head_key)}"
    if not math.isfinite(wmax):
        raise CheckpointError(f"{where}: holds NaN or infinite values")
    with np.errstate(over="ignore", invalid="ignore"):
        gmax = float(np.max(np.abs(np.asarray(g, np.float32)))) if g.size else 0.0
    bound = H * gmax * wmax
    if not bound < LOGIT_BOUND:
        how = " (zero-centred: applied as 1 + w)" if folded else ""
        raise CheckpointError(
            f"module {m}: its final norm {norm_key!r}{how} and LM head {head_key!r} could give logits that "
            f"overflow FP32: hidden_size * max|g| * max|W| = {H} * {gmax:.6g} * {wmax:.6g} = {bound:.6g}, "
            f"expected below {LOGIT_BOUND:.6g} (2^126, FLT_MAX / 4), the bound under which every logit of a "
            f"finite hidden is finite in any summation order (docs/checkpoints.md)")


def load_weights(path: str | os.PathLike, cfg: MtpConfig, backend, apply_target_norm: bool = False, *,
                 allow_unused_tensors: bool = False, shard: Shard | None = None,
                 head_ids: np.ndarray | None = None) -> MtpWeights:
    """Read every module of the checkpoint at ``path`` onto ``backend``.

    Before a module's tensors are read, what ``cfg`` implies is compared with what the
    checkpoint holds under the module's prefix: a required tensor that is missing, or a
    tensor there that the config would not read (``use_qk_norm: false`` beside
    ``q_norm.weight``, ``n_shared_experts: 0`` beside shared experts, an FP8 scale, an
    unknown name) raises ``CheckpointError`` naming the tensor and the config field.
    ``allow_unused_tensors=True`` loads without the unused tensors and lists them in
    ``MtpWeights.notes``. Tensors outside the modules' prefixes (the target's) are ignored.

    ``shard``: read only rank ``shard.rank``'s slice of every tensor (mtpkern.shard): its
    attention heads, experts or intermediate slices and LM head rows; the replicated tensors
    whole. The modules' weights then have the rank's shapes (``Shard.block``). ``head_ids``
    (with ``shard``): the LM heads hold a draft vocabulary (sorted target ids, mtpkern.vocab),
    the rank's share of its rows only (``Shard.vocab`` over its positions).
    """
    if not isinstance(allow_unused_tensors, bool):
        raise TypeError(f"allow_unused_tensors: expected a bool, got {allow_unused_tensors!r}")
    rd = CheckpointReader(path)
    notes: list[str] = []
    nbytes = 0
    by_key: dict[tuple, Any] = {}      # (checkpoint key, rows) -> prepared [V, H] matrix
    by_digest: dict[bytes, Any] = {}   # content digest -> prepared [V, H] matrix
    V, H = cfg.vocab_size, cfg.hidden_size

    def read(key, shape, dtypes=_FLOAT_DTYPES, rows=None, cols=None):
        nonlocal nbytes
        a = rd.get(key, shape, dtypes, rows, cols)
        nbytes += a.nbytes
        return a

    def vocab_matrix(keys: list[str], what: str, rows: Any = None):
        """The first present key of ``keys`` as a [V, H] matrix (its ``rows`` only, a range or
        an array: a vocabulary shard), held once."""
        tag = rows if not isinstance(rows, np.ndarray) else ("ids", rows.tobytes())
        for key in keys:
            if not rd.has(key):
                continue
            if (key, tag) in by_key:
                return by_key[key, tag]
            a = read(key, (V, H), rows=rows)
            h = hashlib.blake2b(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)), digest_size=16)
            digest = a.dtype.name.encode() + repr(a.shape).encode() + h.digest()
            prepared = by_digest.get(digest)
            if prepared is None:
                prepared = by_digest[digest] = backend.prepare_weight(a)
            by_key[key, tag] = prepared
            return prepared
        raise CheckpointError(f"{what}: none of the tensors {keys} is in the checkpoint at {rd.path}")

    def stack_rows(*parts):
        """Row-stack projections (q/k/v, gate/up): dense ones as BF16 when all are, else
        FP32; FP8 ones with their scales (``Fp8Weight.concat``); never a mix."""
        kinds = {type(p) for p in parts}
        if len(kinds) == 1 and kinds <= {Fp8Weight, Fp4Weight}:
            return kinds.pop().concat(parts)
        if kinds & {Fp8Weight, Fp4Weight}:
            raise CheckpointError(f"{rd.path}: projections fused into one GEMV mix "
                                  f"{' and '.join(sorted(_kind(p) for p in parts))} weights; "
                                  f"expected all of q/k/v (or gate/up, kv_a_proj_with_mqa/g_proj) in one dtype")
        dt = BF16 if all(p.dtype == BF16 for p in parts) else np.float32
        return np.concatenate([p.astype(dt, copy=False) for p in parts], axis=0)

    def fp8(key: str, shape: tuple[int, ...], rows=None, cols=None) -> Fp8Weight:
        """An FP8 projection and its scales, checked (Fp8Weight validates the scale shape);
        ``rows`` / ``cols``: a shard of it, cut at whole scale blocks."""
        nonlocal nbytes
        got_shape, _ = rd.info(key)
        if got_shape != tuple(shape):
            raise CheckpointError(f"tensor {key!r} in {rd.file_of(key)}: expected shape {list(shape)}, "
                                  f"got {list(got_shape)}")
        block = cfg.fp8_block if cfg.fp8_block != (0, 0) else None
        sk = scale_key(cfg, key, rd)
        scale = rd.get(sk, rd.info(sk)[0], _FP8_SCALE_DTYPES)
        if rows is not None or cols is not None:
            if scale.ndim != 2 and block is not None:
                raise CheckpointError(f"tensor {sk!r} in {rd.file_of(sk)}: expected block scales [N/bn, K/bk], "
                                      f"got shape {list(scale.shape)}")
            scale = _fp8_scale_slice(scale, block, rows, cols, tuple(shape), key)
        data = rd.get(key, shape, (_FP8,), rows, cols)
        nbytes += data.nbytes + scale.nbytes
        return checked_fp8(key, data, sk, scale)

    def fp4(key: str, shape: tuple[int, ...], rows=None, cols=None) -> Fp4Weight:
        """An FP4 projection ([N, K / 2] packed codes) and its E8M0 scales ([N, ceil(K / 32)]),
        checked (Fp4Weight refuses NaN and overflowing scale codes, naming the scale tensor);
        ``rows`` / ``cols``: a shard of it, columns cut at whole 32-weight scale blocks."""
        nonlocal nbytes
        stored = tuple(shape[:-1]) + (shape[-1] // 2,)
        got_shape, _ = rd.info(key)
        if shape[-1] % 2 or got_shape != stored:
            raise CheckpointError(f"tensor {key!r} in {rd.file_of(key)}: expected shape {list(stored)} (FP4: two "
                                  f"codes a byte of a [{', '.join(map(str, shape))}] weight), got {list(got_shape)}")
        sk = fp4_scale_key(cfg, rd, key)
        want = tuple(shape[:-1]) + (-(-shape[-1] // FP4_BLOCK),)
        scale = rd.get(sk, want, _FP4_SCALE_DTYPES)
        if cols is not None and (cols[0] % FP4_BLOCK or (cols[1] % FP4_BLOCK and cols[1] != shape[-1])):
            raise CheckpointError(f"tensor {key!r}: a shard of columns {cols[0]}:{cols[1]} cuts its FP4 scale "
                                  f"blocks of {FP4_BLOCK}; shard where the blocks allow (docs/distributed.md)")
        data = rd.get(key, stored, _FP4, rows, None if cols is None else (cols[0] // 2, -(-cols[1] // 2)))
        if rows is not None:
            scale = scale[rows[0]:rows[1]]
        if cols is not None:
            scale = scale[:, cols[0] // FP4_BLOCK: -(-cols[1] // FP4_BLOCK)]
        nbytes += data.nbytes + scale.nbytes
        try:
            return Fp4Weight(data, scale)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"tensor {sk!r} in {rd.file_of(sk)}: {e}") from None

    def checked_fp8(key: str, data: np.ndarray, sk: str, scale: np.ndarray) -> Fp8Weight:
        """The codes ``data`` of ``key`` with the scales ``sk``, refused when a code is NaN (E4M3
        0x7F / 0xFF: one pass over the bytes, once per tensor read) or a scale is not finite or
        so large that a weight would overflow FP32 (``Fp8Weight``): either would load, and every
        propose would then find no allowed token."""
        n, at = nan_codes(data)
        if n:
            raise CheckpointError(f"tensor {key!r} in {rd.file_of(key)}: {n} FP8 E4M3 code(s) are NaN (0x7F / 0xFF; "
                                  f"first at {list(at)}); expected finite weights")
        try:
            return Fp8Weight(data, scale, cfg.fp8_block if cfg.fp8_block != (0, 0) else None)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"tensor {sk!r} in {rd.file_of(sk)}: {e}") from None

    dense_under: dict[int, list[str]] = {}          # module -> its projections a container stores dense

    def contained(st: Stored, key: str, shape: tuple[int, ...], rows=None, cols=None):
        """A projection of a container, as its tensors say (``stored_form``): MXFP4 / NVFP4 as an
        ``Fp4Weight``, FP8 / MXFP8 as an ``Fp8Weight`` (block from its scales' shape and dtype);
        ``rows`` / ``cols``: a shard of it, only those ranges read: rows with their scales (NVFP4:
        and their row scales), columns at whole scale blocks with every row's scale kept (a cut
        inside a block is refused, naming the tensor, the cut and the block)."""
        nonlocal nbytes
        N, K = shape

        def refuse_cut(fmt: str, bk: int) -> None:
            if cols is not None and (cols[0] % bk or (cols[1] % bk and cols[1] != K)):
                raise CheckpointError(f"tensor {st.data!r}: a shard of columns {cols[0]}:{cols[1]} cuts its {fmt} "
                                      f"scale blocks of {bk}; shard where the blocks allow (docs/distributed.md)")

        if st.fmt in ("mxfp4", "nvfp4"):
            B = FP4_BLOCK if st.fmt == "mxfp4" else NVFP4_BLOCK
            stored = (N, K // 2)
            got_shape, _ = rd.info(st.data)
            if K % 2 or got_shape != stored:
                raise CheckpointError(f"tensor {st.data!r} in {rd.file_of(st.data)}: expected shape {list(stored)} "
                                      f"({st.fmt}: two codes a byte of a [{N}, {K}] weight), got {list(got_shape)}")
            refuse_cut(st.fmt.upper(), B)
            data = rd.get(st.data, stored, _FP4, rows, None if cols is None else (cols[0] // 2, -(-cols[1] // 2)))
            scale = rd.get(st.scale, (N, -(-K // B)), (_FP8,) if st.fmt == "nvfp4" else _FP4_SCALE_DTYPES)
            if rows is not None:
                scale = scale[rows[0]:rows[1]]
            if cols is not None:
                scale = scale[:, cols[0] // B: -(-cols[1] // B)]
            g = None
            if st.fmt == "nvfp4":
                gshape, _ = rd.info(st.glob)
                if int(np.prod(gshape, dtype=np.int64)) != 1:
                    raise CheckpointError(f"tensor {st.glob!r} in {rd.file_of(st.glob)}: expected one value (shape [1] "
                                          f"or []), got shape {list(gshape)}")
                gv = float(np.asarray(rd.get(st.glob, gshape, ("F32",))).reshape(()))
                if cfg.quant_container == "compressed-tensors":      # stored: the divisor (448 * 6 / amax)
                    if not (math.isfinite(gv) and gv != 0.0):
                        raise CheckpointError(f"tensor {st.glob!r} in {rd.file_of(st.glob)}: expected a finite, "
                                              f"non-zero global scale (weights are divided by it), got {gv!r}")
                    gv = 1.0 / gv
                g = np.full((data.shape[0],), gv, np.float32)     # the row scale of every row read
            nbytes += data.nbytes + scale.nbytes + (0 if g is None else 4)
            try:
                return Fp4Weight(data, scale, g)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"tensor {st.scale!r} in {rd.file_of(st.scale)}: {e}") from None
        # FP8: per-channel FP32 / BF16 scales [N] / [N, 1], E8M0 per (1, 32) (MXFP8), or blocks
        sshape, sdt = rd.info(st.scale)
        if sdt in _FP4_SCALE_DTYPES:
            block, want = (1, 32), (N, -(-K // 32))
            if tuple(sshape) != want:
                raise CheckpointError(f"tensor {st.scale!r} in {rd.file_of(st.scale)}: expected shape {list(want)} "
                                      f"(MXFP8: an E8M0 scale per 32 weights along K), got {list(sshape)}")
            scale = rd.get(st.scale, want, _FP4_SCALE_DTYPES).view(np.uint8).view(ml_dtypes.float8_e8m0fnu)
        else:
            block = None if tuple(sshape) in ((N,), (N, 1)) else cfg.fp8_block
            scale = rd.get(st.scale, sshape, ("F32", "BF16"))
        if block is not None:
            refuse_cut("MXFP8" if sdt in _FP4_SCALE_DTYPES else "FP8", block[1])
            if rows is not None and (rows[0] % block[0] or (rows[1] % block[0] and rows[1] != N)):
                raise CheckpointError(f"tensor {st.data!r}: a shard of rows {rows[0]}:{rows[1]} cuts its FP8 scale "
                                      f"blocks of {block[0]}; shard where the blocks allow (docs/distributed.md)")
            if scale.ndim == 2:
                scale = _fp8_scale_slice(scale, block, rows, cols, (N, K), st.data)
        elif rows is not None:                   # per output channel: the rows' scales
            scale = scale[rows[0]:rows[1]]
        data = rd.get(st.data, shape, (_FP8,), rows, cols)
        n, at = nan_codes(data)
        if n:
            raise CheckpointError(f"tensor {st.data!r} in {rd.file_of(st.data)}: {n} FP8 E4M3 code(s) are NaN "
                                  f"(0x7F / 0xFF; first at {list(at)}); expected finite weights")
        nbytes += data.nbytes + scale.nbytes
        try:
            return Fp8Weight(data, scale, block)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"tensor {st.scale!r} in {rd.file_of(st.scale)}: {e}") from None

    def packed(suffix: str, e0: int, e1: int, part_i: tuple[int, int] | None, axis: int):
        """Experts ``e0:e1`` of a packed tensor (``Family.packed_experts``: [E, N, K]), and only
        ``part_i`` of each expert's intermediate dim ``axis`` (1: rows of gate / up, 2: columns
        of down; a sharded head's TP slice): the experts' range is read from the file, the
        slice is a view of it. FP8 codes keep their scales (whole scale blocks only)."""
        nonlocal nbytes
        key, shape, _ = spec[suffix]
        got_shape, dt = rd.info(key)
        if got_shape != tuple(shape) and not is_fp4(cfg, suffix, dt):
            raise CheckpointError(f"tensor {key!r} in {rd.file_of(key)}: expected shape {list(shape)} (experts "
                                  f"packed: [n_routed_experts, ...]), got {list(got_shape)}")
        rows = None if (e0, e1) == (0, shape[0]) else (e0, e1)
        if is_fp4(cfg, suffix, dt):
            q4 = fp4(key, shape, rows)
            if part_i is None:
                return q4
            return q4.rows(*part_i) if axis == 1 else q4.cols(*part_i)
        if not (cfg.weight_quant == "fp8" and dt == _FP8):
            a = read(key, shape, rows=rows)
            return a if part_i is None else (a[:, part_i[0]:part_i[1]] if axis == 1 else a[:, :, part_i[0]:part_i[1]])
        sk = scale_key(cfg, key, rd)
        scale = rd.get(sk, rd.info(sk)[0], _FP8_SCALE_DTYPES)
        data = rd.get(key, shape, (_FP8,), rows)
        scale = scale if rows is None else scale[e0:e1]
        nbytes += data.nbytes + scale.nbytes
        q = checked_fp8(key, data, sk, scale)
        if part_i is None:
            return q
        i0, i1 = part_i
        if axis == 1:
            return Fp8Weight.stack([_row_slice(Fp8Weight(q.data[e], q.scale[e], q.block), i0, i1)
                                    for e in range(q.data.shape[0])])
        if q.block is None:                      # per output row: the columns move, the scales stay
            return Fp8Weight(q.data[:, :, i0:i1], q.scale, None)
        bk = q.block[1]
        if i0 % bk or (i1 % bk and i1 != shape[2]):
            raise CheckpointError(f"tensor {key!r}: a shard of columns {i0}:{i1} cuts its FP8 scale blocks of {bk}; "
                                  f"shard where the blocks allow (docs/distributed.md)")
        return Fp8Weight(q.data[:, :, i0:i1], q.scale[:, :, i0 // bk: -(-i1 // bk)], q.block)

    def packed_w13(e0: int, e1: int, part_i: tuple[int, int] | None):
        """[E', 2I', H]: each expert's gate rows over its up rows, from the packed gate and up
        tensors: dense ones written into the result one tensor at a time (the host peak is the
        result plus one packed tensor); FP8 ones fused per expert with their scales.

        transformers' ``gate_up_proj`` [E, 2I, H] (``GATE_UP`` in the module's spec) already is that
        layout: the experts' range is read once and handed on as it is; only a sharded head's
        slice of I (``part_i``) cuts the gate rows and the up rows out of it and joins them."""
        if GATE_UP in spec:
            I_ = spec[GATE_UP][1][1] // 2
            if part_i is None:
                return packed(GATE_UP, e0, e1, None, 1)
            halves = {"gate": part_i, "up": (I_ + part_i[0], I_ + part_i[1])}

            def half(name):
                return packed(GATE_UP, e0, e1, halves[name], 1)
        else:
            def half(name):
                return packed(f"mlp.experts.{name}_proj.weight", e0, e1, part_i, 1)
        up_key = spec[GATE_UP if GATE_UP in spec else "mlp.experts.up_proj.weight"][0]
        gate = half("gate")
        if isinstance(gate, Fp4Weight):
            up = half("up")
            if not isinstance(up, Fp4Weight):
                raise CheckpointError(f"{rd.path}: experts mix FP4 and {_kind(up)} weights "
                                      f"({up_key!r})")
            return gate.join_rows(up)
        if isinstance(gate, Fp8Weight):
            up = half("up")
            if not isinstance(up, Fp8Weight):
                raise CheckpointError(f"{rd.path}: experts mix FP8 and dense weights "
                                      f"({up_key!r})")
            return Fp8Weight.stack([Fp8Weight.concat([Fp8Weight(gate.data[e], gate.scale[e], gate.block),
                                                      Fp8Weight(up.data[e], up.scale[e], up.block)])
                                    for e in range(gate.data.shape[0])])
        n, I_ = gate.shape[0], gate.shape[1]
        out = np.empty((n, 2 * I_, gate.shape[2]), gate.dtype)
        out[:, :I_] = gate
        del gate
        up = half("up")
        if isinstance(up, (Fp8Weight, Fp4Weight)):
            raise CheckpointError(f"{rd.path}: experts mix {_kind(up)} and dense weights "
                                  f"({up_key!r})")
        out[:, I_:] = up
        return out

    fam = family(cfg.family)
    if head_ids is not None and shard is None:
        raise ValueError("head_ids: a draft vocabulary is read at load by a sharded head only (shard=); "
                         "an unsharded proposer cuts its heads itself (draft_vocab=)")
    head_rows: Any = None                    # the LM heads' rows this load reads (None: all)
    if shard is not None:
        lo, hi = shard.vocab(V if head_ids is None else int(np.asarray(head_ids).shape[0]))
        head_rows = (lo, hi) if head_ids is None else np.asarray(head_ids, np.int64)[lo:hi]
    _check_own_vocab_matrices(cfg, rd, fam)
    if shard is not None:                    # every module's split checked before any tensor is read
        for m in range(cfg.num_modules):
            shard.block(cfg.block(m), f" (module {m})")
    modules = []
    for m in range(cfg.num_modules):
        spec = _checked_module_keys(cfg, rd, m, allow_unused_tensors, notes)
        blk = cfg.block(m)                           # the checkpoint's block
        #: the rank's heads and block (its query / KV heads), or the whole module's
        hs = None if shard is None else shard.heads(blk, f" (module {m})")
        lblk = blk if shard is None else shard.block(blk, f" (module {m})")

        def w(suffix, dtypes=_FLOAT_DTYPES, spec=spec, rows=None, cols=None):
            """A dense tensor; a projection may be FP8 (an ``Fp8Weight``) when the config says so;
            ``rows`` / ``cols``: only that range (a rank's shard)."""
            key, shape, _ = spec[suffix]
            st = stored_form(cfg, rd, key) if _is_projection(suffix) else None
            if st is not None and st.fmt != "dense":
                return contained(st, key, shape, rows, cols)
            if st is not None:
                dense_under.setdefault(m, []).append(key)
            if cfg.weight_quant == "fp8" and _is_projection(suffix) and rd.info(key)[1] == _FP8:
                return fp8(key, shape, rows, cols)
            if is_fp4(cfg, suffix, rd.info(key)[1]):
                return fp4(key, shape, rows, cols)
            return read(key, shape, dtypes, rows, cols)

        def part(item):
            """``w`` of a suffix, or of a (suffix, rows, cols) shard of it."""
            return w(item) if isinstance(item, str) else w(item[0], rows=item[1], cols=item[2])

        def stacked(suffixes: list[list]):
            """Experts ``[E, N, K]``: dense ones written straight into the final array, one
            expert at a time (the host peak is the result plus one expert, not twice the
            result); FP8 ones stacked with their scales. Items: suffixes, or (suffix, rows,
            cols) shards."""
            first = [part(s) for s in suffixes[0]]
            quant = next((type(p) for p in first if isinstance(p, (Fp8Weight, Fp4Weight))), None)
            if quant is not None:
                parts = [first] + [[part(s) for s in group] for group in suffixes[1:]]
                fused = [p[0] if len(p) == 1 else stack_rows(*p) for p in parts]
                for e, f in enumerate(fused):
                    if not isinstance(f, quant):
                        raise CheckpointError(f"{rd.path}: experts mix {_kind(first[0])} and {_kind(f)} weights "
                                              f"(expert {e})")
                return quant.stack(fused)
            row = stack_rows(*first) if len(first) > 1 else first[0]
            out = np.empty((len(suffixes),) + row.shape, row.dtype)
            out[0] = row
            for e, group in enumerate(suffixes[1:], start=1):
                at = 0
                for s_ in group:
                    a = part(s_)
                    if isinstance(a, (Fp8Weight, Fp4Weight)):
                        name = s_ if isinstance(s_, str) else s_[0]
                        raise CheckpointError(f"{rd.path}: experts mix {_kind(a)} and dense weights ({spec[name][0]!r})")
                    out[e, at:at + a.shape[0]] = a
                    at += a.shape[0]
            return out

        def norm_host(suffix, scale: float = 1.0):
            """A norm weight on the host as the backends apply it: zero-centred ones folded
            (stored w, applied as 1 + w), ones for a norm the release has no weight for
            (``Family.unit_norms``), times ``scale`` (an output scale of the norm, in FP32);
            a q / k norm reordered as its head's dims (``rope_last``)."""
            if suffix in fam.unit_norms:
                n = blk.head_dim if suffix in ("self_attn.q_norm.weight", "self_attn.k_norm.weight") else H
                v = np.ones(n, np.float32)
            else:
                v = w(suffix)
            if suffix in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
                v = rope_first(v, 1)
            v = v.astype(np.float32) + 1.0 if fam.folds_norm(suffix) else v
            return v if scale == 1.0 else v.astype(np.float32) * np.float32(scale)

        def norm(suffix, scale: float = 1.0):
            return backend.prepare_vector(norm_host(suffix, scale))

        def qkv_rows(q, k, v, g=None):
            """The parts of the fused projection in its row order: q | k | v (| gate): the
            head-wise gate ``g`` (g_proj), or the element-wise one that q_proj carries. A query
            projection that interleaves a gate per head ([q_h | g_h], Qwen3-Next) is split
            here, the gate rows going last."""
            if not lblk.q_gate:
                return [q, k, v] + ([] if g is None else [g])
            D, Hq = lblk.head_dim, lblk.num_attention_heads
            if not fam.q_gate_interleaved:                       # canonical: [queries; gates]
                return [_row_slice(q, 0, Hq * D), k, v, _row_slice(q, Hq * D, 2 * Hq * D)]
            per_head = [_row_slice(q, 2 * h * D + j * D, 2 * h * D + (j + 1) * D) for h in range(Hq) for j in (0, 1)]
            return [join(per_head[0::2]), k, v, join(per_head[1::2])]

        def join(parts):
            """Row-concatenate the parts of one tensor (dense, FP8, or 1-D biases)."""
            if len(parts) == 1:
                return parts[0]
            if isinstance(parts[0], (Fp8Weight, Fp4Weight)):
                return type(parts[0]).concat(parts)
            return np.concatenate(parts, axis=0)

        def heads_of(suffix, per: int, kv: bool = False):
            """A projection (or bias) of ``per`` rows a head, the rank's heads only: its query
            heads (a q_proj that carries an element-wise gate, its gate rows too, in the
            checkpoint's layout) or, with ``kv``, its KV heads."""
            if hs is None:
                return w(suffix)
            a, b = (hs.kv0, hs.kv1) if kv else (hs.q0, hs.q1)
            if kv or not blk.q_gate or not suffix.startswith("self_attn.q_proj"):
                return w(suffix, rows=(a * per, b * per))
            if fam.q_gate_interleaved:                           # [q_h | g_h] per head
                return w(suffix, rows=(2 * a * per, 2 * b * per))
            Hq = blk.num_attention_heads                         # [queries; gates]
            return join([w(suffix, rows=(a * per, b * per)), w(suffix, rows=((Hq + a) * per, (Hq + b) * per))])

        def value_scaled(v):
            """v_proj (weight or bias) times attention_value_scale, folded once: FP8 weights
            through their FP32 scales, dense ones in FP32 (no second rounding)."""
            sv = cfg.attention_value_scale
            if sv == 1.0:
                return v
            if isinstance(v, Fp8Weight):
                return Fp8Weight(v.data, (v.scale.astype(np.float32) * np.float32(sv)), v.block)
            if isinstance(v, Fp4Weight):                          # E8M0 holds powers of two only: widened
                return v.dequantize() * np.float32(sv)
            return v.astype(np.float32) * np.float32(sv)

        def rope_first(v, heads: int, axis: int = 0):
            """A projection's rows (``axis`` 0) or columns (1) of ``heads`` heads, or a q / k norm
            weight (one head), with each head's last R dims moved first (``Family.rope_last``:
            where mtpkern's RoPE rotates); unchanged for other families."""
            if not fam.rope_last:
                return v
            order, unit = rope_first_order(heads, blk.head_dim, blk.rotary_dim)
            return take_units(v, axis, order, unit)

        def eh_proj():
            """[H, 2H] over [embed, hidden]: a family that concatenates [hidden, embed]
            has its column halves swapped here, once; one that releases e_proj / h_proj
            (``split_eh_proj``) has them joined."""
            if fam.split_eh_proj:
                return backend.prepare_weight(join_cols(w("e_proj.weight"), w("h_proj.weight"), "e_proj / h_proj"))
            v = w("eh_proj.weight")
            if fam.concat != "hidden_embed":
                return backend.prepare_weight(v)
            if isinstance(v, Fp4Weight):                          # whole scale blocks move
                if H % v.block:
                    raise CheckpointError(f"{spec['eh_proj.weight'][0]!r}: its [hidden, embed] halves cannot be "
                                          f"swapped at load: hidden_size {H} is not a multiple of {v.block}")
                hb = H // v.block
                return backend.prepare_weight(Fp4Weight(np.concatenate([v.data[:, H // 2:], v.data[:, :H // 2]], axis=1),
                                                        np.concatenate([v.scale[:, hb:], v.scale[:, :hb]], axis=1),
                                                        v.global_scale))
            if not isinstance(v, Fp8Weight):
                return backend.prepare_weight(np.concatenate([v[:, H:], v[:, :H]], axis=1))
            if v.block is None:                                   # per-row scales: the codes move
                return backend.prepare_weight(Fp8Weight(np.concatenate([v.data[:, H:], v.data[:, :H]], axis=1),
                                                        v.scale, None))
            bk = v.block[1]
            if H % bk:
                raise CheckpointError(f"{spec['eh_proj.weight'][0]!r}: its [hidden, embed] halves cannot be "
                                      f"swapped at load: hidden_size {H} is not a multiple of the scale block {bk}")
            hb = H // bk
            return backend.prepare_weight(Fp8Weight(
                np.concatenate([v.data[:, H:], v.data[:, :H]], axis=1),
                np.concatenate([v.scale[:, hb:], v.scale[:, :hb]], axis=1), v.block))

        def kv_a_and_gate(kv_a, g):
            """kv_a_proj_with_mqa's rows over g_proj's (MLA's element-wise gate), one projection:
            stacked as they are stored when both are in one form (dense, FP8 of one scale layout,
            FP4 of one format); else (a container that leaves one of them dense, say) both widened
            to FP32, each weight's value kept, with a note."""
            same = type(kv_a) is type(g) and getattr(kv_a, "block", None) == getattr(g, "block", None) \
                and getattr(kv_a, "fmt", None) == getattr(g, "fmt", None)
            if same:
                return stack_rows(kv_a, g)
            notes.append(f"module {m}: self_attn.kv_a_proj_with_mqa ({_kind(kv_a)}) and self_attn.g_proj "
                         f"({_kind(g)}) are stored in different forms: joined as one FP32 projection")
            return np.concatenate([(t.dequantize() if isinstance(t, (Fp8Weight, Fp4Weight)) else t).astype(np.float32)
                                   for t in (kv_a, g)], axis=0)

        def mla(mw: ModuleWeights) -> None:
            """The MLA tensors: q_a_proj / q_a_layernorm (or none), kv_a_proj_with_mqa (an
            element-wise gate's g_proj rows stacked after its own: ``mla_kv_a`` [L + R + Hq Dv, H],
            whose one GEMV reads the normed input for both) and its norm, kv_b_proj split per head
            into its key and value parts (an FP8 one dequantized to BF16 first, as vLLM's MLA
            does: the absorbed attention reads it at two bytes a weight; FP8 codes times
            power-of-two scales are exact in BF16)."""
            kv_a = w("self_attn.kv_a_proj_with_mqa.weight")
            if blk.attn_gate:                # g_proj's rows (the rank's heads) after kv_a's: one GEMV reads x
                kv_a = kv_a_and_gate(kv_a, heads_of("self_attn.g_proj.weight", blk.v_dim))
            mw.mla_kv_a = backend.prepare_weight(kv_a)
            mw.mla_kv_a_norm = norm("self_attn.kv_a_layernorm.weight", cfg.kv_a_norm_scale)
            if blk.q_lora_rank:
                mw.mla_q_a = backend.prepare_weight(w("self_attn.q_a_proj.weight"))
                mw.mla_q_a_norm = norm("self_attn.q_a_layernorm.weight", cfg.q_a_norm_scale)
            kv_b = heads_of("self_attn.kv_b_proj.weight", blk.qk_nope_head_dim + blk.v_dim)
            if isinstance(kv_b, (Fp8Weight, Fp4Weight)):          # exact in BF16 (FP4: 2 significant bits)
                kv_b = kv_b.dequantize().astype(BF16)
            uk, uv = split_kv_b_proj(kv_b, lblk.num_attention_heads, blk.qk_nope_head_dim, blk.v_dim)
            mw.mla_uk, mw.mla_uv = backend.prepare_weight(uk), backend.prepare_weight(uv)
            if blk.dsa:                      # the indexer: replicated on every rank of a sharded head
                mw.idx_wq_b = backend.prepare_weight(w("self_attn.indexer.wq_b.weight"))
                mw.idx_wk = backend.prepare_weight(w("self_attn.indexer.wk.weight"))
                mw.idx_k_norm_w = backend.prepare_vector(w("self_attn.indexer.k_norm.weight").astype(np.float32))
                mw.idx_k_norm_b = backend.prepare_vector(w("self_attn.indexer.k_norm.bias").astype(np.float32))
                mw.idx_weights = backend.prepare_weight(w("self_attn.indexer.weights_proj.weight"))
                if blk.kpool:
                    mw.idx_gate = backend.prepare_weight(w("self_attn.indexer.index_kpool_compress_gate"))
                    mw.idx_ape = backend.from_host(np.ascontiguousarray(
                        w("self_attn.indexer.index_kpool_compress_ape"), np.float32))

        head_keys = [spec["shared_head.head.weight"][0], fam.target_head]
        if cfg.tie_word_embeddings:
            head_keys.append(fam.target_embed)
        final_norm = norm_host("shared_head.norm.weight")
        _check_logit_bound(rd, m, H, spec["shared_head.norm.weight"][0], final_norm,
                           next((k for k in head_keys if rd.has(k)), None), fam.folds_norm("shared_head.norm.weight"))
        D, Dv = blk.head_dim, blk.v_dim
        hw_gate = blk.attn_gate == "headwise"
        if fam.rope_last and (blk.mla or blk.attn_gate or cfg.attention_bias):
            raise CheckpointError(f"module {m}: {fam.title}'s RoPE on each head's last dims is reordered at load for "
                                  f"a GQA block without an output gate or q/k/v biases; got mla={blk.mla}, "
                                  f"attn_gate={blk.attn_gate!r}, attention_bias={cfg.attention_bias}")

        def o_proj():
            """o_proj's columns (a rank's heads); with shared_kv, each head's in the keys' order."""
            o = w("self_attn.o_proj.weight", cols=None if hs is None else (hs.q0 * Dv, hs.q1 * Dv))
            return rope_first(o, lblk.num_attention_heads, axis=1) if blk.shared_kv else o

        def gqa_qkv():
            """The fused projection's rows: q | k | v (| gate); with q_lora_rank no q (q_b_proj reads
            the query latent); with shared_kv one kv_proj for k and v."""
            kv = [rope_first(heads_of("self_attn.kv_proj.weight" if blk.shared_kv else "self_attn.k_proj.weight",
                                      D, kv=True), lblk.num_key_value_heads)]
            if not blk.shared_kv:
                kv.append(value_scaled(heads_of("self_attn.v_proj.weight", Dv, kv=True)))
            if blk.q_lora_rank:
                return stack_rows(*kv)
            if blk.shared_kv:
                return stack_rows(rope_first(heads_of("self_attn.q_proj.weight", D), lblk.num_attention_heads), *kv)
            return stack_rows(*qkv_rows(rope_first(heads_of("self_attn.q_proj.weight", D), lblk.num_attention_heads),
                                        kv[0], kv[1],
                                        heads_of("self_attn.g_proj.weight", 1) if hw_gate else None))

        mw = ModuleWeights(
            embed=vocab_matrix([spec["embed_tokens.weight"][0], fam.target_embed], f"module {m} embedding"),
            head=vocab_matrix(head_keys, f"module {m} LM head", head_rows),
            enorm=norm("enorm.weight"),
            hnorm=norm("hnorm.weight"),
            eh_proj=eh_proj(),
            input_layernorm=norm("input_layernorm.weight"),
            post_attention_layernorm=norm("post_attention_layernorm.weight"),
            w_qkv=backend.prepare_weight(heads_of("self_attn.q_b_proj.weight" if blk.q_lora_rank
                                                  else "self_attn.q_proj.weight", D))
            if blk.mla else backend.prepare_weight(gqa_qkv()),
            b_qkv=backend.prepare_vector(np.concatenate([p.astype(np.float32) for p in qkv_rows(
                heads_of("self_attn.q_proj.bias", D), heads_of("self_attn.k_proj.bias", D, kv=True),
                value_scaled(heads_of("self_attn.v_proj.bias", Dv, kv=True)),
                np.zeros(lblk.num_attention_heads, np.float32) if hw_gate else None)]))
            if cfg.attention_bias else None,                     # (g_proj has no bias: zeros)
            sinks=backend.prepare_vector(heads_of("self_attn.sinks", 1).astype(np.float32)) if blk.attn_sinks else None,
            q_norm=norm("self_attn.q_norm.weight") if cfg.use_qk_norm else None,
            k_norm=norm("self_attn.k_norm.weight") if cfg.use_qk_norm else None,
            w_o=None if blk.o_groups else backend.prepare_weight(o_proj()),
            shared_head_norm=backend.prepare_vector(final_norm),
        )
        if blk.mla:
            mla(mw)
        elif blk.q_lora_rank:                # a GQA query through its own latent (DeepSeek-V4)
            mw.mla_q_a = backend.prepare_weight(w("self_attn.q_a_proj.weight"))
            mw.mla_q_a_norm = norm("self_attn.q_a_layernorm.weight", cfg.q_a_norm_scale)
            mw.q_b = backend.prepare_weight(rope_first(heads_of("self_attn.q_b_proj.weight", D),
                                                       lblk.num_attention_heads))
        if blk.o_groups:                     # grouped low-rank output: o_a_proj per group, then o_b_proj
            g, r = blk.o_groups, blk.o_lora_rank
            # a rank's groups g0 .. g1 - 1 (its heads): their r rows of o_a_proj each and
            # o_b_proj's columns g0 r .. g1 r - 1; its [n, H] partial product meets o_proj's all-reduce
            g0, g1 = (0, g) if shard is None else shard.groups(blk, f" (module {m})")
            sl = None if shard is None else (g0 * r, g1 * r)
            o_a = w("self_attn.o_a_proj.weight", rows=sl)                          # [(g1 - g0) r, Hq Dv / g]
            if blk.shared_kv:                # the values are keys: their dims in the keys' order
                o_a = rope_first(o_a, blk.num_attention_heads // g, axis=1)
            mw.w_o_a = [backend.prepare_weight(_row_slice(o_a, i * r, (i + 1) * r)) for i in range(g1 - g0)]
            mw.w_o_b = backend.prepare_weight(w("self_attn.o_b_proj.weight", cols=sl))   # [H, (g1 - g0) r]
        if cfg.hc_mult > 1:                  # replicated on every rank of a sharded head
            def hc(part: str) -> tuple:
                """(fn, base, scale) of one collapse, as FP32 (fn a weight, the others vectors)."""
                host = [np.ascontiguousarray(read(*spec[f"hc_{part}_{k}"][:2]), np.float32)
                        for k in ("fn", "base", "scale")]
                return backend.prepare_weight(host[0]), backend.prepare_vector(host[1]), backend.prepare_vector(host[2])

            mw.hc_attn, mw.hc_ffn, mw.hc_head = hc("attn"), hc("ffn"), hc("head")
            mw.hc_ones = backend.prepare_vector(np.ones(cfg.stream_size, np.float32))

        relu2 = blk.mlp_act == "relu2"       # non-gated MLPs (Nemotron-H): w13 is up_proj alone

        def swiglu(pre: str, I: int, what: str):
            """(w13 [2I', H], w2 [H, I']) of a SwiGLU under ``pre``: gate over up rows, and the
            down projection; a sharded head's intermediate slice I' of I. relu2: w13 [I', H] = up."""
            sl = None if shard is None else shard.span(I, what)
            if relu2:
                return w(f"{pre}up_proj.weight", rows=sl), w(f"{pre}down_proj.weight", cols=sl)
            gate, up = (w(f"{pre}{n}_proj.weight", rows=sl) for n in ("gate", "up"))
            return stack_rows(gate, up), w(f"{pre}down_proj.weight", cols=sl)

        if blk.moe:
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            mw.gate_w = backend.prepare_weight(w("mlp.gate.weight"))
            if cfg.moe_latent_size:
                # a sharded head: both projections whole on every rank (the experts split as ever);
                # each rank's fc2(partial latent sum) is its share of fc2(sum), met in the FFN's
                # all-reduce. With the latent norm every rank has the whole sum (MtpHead sums it
                # first) and the norm's weight lives on the rank that adds the residual, zeros on the
                # others: fc2 is linear in it, so the ranks' outputs add up to fc2(norm(sum)) once.
                mw.latent_fc1 = backend.prepare_weight(w("mlp.fc1_latent_proj.weight"))
                mw.latent_fc2 = backend.prepare_weight(w("mlp.fc2_latent_proj.weight"))
                if cfg.moe_latent_norm:
                    g = norm_host("mlp.latent_norm.weight")
                    if shard is not None and not shard.owns_residual:
                        g = np.zeros_like(g)
                    mw.latent_norm = backend.prepare_vector(g)
            mw.gate_bias = backend.prepare_vector(w("mlp.gate.e_score_correction_bias") if cfg.router_bias
                                                  else np.zeros(E, np.float32))     # selection without a bias
            e0, e1 = (0, E) if shard is None else shard.expert_range(E)              # experts held whole (EP)
            part_i = (0, I) if shard is None else shard.routed_slice(I)             # each expert's slice (TP)
            sl = None if part_i == (0, I) else part_i
            if relu2 and (fam.packed_experts or GATE_UP in spec):
                raise CheckpointError(f"{rd.path}: module {m}: mlp_act 'relu2' expects the experts one tensor "
                                      f"per expert (mlp.experts.{{e}}.up_proj.weight, as released), got packed experts")
            if fam.packed_experts or GATE_UP in spec:
                mw.experts_w13 = backend.prepare_weight(packed_w13(e0, e1, sl))
                w2 = packed(DOWN_PACKED if GATE_UP in spec else "mlp.experts.down_proj.weight", e0, e1, sl, 2)
                mw.experts_w2 = backend.prepare_weight(w2 if isinstance(w2, (Fp8Weight, Fp4Weight))
                                                       else np.ascontiguousarray(w2))
            else:
                mw.experts_w13 = backend.prepare_weight(stacked([
                    ([] if relu2 else [(f"mlp.experts.{e}.gate_proj.weight", sl, None)])
                    + [(f"mlp.experts.{e}.up_proj.weight", sl, None)]
                    for e in range(e0, e1)]))
                mw.experts_w2 = backend.prepare_weight(stacked([[(f"mlp.experts.{e}.down_proj.weight", None, sl)]
                                                                for e in range(e0, e1)]))
            if cfg.n_shared_experts:
                w13, w2 = swiglu("mlp.shared_experts.", cfg.shared_intermediate_size,
                                 "the shared experts' intermediate size")
                mw.shared_w13, mw.shared_w2 = backend.prepare_weight(w13), backend.prepare_weight(w2)
                if cfg.shared_expert_gate:
                    mw.shared_gate = backend.prepare_weight(w("mlp.shared_expert_gate.weight"))
        else:
            w13, w2 = swiglu("mlp.", cfg.intermediate_size, "intermediate_size")
            mw.mlp_w13, mw.mlp_w2 = backend.prepare_weight(w13), backend.prepare_weight(w2)
        modules.append(mw)
        if dense_under.get(m):
            keys = sorted(set(dense_under[m]))
            listed = [k for k in keys if ignored_by(cfg, k)]
            other = [k for k in keys if not ignored_by(cfg, k)]
            notes.append(f"module {m}: {len(keys)} projection(s) stored dense under the {cfg.quant_container} "
                         f"container, loaded dense" + (f"; in its ignore list: {', '.join(listed[:3])}"
                                                       f"{', ...' if len(listed) > 3 else ''}" if listed else "")
                         + (f"; not in its ignore list (no packed or scale tensors): {', '.join(other[:3])}"
                            f"{', ...' if len(other) > 3 else ''}" if other else ""))

    target_norm = None
    if apply_target_norm:
        if not rd.has(fam.target_norm):
            raise CheckpointError(f"apply_target_norm=True needs the target's {fam.target_norm!r}, "
                                  f"missing from the checkpoint at {rd.path}")
        tn = read(fam.target_norm, (H,))
        target_norm = backend.prepare_vector(tn.astype(np.float32) + 1.0 if fam.zero_centred else tn)
    return MtpWeights(cfg, modules, target_norm, nbytes, len(by_digest), notes, shard,
                      None if head_ids is None else np.asarray(head_ids, np.int32))


# -- target decoder layers (mtpkern.target) -----------------------------------

#: the model family whose target layers ``load_target_weights`` reads
TARGET_FAMILIES = ("glm4_moe",)


def check_target_config(cfg: MtpConfig, what: str) -> None:
    """Refuse (``ConfigError`` naming ``what`` and the field) a config whose target layers
    ``load_target_weights`` would not read as the release runs them: a family other than
    ``TARGET_FAMILIES``, quantized weights, per-module block overrides, or a block feature
    GLM-4.5's decoder layer does not have."""
    if cfg.family not in TARGET_FAMILIES:
        raise ConfigError(f"{what}: the target's decoder layers are run for model_type "
                          f"{' / '.join(TARGET_FAMILIES)} only, got {cfg.family or 'the canonical layout'!r}")
    fields = {"weight_quant": "", "expert_quant": "", "quant_container": "", "hc_mult": 1, "blocks": (),
              "moe_latent_size": 0, "shared_expert_gate": False, "embed_mask_pos0": False}
    for name, want in fields.items():
        got = getattr(cfg, name)
        if got != want and not (name == "blocks" and not got):
            raise ConfigError(f"{what}: a glm4_moe target layer expects {name} = {want!r}, got {got!r}")
    b = cfg.block_default()
    for name, got in (("mla", b.mla), ("sliding_window", b.sliding_window), ("attn_sinks", b.attn_sinks),
                      ("attn_gate", b.attn_gate), ("mlp_act", b.mlp_act if b.mlp_act != "swiglu" else ""),
                      ("swiglu_clamp", b.swiglu_clamp or b.swiglu_clamp_shared), ("q_lora_rank", b.q_lora_rank)):
        if got:
            raise ConfigError(f"{what}: a glm4_moe target layer has no {name}, got {got!r}")


@dataclass(slots=True, repr=False)
class TargetWeights:
    """A target model's decoder layers and its output side (backend arrays unless noted)."""

    layers: list[ModuleWeights]   # one per layer: embed, head, enorm, hnorm, eh_proj, shared_head_norm None
    blocks: list[Any]             # each layer's BlockSpec (MtpConfig.target_block)
    embed: np.ndarray             # [V, H] host, as stored (BF16 / FP32): rows gathered on the host
    head: Any                     # [V, H] lm_head (or the embedding, tie_word_embeddings)
    norm: Any                     # [H] FP32 model.norm
    nbytes: int = 0

    def __repr__(self) -> str:
        kinds = "".join("m" if b.moe else "d" for b in self.blocks)
        return f"TargetWeights({len(self.layers)} layers [{kinds}], {self.nbytes} bytes read)"


def _target_layer_keys(cfg: MtpConfig, b: Any, packed: bool = False) -> dict[str, tuple[int, ...]]:
    """Suffix -> shape of a glm4_moe target decoder layer with block ``b`` (``Glm4MoeDecoderLayer``'s
    parameters: an MTP module's without enorm / hnorm / eh_proj / shared_head); ``packed``: its
    routed experts as transformers' packed pair (``GATE_UP`` / ``DOWN_PACKED``)."""
    H, D, Hq, Hkv = cfg.hidden_size, b.head_dim, b.num_attention_heads, b.num_key_value_heads
    keys = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
            "self_attn.q_proj.weight": (Hq * D, H), "self_attn.k_proj.weight": (Hkv * D, H),
            "self_attn.v_proj.weight": (Hkv * D, H), "self_attn.o_proj.weight": (H, Hq * D)}
    if cfg.attention_bias:
        keys.update({"self_attn.q_proj.bias": (Hq * D,), "self_attn.k_proj.bias": (Hkv * D,),
                     "self_attn.v_proj.bias": (Hkv * D,)})
    if cfg.use_qk_norm:
        keys.update({"self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,)})
    if b.moe:
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        keys["mlp.gate.weight"] = (E, H)
        if cfg.router_bias:
            keys["mlp.gate.e_score_correction_bias"] = (E,)
        if packed:
            keys[GATE_UP], keys[DOWN_PACKED] = (E, 2 * I, H), (E, H, I)
        for e in range(0 if packed else E):
            keys.update({f"mlp.experts.{e}.{n}_proj.weight": (I, H) for n in ("gate", "up")})
            keys[f"mlp.experts.{e}.down_proj.weight"] = (H, I)
        if cfg.n_shared_experts:
            Is = cfg.shared_intermediate_size
            keys.update({f"mlp.shared_experts.{n}_proj.weight": (Is, H) for n in ("gate", "up")})
            keys["mlp.shared_experts.down_proj.weight"] = (H, Is)
    else:
        I = cfg.intermediate_size
        keys.update({"mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I)})
    return keys


def load_target_weights(path: str | os.PathLike, cfg: MtpConfig, backend: Any) -> TargetWeights:
    """Read the target's decoder layers ``model.layers.{0 .. num_hidden_layers - 1}`` and its
    embedding, final norm and LM head from the checkpoint at ``path`` onto ``backend``, in the
    forms ``MtpHead`` runs a module's (q | k | v rows stacked, gate over up rows, experts
    ``[E, 2I, H]`` / ``[E, H, I]``; stored one tensor per expert, or as transformers' packed
    ``mlp.experts.gate_up_proj`` / ``down_proj``). ``check_target_config`` first; then every layer's tensors
    are checked (missing, mis-shaped, non-finite: ``CheckpointError`` naming the tensor), and a
    tensor under a layer's prefix that the layer would not read is refused by name."""
    check_target_config(cfg, "config")
    rd = CheckpointReader(path)
    fam = family(cfg.family)
    V, H = cfg.vocab_size, cfg.hidden_size
    nbytes = 0

    def read(key: str, shape: tuple[int, ...]) -> np.ndarray:
        nonlocal nbytes
        if not rd.has(key):
            raise CheckpointError(f"tensor {key!r}: missing from the checkpoint at {rd.path} (a target decoder "
                                  f"layer's; write_synthetic_checkpoint(..., target_layers=True) writes them)")
        a = rd.get(key, shape)
        nbytes += a.nbytes
        return a

    def rows(*parts: np.ndarray) -> np.ndarray:
        """Row-stacked projections: BF16 when all are, else FP32 (as ``load_weights``)."""
        dt = BF16 if all(p.dtype == BF16 for p in parts) else np.float32
        return np.concatenate([p.astype(dt, copy=False) for p in parts], axis=0)

    layers, blocks = [], []
    for layer in range(cfg.num_hidden_layers):
        b = cfg.target_block(layer)
        pre = f"model.layers.{layer}."
        packed = b.moe and rd.has(pre + GATE_UP)
        spec = _target_layer_keys(cfg, b, packed)
        unused = sorted(set(rd.keys_under(pre)) - {pre + s for s in spec})
        if unused:
            raise CheckpointError(f"tensor {unused[0]!r}: under target layer {layer}'s prefix but not read by its "
                                  f"{'MoE' if b.moe else 'dense'} block ({len(unused)} such tensor(s))")

        def w(suffix: str, pre: str = pre, spec: dict = spec) -> np.ndarray:
            return read(pre + suffix, spec[suffix])

        def vec(suffix: str) -> Any:
            return backend.prepare_vector(w(suffix).astype(np.float32))

        lw = ModuleWeights(
            embed=None, head=None, enorm=None, hnorm=None, eh_proj=None,
            input_layernorm=vec("input_layernorm.weight"),
            post_attention_layernorm=vec("post_attention_layernorm.weight"),
            w_qkv=backend.prepare_weight(rows(*(w(f"self_attn.{n}_proj.weight") for n in "qkv"))),
            b_qkv=backend.prepare_vector(np.concatenate([w(f"self_attn.{n}_proj.bias").astype(np.float32)
                                                         for n in "qkv"])) if cfg.attention_bias else None,
            q_norm=vec("self_attn.q_norm.weight") if cfg.use_qk_norm else None,
            k_norm=vec("self_attn.k_norm.weight") if cfg.use_qk_norm else None,
            w_o=backend.prepare_weight(w("self_attn.o_proj.weight")),
            shared_head_norm=None)
        if b.moe:
            E = cfg.n_routed_experts
            lw.gate_w = backend.prepare_weight(w("mlp.gate.weight"))
            lw.gate_bias = backend.prepare_vector(w("mlp.gate.e_score_correction_bias").astype(np.float32)
                                                  if cfg.router_bias else np.zeros(E, np.float32))
            if packed:                       # [E, 2I, H]: each expert's gate rows over its up rows
                lw.experts_w13 = backend.prepare_weight(np.ascontiguousarray(w(GATE_UP)))
                lw.experts_w2 = backend.prepare_weight(np.ascontiguousarray(w(DOWN_PACKED)))
            else:
                lw.experts_w13 = backend.prepare_weight(np.stack([rows(w(f"mlp.experts.{e}.gate_proj.weight"),
                                                                       w(f"mlp.experts.{e}.up_proj.weight"))
                                                                  for e in range(E)]))
                lw.experts_w2 = backend.prepare_weight(np.stack([w(f"mlp.experts.{e}.down_proj.weight")
                                                                 for e in range(E)]))
            if cfg.n_shared_experts:
                lw.shared_w13 = backend.prepare_weight(rows(w("mlp.shared_experts.gate_proj.weight"),
                                                            w("mlp.shared_experts.up_proj.weight")))
                lw.shared_w2 = backend.prepare_weight(w("mlp.shared_experts.down_proj.weight"))
        else:
            lw.mlp_w13 = backend.prepare_weight(rows(w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")))
            lw.mlp_w2 = backend.prepare_weight(w("mlp.down_proj.weight"))
        layers.append(lw)
        blocks.append(b)
    embed = read(fam.target_embed, (V, H))
    head = embed if cfg.tie_word_embeddings else read(fam.target_head, (V, H))
    norm = backend.prepare_vector(read(fam.target_norm, (H,)).astype(np.float32))
    return TargetWeights(layers, blocks, embed, backend.prepare_weight(head), norm, nbytes)


# -- synthetic checkpoints ---------------------------------------------------

def synthetic_tensors(cfg: MtpConfig, seed: int = 0, own_embed: bool = False,
                      own_head: bool = False, target_layers: bool = False) -> dict[str, np.ndarray]:
    """FP32 tensors of a complete checkpoint in the canonical layout (docs/model.md); with
    ``target_layers``, the target's decoder layers ``model.layers.{0 .. num_hidden_layers - 1}``
    too (``MtpConfig.target_block``: dense for the first ``first_k_dense_replace``, MoE after),
    drawn after every module's tensors, so the modules' values do not depend on it.

    Scales keep activations O(1) and make the LM head decisive (logit spreads of
    several units), so argmax ties are improbable in tests.
    """
    rng = np.random.default_rng(seed)
    H, V = cfg.hidden_size, cfg.vocab_size

    def mat(rows, cols, gain=1.0):
        return (rng.standard_normal((rows, cols)) * (gain / np.sqrt(cols))).astype(np.float32)

    def norm_w(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((V, H)).astype(np.float32),
        "lm_head.weight": mat(V, H, gain=4.0),
        "model.norm.weight": norm_w(H),
    }

    def decoder_layer(p: str, b: BlockSpec) -> None:
        """The tensors of one decoder layer under prefix ``p`` (an MTP module's, or a target
        layer's), from input_layernorm to the MLP."""
        H = cfg.hidden_size
        D, Hq = b.head_dim, b.num_attention_heads
        q_rows = b.q_size + (b.gate_size if b.q_gate else 0)     # [queries; gates]
        t[p + "input_layernorm.weight"] = norm_w(H)
        t[p + "post_attention_layernorm.weight"] = norm_w(H)
        if b.mla:
            L, R, Q = b.kv_lora_rank, b.qk_rope_head_dim, b.q_lora_rank
            t[p + "self_attn.kv_a_proj_with_mqa.weight"] = mat(L + R, H, gain=2.0)
            t[p + "self_attn.kv_a_layernorm.weight"] = norm_w(L)
            t[p + "self_attn.kv_b_proj.weight"] = mat(Hq * (b.qk_nope_head_dim + b.v_dim), L, gain=2.0)
            if Q:
                t[p + "self_attn.q_a_proj.weight"] = mat(Q, H)
                t[p + "self_attn.q_a_layernorm.weight"] = norm_w(Q)
                t[p + "self_attn.q_b_proj.weight"] = mat(b.q_size, Q, gain=2.0)
            else:
                t[p + "self_attn.q_proj.weight"] = mat(b.q_size, H, gain=2.0)
            if b.dsa:
                Hi, Di = b.index_n_heads, b.index_head_dim
                t[p + "self_attn.indexer.wq_b.weight"] = mat(Hi * Di, Q, gain=2.0)
                t[p + "self_attn.indexer.wk.weight"] = mat(Di, H, gain=2.0)
                t[p + "self_attn.indexer.k_norm.weight"] = norm_w(Di)
                t[p + "self_attn.indexer.k_norm.bias"] = (rng.standard_normal(Di) * 0.1).astype(np.float32)
                t[p + "self_attn.indexer.weights_proj.weight"] = mat(Hi, H, gain=2.0)
                if b.kpool:
                    t[p + "self_attn.indexer.index_kpool_compress_gate"] = mat(Di, H, gain=2.0)
                    t[p + "self_attn.indexer.index_kpool_compress_ape"] = \
                        rng.standard_normal((b.kpool, Di)).astype(np.float32)
            if b.attn_gate:                  # an element-wise gate of its own (Kimi K3's g_proj [Hq Dv, H])
                t[p + "self_attn.g_proj.weight"] = mat(b.gate_size, H, gain=2.0)
        else:
            if b.q_lora_rank:
                Q = b.q_lora_rank
                t[p + "self_attn.q_a_proj.weight"] = mat(Q, H)
                t[p + "self_attn.q_a_layernorm.weight"] = norm_w(Q)
                t[p + "self_attn.q_b_proj.weight"] = mat(b.q_size, Q, gain=2.0)
            else:
                t[p + "self_attn.q_proj.weight"] = mat(q_rows, H, gain=2.0)
            if b.shared_kv:
                t[p + "self_attn.kv_proj.weight"] = mat(b.k_size, H, gain=2.0)
            else:
                t[p + "self_attn.k_proj.weight"] = mat(b.k_size, H, gain=2.0)
                t[p + "self_attn.v_proj.weight"] = mat(b.v_size, H)
        if b.o_groups:
            g, r = b.o_groups, b.o_lora_rank
            t[p + "self_attn.o_a_proj.weight"] = mat(g * r, b.o_size // g)
            t[p + "self_attn.o_b_proj.weight"] = mat(H, g * r)
        else:
            t[p + "self_attn.o_proj.weight"] = mat(H, b.o_size)
        if cfg.hc_mult > 1:                  # hyper-connections: FP32 as released
            for name, (shape, _) in _hc_keys(cfg.hc_mult, H).items():
                t[p + name] = (rng.standard_normal(shape) * (shape[1] ** -0.5 if len(shape) == 2 else 1.5)
                               + (1.0 if name.endswith("_scale") else 0.0)).astype(np.float32)
        if cfg.attention_bias:
            for name, n in (("q", q_rows), ("k", b.k_size), ("v", b.v_size)):
                t[p + f"self_attn.{name}_proj.bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
        if cfg.use_qk_norm:
            t[p + "self_attn.q_norm.weight"] = norm_w(D)
            t[p + "self_attn.k_norm.weight"] = norm_w(D)
        if b.attn_gate == "headwise":
            t[p + "self_attn.g_proj.weight"] = mat(Hq, H, gain=2.0)
        if b.attn_sinks:                        # logits of the order of the scores: a sink matters
            t[p + "self_attn.sinks"] = rng.standard_normal(Hq).astype(np.float32)
        if b.moe:
            E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
            t[p + "mlp.gate.weight"] = mat(E, H, gain=2.0)
            if cfg.router_bias:
                t[p + "mlp.gate.e_score_correction_bias"] = (0.05 * rng.standard_normal(E)).astype(np.float32)
            gated = b.mlp_act != "relu2"        # relu2: no gate_proj
            Lt = cfg.moe_latent_size
            if Lt:
                t[p + "mlp.fc1_latent_proj.weight"] = mat(Lt, H)
                t[p + "mlp.fc2_latent_proj.weight"] = mat(H, Lt)
                if cfg.moe_latent_norm:
                    t[p + "mlp.latent_norm.weight"] = norm_w(Lt)
            H, H_model = (Lt or H), H
            for e in range(E):
                if gated:
                    t[p + f"mlp.experts.{e}.gate_proj.weight"] = mat(I, H)
                t[p + f"mlp.experts.{e}.up_proj.weight"] = mat(I, H)
                t[p + f"mlp.experts.{e}.down_proj.weight"] = mat(H, I)
            H = H_model
            if cfg.n_shared_experts:
                Is = cfg.shared_intermediate_size
                if gated:
                    t[p + "mlp.shared_experts.gate_proj.weight"] = mat(Is, H)
                t[p + "mlp.shared_experts.up_proj.weight"] = mat(Is, H)
                t[p + "mlp.shared_experts.down_proj.weight"] = mat(H, Is)
                if cfg.shared_expert_gate:
                    t[p + "mlp.shared_expert_gate.weight"] = mat(1, H, gain=2.0)
        else:
            I = cfg.intermediate_size
            if b.mlp_act != "relu2":
                t[p + "mlp.gate_proj.weight"] = mat(I, H)
            t[p + "mlp.up_proj.weight"] = mat(I, H)
            t[p + "mlp.down_proj.weight"] = mat(H, I)

    for m in range(cfg.num_modules):
        p = f"model.layers.{cfg.layer_index(m)}."
        t[p + "enorm.weight"] = norm_w(H)
        t[p + "hnorm.weight"] = norm_w(H)
        t[p + "eh_proj.weight"] = mat(H, 2 * H)
        decoder_layer(p, cfg.block(m))
        t[p + "shared_head.norm.weight"] = norm_w(H)
        if own_embed:
            t[p + "embed_tokens.weight"] = t["model.embed_tokens.weight"].copy()
        if own_head:
            t[p + "shared_head.head.weight"] = t["lm_head.weight"].copy()
    if target_layers:
        for layer in range(cfg.num_hidden_layers):
            decoder_layer(f"model.layers.{layer}.", cfg.target_block(layer))
    fam = family(cfg.family)
    for m in range(cfg.num_modules):          # norms the family's release has no weight for: ones
        for suffix in fam.unit_norms:
            key = f"model.layers.{cfg.layer_index(m)}.{suffix}"
            if key in t:
                t[key] = np.ones_like(t[key])
    first = f"model.layers.{cfg.layer_index(0)}."
    for m in range(1, cfg.num_modules):       # what the family's modules share (one tensor in its
        p = f"model.layers.{cfg.layer_index(m)}."        # release, Qwen3-Next's mtp.fc) is one value
        for key in [k for k in t if k.startswith(p)]:
            suffix = key[len(p):]
            if fam.key(cfg.layer_index(m), m, suffix) == fam.key(cfg.layer_index(0), 0, suffix):
                t[key] = t[first + suffix].copy()
    return t


def quantize_projections(cfg: MtpConfig, tensors: dict[str, np.ndarray],
                         pow2_scales: bool = False) -> dict[str, np.ndarray]:
    """``tensors`` (canonical names) with every module projection in FP8 E4M3 and its
    scale tensor beside it, as ``cfg``'s ``quantization_config`` describes (block or
    per-channel). ``pow2_scales``: scales rounded up to powers of two, so that the
    dequantized weights are exact in FP32 and an FP8 run can equal an FP32 one bit
    for bit (a test's wish; releases use amax / 448).

    With ``cfg.expert_quant == "fp4"`` (DeepSeek-V4's layout) the routed experts' projections
    are FP4 instead (``Fp4Weight.quantize``: int8 [N, K / 2] packed codes and a
    ``weight_scale_inv`` of E8M0 codes [N, K / 32]), and the FP8 ones get power-of-two scales
    stored as E8M0 (``scale_fmt: "ue8m0"``)."""
    block = cfg.fp8_block if cfg.fp8_block != (0, 0) else None
    v4 = cfg.expert_quant == "fp4"
    out = {}
    for key, a in tensors.items():
        suffix = key.split(".", 3)[-1] if key.startswith("model.layers.") else ""
        if not (_is_projection(suffix) and key.startswith("model.layers.")):
            out[key] = a
            continue
        if v4 and _EXPERT.match(suffix):
            q4 = Fp4Weight.quantize(a)
            out[key] = q4.data.view(np.int8)
            out[_canonical_scale_key(cfg, key)] = q4.scale.view(ml_dtypes.float8_e8m0fnu)
            continue
        q = Fp8Weight.quantize(a, block)
        if pow2_scales or v4:
            scale = np.exp2(np.ceil(np.log2(q.scale))).astype(np.float32)
            codes = np.clip(a / Fp8Weight(q.data, scale, block).scale_per_element(), -448.0, 448.0)
            q = Fp8Weight(codes.astype(ml_dtypes.float8_e4m3fn).view(np.uint8), scale, block)
        out[key] = q.data.view(ml_dtypes.float8_e4m3fn)
        out[_canonical_scale_key(cfg, key)] = q.scale if not v4 else \
            (np.log2(q.scale).astype(np.int32) + 127).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)
    return out


#: the attention tensors whose head dims a ``rope_last`` family stores rotary-last: suffix ->
#: (axis, query heads or key heads), the output projections only where the value is the key
_ROPE_LAST = {"self_attn.q_proj.weight": (0, "q"), "self_attn.q_b_proj.weight": (0, "q"),
              "self_attn.k_proj.weight": (0, "k"), "self_attn.kv_proj.weight": (0, "k"),
              "self_attn.k_norm.weight": (0, 1), "self_attn.q_norm.weight": (0, 1),
              "self_attn.o_proj.weight": (1, "o"), "self_attn.o_a_proj.weight": (1, "o")}


def _rope_last_order(cfg: MtpConfig, m: int, base: str, a: np.ndarray) -> np.ndarray:
    """Module ``m``'s dense tensor ``base`` with each head's first R dims moved last: the
    release order of a ``rope_last`` family (the inverse of the loader's ``rope_first``)."""
    b = cfg.block(m)
    axis, heads = _ROPE_LAST.get(base, (None, None))
    if axis is None or (heads == "o" and not b.shared_kv):
        return a
    heads = {"q": b.num_attention_heads, "k": b.num_key_value_heads,
             "o": b.num_attention_heads // max(b.o_groups, 1)}.get(heads, heads)
    order, unit = rope_first_order(heads, b.head_dim, b.rotary_dim)
    return take_units(a, axis, np.argsort(order), unit)


def rope_release_order(cfg: MtpConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Dense canonical ``tensors`` with the head dims of a ``rope_last`` family in its release
    order (rotary dims last), before any quantization (``write_synthetic_checkpoint``)."""
    if not family(cfg.family).rope_last:
        return tensors
    out = dict(tensors)
    for m in range(cfg.num_modules):
        p = f"model.layers.{cfg.layer_index(m)}."
        for base in _ROPE_LAST:
            if p + base in out:
                out[p + base] = _rope_last_order(cfg, m, base, out[p + base])
    return out


def release_layout(cfg: MtpConfig, tensors: dict[str, np.ndarray], rope_ordered: bool = False,
                   packed_gate_up: bool = False) -> dict[str, np.ndarray]:
    """``tensors`` (canonical names, as ``synthetic_tensors`` makes them) renamed and
    unfolded into ``cfg.family``'s release layout: the checkpoint a family's own
    release would be, which ``load_weights`` folds back to the same module.
    ``rope_ordered``: a ``rope_last`` family's head dims are already in the release's order
    (``rope_release_order``, as quantized tensors must be); else dense ones are reordered
    here and quantized ones refused. ``packed_gate_up``: the routed experts as transformers'
    packed pair (``GATE_UP`` [E, 2I, H], each expert's gate rows over its up rows, and
    ``DOWN_PACKED`` [E, H, I]: how Qwen3.6 releases them); FP8 experts packed with their
    scales beside them (``GATE_UP + "_scale_inv"`` [E, 2I / bn, H / bk], transformers'
    fine-grained FP8 names), each expert's gate scale rows over its up ones (I a multiple of
    the block's rows)."""
    fam = family(cfg.family)
    if packed_gate_up and fam.packed_experts:
        raise ValueError(f"packed_gate_up: {fam.title} packs its experts its own way (Family.packed_experts)")
    H = cfg.hidden_size
    out = {}
    packs: dict[str, dict[int, np.ndarray]] = {}     # a packed-experts family: key -> expert -> tensor
    gate_ups: dict[tuple[int, str, str], dict[int, np.ndarray]] = {}   # (module, gate / up, tail) -> expert -> rows
    for key, a in tensors.items():
        for m in range(cfg.num_modules):
            canon = f"model.layers.{cfg.layer_index(m)}."
            if key.startswith(canon):
                suffix = key[len(canon):]
                base, tail = suffix, ""
                for t in ("_scale_inv", "_scale"):             # an FP8 scale follows its weight's name
                    if suffix.endswith(".weight" + t):
                        base, tail = suffix[:-len(t)], t
                expert = _EXPERT.match(base) if (fam.packed_experts or packed_gate_up) else None
                if expert is not None and packed_gate_up:      # transformers' [E, 2I, H] and [E, H, I]
                    if tail == "_scale_inv" and cfg.moe_intermediate_size % cfg.fp8_block[0]:
                        raise ValueError(f"tensors: {key!r}: moe_intermediate_size {cfg.moe_intermediate_size} is "
                                         f"not a multiple of the scale block's {cfg.fp8_block[0]} rows; the gate and "
                                         f"up scales cannot be packed")
                    if expert.group(2) == "down":
                        packs.setdefault(fam.key(cfg.layer_index(m), m, DOWN_PACKED) + tail, {})[
                            int(expert.group(1))] = a
                    else:
                        gate_ups.setdefault((m, expert.group(2), tail), {})[int(expert.group(1))] = a
                    key = None
                    break
                if expert is not None:                         # one tensor [E, ...] per projection
                    packed = fam.key(cfg.layer_index(m), m, f"mlp.experts.{expert.group(2)}_proj.weight") + tail
                    packs.setdefault(packed, {})[int(expert.group(1))] = a
                    key = None
                    break
                if fam.rope_last and not rope_ordered and base in _ROPE_LAST:
                    if tail or a.dtype.itemsize == 1:
                        raise ValueError(f"tensors: {key!r} is quantized; a {fam.title} checkpoint's head dims "
                                         f"are reordered before quantization (rope_release_order)")
                    a = _rope_last_order(cfg, m, base, a)
                if base in fam.unit_norms:                     # no such tensor in the release
                    key = None
                    break
                if base == "eh_proj.weight" and fam.split_eh_proj:       # two [H, H] projections
                    half = H if not tail else H // cfg.fp8_block[1]
                    if tail and H % cfg.fp8_block[1]:
                        raise ValueError(f"tensors: {key!r}: hidden_size {H} is not a multiple of the scale "
                                         f"block {cfg.fp8_block[1]}; e_proj / h_proj cannot be split")
                    for name, part in (("e_proj.weight", a[:, :half]), ("h_proj.weight", a[:, half:])):
                        k2 = fam.key(cfg.layer_index(m), m, name)
                        out[fam.scale_key(k2, tail == "_scale_inv") if tail else k2] = np.ascontiguousarray(part)
                    key = None
                    break
                if base == "eh_proj.weight" and fam.concat == "hidden_embed" and tail != "_scale":
                    half = H if not tail else H // cfg.fp8_block[1]      # block scales move with their columns
                    a = np.concatenate([a[:, half:], a[:, :half]], axis=1)
                if fam.folds_norm(suffix):
                    a = a - np.float32(1.0)
                scale = {"self_attn.q_a_layernorm.weight": cfg.q_a_norm_scale,
                         "self_attn.kv_a_layernorm.weight": cfg.kv_a_norm_scale}.get(base, 1.0)
                if scale != 1.0:                                 # the release stores the unscaled norm
                    a = a / np.float32(scale)
                if base in ("self_attn.v_proj.weight", "self_attn.v_proj.bias") and cfg.attention_value_scale != 1 \
                        and (tail or a.dtype.itemsize > 1):      # FP8: its scales carry the factor
                    a = a / np.float32(cfg.attention_value_scale)
                blk = cfg.block(m)
                if fam.q_gate_interleaved and base in ("self_attn.q_proj.weight", "self_attn.q_proj.bias") \
                        and blk.q_gate:                         # [queries; gates] -> [q_h | g_h] per head
                    Hq = blk.num_attention_heads
                    rows = blk.head_dim // (cfg.fp8_block[0] if tail == "_scale_inv" else 1)   # block scale rows
                    q, g = a[:Hq * rows].reshape(Hq, rows, -1), a[Hq * rows:].reshape(Hq, rows, -1)
                    a = np.concatenate([q, g], axis=1).reshape(a.shape)
                key = fam.key(cfg.layer_index(m), m, base)
                key = fam.scale_key(key, tail == "_scale_inv") if tail else key
                break
        else:
            key = {"model.embed_tokens.weight": fam.target_embed, "lm_head.weight": fam.target_head,
                   "model.norm.weight": fam.target_norm}.get(key, key)
        if key is None:
            continue
        if key in out and not np.array_equal(out[key], a):
            raise ValueError(f"tensors: two tensors become {key!r} in the {fam.title} layout (a tensor its "
                             f"modules share) with different values")
        out[key] = a
    for key, experts in packs.items():
        out[key] = np.stack([experts[e] for e in range(len(experts))])
    for m, tail in sorted({(m, tail) for m, _, tail in gate_ups}):
        gate, up = gate_ups[m, "gate", tail], gate_ups[m, "up", tail]
        out[fam.key(cfg.layer_index(m), m, GATE_UP) + tail] = np.stack(
            [np.concatenate([gate[e], up[e]], axis=0) for e in range(len(gate))])
    return out


#: a canonical per-expert projection: ``mlp.experts.{e}.{gate,up,down}_proj.weight``
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def write_synthetic_checkpoint(path: str | os.PathLike, cfg: MtpConfig, seed: int = 0,
                               dtype: str = "bfloat16", shards: int = 1, own_embed: bool = False,
                               own_head: bool = False, pow2_scales: bool = False,
                               packed_gate_up: bool = False, target_layers: bool = False) -> Path:
    """Write ``config.json`` and a complete synthetic checkpoint to ``path``.

    ``dtype``: "bfloat16" or "float32"; ``shards > 1`` writes
    ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``;
    ``own_embed`` / ``own_head`` give every module its own (identical) copy of
    the embedding / LM head, as DeepSeek-V3 checkpoints do. The tensors are laid out
    as ``cfg.family``'s release names them (``release_layout``); with
    ``cfg.weight_quant == "fp8"`` the projections are FP8 E4M3 with their scales
    (``quantize_projections``; ``pow2_scales`` as there), the rest in ``dtype``.
    ``packed_gate_up``: the routed experts as transformers' packed pair (``release_layout``).
    ``target_layers``: random target decoder layers too (``synthetic_tensors``), as a
    ``glm4_moe`` release lays them out, for ``mtpkern.target.ReferenceTarget``; BF16 / FP32
    GQA configs of the ``glm4_moe`` family only (``ValueError`` naming what else was asked).
    """
    from safetensors.numpy import save_file

    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype: expected 'bfloat16' or 'float32', got {dtype!r}")
    if shards < 1:
        raise ValueError(f"shards: expected >= 1, got {shards}")
    if target_layers:
        check_target_config(cfg, "target_layers")
        if packed_gate_up:
            raise ValueError("target_layers: expected per-expert tensors (a glm4_moe release's), "
                             "got packed_gate_up=True")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = synthetic_tensors(cfg, seed, own_embed, own_head, target_layers)
    np_dtype = BF16 if dtype == "bfloat16" else np.float32
    tensors = {k: v.astype(np_dtype).astype(np.float32) for k, v in tensors.items()}    # the dense values
    tensors = rope_release_order(cfg, tensors)
    if cfg.weight_quant == "fp8":
        tensors = quantize_projections(cfg, tensors, pow2_scales)
    tensors = release_layout(cfg, tensors, rope_ordered=True, packed_gate_up=packed_gate_up)
    tensors = {k: np.ascontiguousarray(v if v.dtype.itemsize == 1 or k.endswith(("_scale", "_scale_inv", ".scale"))
                                       or ".hc_" in k else v.astype(np_dtype))          # hyper-connections: FP32
               for k, v in tensors.items()}
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    meta = {"format": "pt"}
    if shards == 1:
        save_file(tensors, os.fspath(out / _SINGLE), metadata=meta)
        return out
    keys = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = keys[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in part}, os.fspath(out / fname), metadata=meta)
        weight_map.update({k: fname for k in part})
    total = sum(v.nbytes for v in tensors.values())
    (out / _INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return out
