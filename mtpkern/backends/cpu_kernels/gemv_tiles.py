"""The GEMV core's dot products as explicit vector tiles (Numba intrinsics).

``dots<T>(w, rows, k0, x, i)`` (T = 8, 4, 3, 2, 1) returns the 8 x T dots
``w[rows[s], k0 : k0 + K] . x[i + t, :]`` (K = x's columns) as a tuple ``[s * T + t]``, for
weights as BF16 bits (``uint16``), FP32 or FP8 E4M3 codes (``uint8``, decoded as
``linear.widen``: the value times 2^-120). The 8 weight rows go through P = 8 / R tiles of R
rows (R = 2 for T = 8, 4 for T = 4 and 3, 8 for T = 2 and 1, so a tile holds 8-24
accumulator vectors). A tile reads its weight rows and the T input rows VL = 16 columns a
step (``simd.VL``: one AVX-512 register, two AVX ones): each weight vector is widened once
for the T input rows and each input vector loaded once for the R weight rows, so a step is
R x T vector FMAs (``llvm.fma``, one rounding each) against R + T loads. Each dot keeps its
own vector of 16 partial sums, summed at the end by halving (lanes l and l + 8, then l and
l + 4, ...), then the K % 16 last columns are added in order, one FMA each.

So a dot's bits depend on its two rows and K only: not on the tile, on which rows share it,
on the input row count of the call or on the thread count. The GEMV core
(``linear.gemv_task``) picks the tiles by how many input rows are left, and a row gets the
same result alone, in a group of 8 weight rows, in a vocabulary shard, under a grammar mask
or beside any other input rows (tests/test_cpu_gemv_tiles.py, tests/test_ops_backends.py).

Where K is over ``PASS_MAX`` columns the tiles take it ``PASS_COLS`` columns at a time, all P
tiles over one range before the next, keeping their partial sums in a stack buffer between
ranges: those columns of the T input rows then stay in L1 for the 8 weight rows, where a
whole row of 2048+ columns of 8 input rows overflows it (the partial sums are the same
vectors either way, so the bits do not change). Each step also asks for the line
``PREFETCH_BYTES`` ahead in each of its weight rows (``simd.emit_prefetch``, into L2): a row
of 1024 BF16 columns ends every 2 KiB, and the hardware prefetcher does not cross the 4 KiB
page where the next row of the group's stream continues. A prefetch is a hint: no result
depends on it, and an address past the array is never read.

Measured on the 2-core Xeon VM of benchmarks/README.md (Numba 0.68.1, 2 threads, old and new
kernels called alternately in one process), against the scalar loops left to LLVM's vectoriser
that these tiles replaced: a [1536, 1024] BF16 ``linear`` at n = 3 / 4 took 0.65-0.75x / 0.8-0.87x
their time (n = 3 is now one pass of 4 x 3 tiles instead of 8 x 2 then 8 x 1), n = 8-24 the same
within this VM's noise (both at ~50 G FMAs/s a core from L2); the [32768, 1024] LM head
streaming from DRAM (the caches flushed before each call) 0.8x at n = 1, 0.7x at n = 3 and
0.75-0.95x at n = 8.
At K = 2048 / 4096 and n = 16-24 the tiles over whole rows ran at 1.2-1.35x the loops' time,
in ranges of 512 columns at 0.9-1.0x. Asking for the next group's rows as well (every step
of a tile asking for the same columns of other rows) made n = 1 1.3x slower.

The callers check the shapes (``w`` [*, >= k0 + K], ``x`` [>= i + T, K], the rows in range);
``w`` and ``x`` must be C-contiguous (x FP32): an argument typed otherwise fails to compile.
A change here reaches Numba's cached callers once their own file changes, or the cache is
cleared (docs/cpu.md, "Compilation and cache").
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import _VEC, _ZERO, VL, _c_f32, _const, _fma, _vptr, emit_prefetch

#: K is taken in ranges of PASS_COLS columns where it is over PASS_MAX: 8 input rows of 1024
#: FP32 columns (32 KiB) and the 8 BF16 weight rows beside them (16 KiB) already fill a 48 KiB L1
PASS_MAX = 1024
PASS_COLS = 512

_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_IVEC = ir.VectorType(_I32, VL)

#: bytes ahead of the current step at which each weight row's line is asked for
PREFETCH_BYTES = 512


def emit_widen(builder, dtype, v):
    """Weight bits v of Numba dtype ``dtype`` (a value, or a vector of them) -> FP32 of the same
    lanes, by ``linear.widen``'s rule: BF16 bits shifted into the top half of an FP32 word, FP32
    as it is, an FP8 E4M3 code as ``(sext(b) << 20) & 0x87FFFFFF`` (its value times 2^-120)."""
    if dtype == types.float32:
        return v
    lanes = v.type.count if isinstance(v.type, ir.VectorType) else None
    i32 = _I32 if lanes is None else ir.VectorType(_I32, lanes)
    f32 = _F32 if lanes is None else ir.VectorType(_F32, lanes)

    def c(x):
        return ir.Constant(i32, x if lanes is None else [x] * lanes)

    if dtype == types.uint16:
        return builder.bitcast(builder.shl(builder.zext(v, i32), c(16)), f32)
    return builder.bitcast(builder.and_(builder.shl(builder.sext(v, i32), c(20)), c(0x87FFFFFF)), f32)


def _widen(builder, dtype, ptr):
    """VL weight elements at ptr -> <VL x float>."""
    elem, size = {types.float32: (_F32, 4), types.uint16: (ir.IntType(16), 2), types.uint8: (ir.IntType(8), 1)}[dtype]
    v = builder.load(builder.bitcast(ptr, ir.VectorType(elem, VL).as_pointer()), align=size)
    return emit_widen(builder, dtype, v)


def _lane_sum(builder, v):
    """The lanes of v summed by halving: (l, l + 8), then (l, l + 4), (l, l + 2), (0, 1)."""
    n = VL
    while n > 1:
        h = n // 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, h), list(range(h, n))))
        v = builder.fadd(lo, hi)
        n = h
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _fma1(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
    return builder.call(fn, [a, b, c])


def _weights(w) -> bool:
    return (isinstance(w, types.Array) and w.ndim == 2 and w.layout == "C"
            and w.dtype in (types.uint16, types.uint8, types.float32))


def _rows(t, n) -> bool:
    return isinstance(t, types.UniTuple) and len(t) == n and isinstance(t.dtype, types.Integer)


def _make_dots(R: int, T: int):
    """``dots(w, rows, k0, x, i)``: the 8 weight rows ``rows`` against input rows
    i .. i + T - 1, as P = 8 / R tiles of R weight rows (see the module's docstring)."""
    P = 8 // R

    @intrinsic
    def dots(typingctx, w, rows, k0, x, i):
        if not (_weights(w) and _rows(rows, 8) and _c_f32(x) and x.ndim == 2):
            return None
        sig = types.UniTuple(types.float32, 8 * T)(w, rows, k0, x, i)

        def codegen(context, builder, sig, args):
            wty = sig.args[0].dtype
            wa, xa = (context.make_array(sig.args[j])(context, builder, args[j]) for j in (0, 3))
            k0v, iv = (context.cast(builder, args[j], sig.args[j], types.intp) for j in (2, 4))
            Kw = cgutils.unpack_tuple(builder, wa.shape, 2)[1]
            K = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
            vl = _const(context, VL)
            K16 = builder.mul(builder.udiv(K, vl), vl)            # columns of the vector steps
            # the columns of the vector steps in ranges of `width`: one range (empty when K < 16)
            # up to PASS_MAX columns, ranges of PASS_COLS beyond
            width = builder.select(builder.icmp_signed(">", K16, _const(context, PASS_MAX)), _const(context, PASS_COLS),
                                   builder.select(builder.icmp_signed(">", K16, vl), K16, vl))
            ranges = builder.udiv(builder.add(K16, builder.sub(width, _const(context, 1))), width)

            wrow = [builder.add(builder.mul(context.cast(builder, v, sig.args[1].dtype, types.intp), Kw), k0v)
                    for v in cgutils.unpack_tuple(builder, args[1], 8)]
            xrow = [builder.mul(builder.add(iv, _const(context, t)), K) for t in range(T)]
            ahead = _const(context, PREFETCH_BYTES // context.get_abi_sizeof(context.get_value_type(wty)))
            # each (weight row, input row)'s vector of sums, kept from one column range to the next
            sums = cgutils.alloca_once(builder, _VEC, size=8 * T)
            for j in range(8 * T):
                builder.store(_ZERO, builder.gep(sums, [ir.Constant(_I32, j)]))
            with cgutils.for_range(builder, ranges) as rng:
                kb = builder.mul(rng.index, width)
                steps = builder.udiv(builder.sub(builder.select(builder.icmp_signed("<", builder.add(kb, width), K16),
                                                                builder.add(kb, width), K16), kb), vl)
                for p in range(P):                                # tile p: weight rows p R .. p R + R - 1
                    mine = wrow[p * R:(p + 1) * R]
                    slot = [[builder.gep(sums, [ir.Constant(_I32, (p * R + r) * T + t)]) for t in range(T)]
                            for r in range(R)]
                    accs = [[cgutils.alloca_once(builder, _VEC) for _ in range(T)] for _ in range(R)]
                    for r in range(R):
                        for t in range(T):
                            builder.store(builder.load(slot[r][t]), accs[r][t])
                    with cgutils.for_range(builder, steps) as loop:
                        k = builder.add(kb, builder.mul(loop.index, vl))
                        ws = []
                        for r in range(R):
                            at = builder.add(mine[r], k)
                            emit_prefetch(builder, wa.data, builder.add(at, ahead))
                            ws.append(_widen(builder, wty, builder.gep(wa.data, [at])))
                        for t in range(T):
                            xv = builder.load(_vptr(builder, xa.data, builder.add(xrow[t], k)), align=4)
                            for r in range(R):
                                builder.store(_fma(builder, ws[r], xv, builder.load(accs[r][t])), accs[r][t])
                    for r in range(R):
                        for t in range(T):
                            builder.store(builder.load(accs[r][t]), slot[r][t])
            out = [cgutils.alloca_once_value(builder, _lane_sum(builder, builder.load(
                builder.gep(sums, [ir.Constant(_I32, j)])))) for j in range(8 * T)]
            with cgutils.for_range(builder, builder.sub(K, K16)) as loop:    # the last K % VL columns
                k = builder.add(K16, loop.index)
                xs = [builder.load(builder.gep(xa.data, [builder.add(xrow[t], k)])) for t in range(T)]
                for s_ in range(8):
                    u = emit_widen(builder, wty, builder.load(builder.gep(wa.data, [builder.add(wrow[s_], k)])))
                    for t in range(T):
                        builder.store(_fma1(builder, u, xs[t], builder.load(out[s_ * T + t])), out[s_ * T + t])
            return context.make_tuple(builder, sig.return_type, [builder.load(o) for o in out])

        return sig, codegen

    return dots


#: the GEMV core's passes over a group of 8 weight rows: 8 input rows (4 tiles of 2 weight
#: rows: 16 accumulator vectors), 4 and 3 (2 tiles of 4 weight rows), 2 and 1 (one tile of 8)
dots8, dots4, dots3 = _make_dots(2, 8), _make_dots(4, 4), _make_dots(4, 3)
dots2, dots1 = _make_dots(8, 2), _make_dots(8, 1)
