"""Explicit 16-lane FP32 vector tiles for the CPU attention, as Numba intrinsics.

Numba compiles loops to whatever LLVM's vectoriser makes of them. For a decode
attention's scores that is a dot product along the head dim per (KV row, query),
each ending in a horizontal reduction, at ~4x the vector-FMA bound
(benchmarks/README.md). With the keys of a block stored with their rows innermost
(the cpu backend's key cache, ``[NB, Hkv, D, BS]``: ``CpuBackend.empty_keys``),
16 KV rows are one vector and a score tile needs no reduction at all; these
intrinsics emit that code directly, as LLVM vector IR (``<16 x float>``, the FMAs
through ``llvm.fma``: one rounding each, in a fixed order, so the results do not
depend on the thread count or the schedule). LLVM lowers the vectors to the
machine's registers (one AVX-512 register, two AVX ones, ...). ``exp_le0``, a polynomial
``exp`` that a loop over it vectorises, serves the attention's softmax and the LM head's
confidence sums.

- ``qk8`` / ``qk4`` / ``qk1`` (``T`` = 8 / 4 / 1 query vectors): ``sc[i + t, c + j0 : c + j0 + 16] =
  sum_d q[i + t, d] * kt[d, j0 : j0 + 16]`` (``c``: where the block's scores begin in ``sc``'s rows,
  which may hold several blocks' side by side): one key vector load per d for the T queries
  (their values broadcast from memory), T x S accumulators in registers (``_QK_SETS``: S
  sets over alternating steps of d, so 8 chains of FMAs are in flight), summed in a fixed
  order at the end.
- ``pv8`` / ``pv4`` / ``pv1``: ``acc[i + t, c : c + 16] += sum_{lo <= j < hi} p[i + t, pc + j] *
  vb[j, kvh, c : c + 16]`` for each 16-column chunk c of ``acc`` (``Dv % 16 == 0``; ``pc``: where
  the block's weights begin in ``p``'s rows),
  j in order: one value vector load per (j, chunk) for the T queries, the accumulators
  of ``_PV_CHUNKS`` chunks at a time held in registers over the rows.
- both take ``pf, pfo``: with each vector they load from their tile at offset ``o`` they ask
  for the line of ``pf``'s flat element ``pfo + o`` (the same line of the next block, which
  the caller names; a hint: ``pfo`` must keep every such element inside ``pf``, and no
  result depends on it).

The callers check the shapes (``kt`` [D, BS >= j0 + 16], ``q`` [>= i + T, D], ``sc``
[>= i + T, >= c + j0 + 16], ``vb`` [>= hi, Hkv, >= Dv], ``p`` [>= i + T, >= pc + hi], ``acc``
[>= i + T, Dv]); every array is C-contiguous FP32 (an argument typed otherwise makes the
call fail to compile, not run wrong).

Numba's on-disk cache keys a compiled function on its own file only: a change here reaches
cached callers (cpu_kernels/attention.py) once their file changes too, or the cache is cleared.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

#: lanes of a tile: 16 KV rows of a score tile, 16 value columns of a PV chunk
VL = 16
_F32 = ir.FloatType()
_VEC = ir.VectorType(_F32, VL)
_ZERO = ir.Constant(_VEC, [0.0] * VL)
_I32 = ir.IntType(32)
_SPLAT = ir.Constant(ir.VectorType(_I32, VL), [0] * VL)
#: score accumulator sets of a qk tile by query count: step d of the head dim goes to set
#: d % 4 % S (the tail's to set 0), summed (a0 + a1) + (a2 + a3) at the end, so that 8
#: chains of FMAs are in flight where T < 8 would leave the FMA units waiting on latency
_QK_SETS = {8: 1, 4: 2, 1: 4}
#: 16-column chunks of a pv pass by query count: 16 accumulators in registers (T x C)
#: across the rows; each chunk keeps its own sums, so the results are those of one chunk a pass
_PV_CHUNKS = {8: 2, 4: 4, 1: 4}


def _splat(builder, x):
    """<16 x float> of the scalar x."""
    v = builder.insert_element(ir.Constant(_VEC, ir.Undefined), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(v, ir.Constant(_VEC, ir.Undefined), _SPLAT)


def _fma(builder, a, b, c):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VEC, [_VEC] * 3), f"llvm.fma.v{VL}f32")
    return builder.call(fn, [a, b, c])


def emit_prefetch(builder, base, idx, locality: int = 2):
    """Ask for the cache line of base[idx] (``llvm.prefetch``, a read; ``locality`` 3 keeps it in
    every level, 2, the tiles' choice, in L2 and below: L1 keeps the lines in use)."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                        "llvm.prefetch.p0i8")
    builder.call(fn, [builder.bitcast(builder.gep(base, [idx]), i8p), ir.Constant(_I32, 0),
                      ir.Constant(_I32, locality), ir.Constant(_I32, 1)])


def _vptr(builder, base, idx):
    return builder.bitcast(builder.gep(base, [idx]), _VEC.as_pointer())


def _arrays(context, builder, sig, args, which):
    return [context.make_array(sig.args[k])(context, builder, args[k]) for k in which]


def _ints(context, builder, sig, args, which):
    return [context.cast(builder, args[k], sig.args[k], types.intp) for k in which]


def _const(context, v):
    return ir.Constant(context.get_value_type(types.intp), v)


def _c_f32(*arrays) -> bool:
    """Whether every argument is typed as a C-contiguous FP32 array (the only layout the
    code below indexes correctly): anything else fails to type where it is called."""
    return all(isinstance(a, types.Array) and a.layout == "C" and a.dtype == types.float32 for a in arrays)


def _make_qk(T: int):
    S = _QK_SETS[T]

    @intrinsic
    def qk(typingctx, kt, q, sc, i, j0, c, pf, pfo):
        if not (_c_f32(kt, q, sc, pf) and kt.ndim == q.ndim == sc.ndim == 2):
            return None
        sig = types.void(kt, q, sc, i, j0, c, pf, pfo)

        def codegen(context, builder, sig, args):
            kta, qa, sca, pfa = _arrays(context, builder, sig, args, (0, 1, 2, 6))
            iv, j0v, cv, pfov = _ints(context, builder, sig, args, (3, 4, 5, 7))
            D, BS = cgutils.unpack_tuple(builder, kta.shape, 2)
            Dq = cgutils.unpack_tuple(builder, qa.shape, 2)[1]
            BSs = cgutils.unpack_tuple(builder, sca.shape, 2)[1]
            rows = [builder.add(iv, _const(context, t)) for t in range(T)]
            qrow = [builder.mul(r, Dq) for r in rows]
            accs = [[cgutils.alloca_once_value(builder, _ZERO) for _ in range(T)] for _ in range(S)]

            def step(d, acc):
                off = builder.add(builder.mul(d, BS), j0v)
                emit_prefetch(builder, pfa.data, builder.add(pfov, off))
                kv = builder.load(_vptr(builder, kta.data, off), align=4)
                for t in range(T):
                    qd = builder.load(builder.gep(qa.data, [builder.add(qrow[t], d)]))
                    builder.store(_fma(builder, kv, _splat(builder, qd), builder.load(acc[t])), acc[t])

            quads = builder.udiv(D, _const(context, 4))
            with cgutils.for_range(builder, quads) as loop:     # 4 steps of d a trip, in order
                d = builder.mul(loop.index, _const(context, 4))
                for u in range(4):
                    step(builder.add(d, _const(context, u)), accs[u % S])
            done = builder.mul(quads, _const(context, 4))
            with cgutils.for_range(builder, builder.sub(D, done)) as loop:
                step(builder.add(done, loop.index), accs[0])
            for t in range(T):
                sums = [builder.load(accs[s_][t]) for s_ in range(S)]
                while len(sums) > 1:                            # (a0 + a1) + (a2 + a3)
                    sums = [builder.fadd(sums[k], sums[k + 1]) for k in range(0, len(sums), 2)]
                at = builder.add(builder.mul(rows[t], BSs), builder.add(cv, j0v))
                builder.store(sums[0], _vptr(builder, sca.data, at), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return qk


def _make_pv(T: int):
    C = _PV_CHUNKS[T]

    @intrinsic
    def pv(typingctx, vb, kvh, p, acc, i, lo, hi, pc, pf, pfo):
        if not (_c_f32(vb, p, acc, pf) and vb.ndim == 3 and p.ndim == acc.ndim == 2):
            return None
        sig = types.void(vb, kvh, p, acc, i, lo, hi, pc, pf, pfo)

        def codegen(context, builder, sig, args):
            va, pa, aa, pfa = _arrays(context, builder, sig, args, (0, 2, 3, 8))
            kvhv, iv, lov, hiv, pcv, pfov = _ints(context, builder, sig, args, (1, 4, 5, 6, 7, 9))
            _, Hkv, Dvf = cgutils.unpack_tuple(builder, va.shape, 3)
            BSp = cgutils.unpack_tuple(builder, pa.shape, 2)[1]
            Dv = cgutils.unpack_tuple(builder, aa.shape, 2)[1]
            rows = [builder.add(iv, _const(context, t)) for t in range(T)]
            prow = [builder.add(builder.mul(r, BSp), pcv) for r in rows]
            arow = [builder.mul(r, Dv) for r in rows]
            accs = [[cgutils.alloca_once_value(builder, _ZERO) for _ in range(T)] for _ in range(C)]

            def chunks(cs):
                """The rows lo .. hi - 1 into the accumulators of the chunks starting at
                columns cs (each chunk its own sums: grouping them changes no result)."""
                for c, acc in zip(cs, accs):
                    for t in range(T):
                        builder.store(builder.load(_vptr(builder, aa.data, builder.add(arow[t], c)), align=4), acc[t])
                with cgutils.for_range(builder, builder.sub(hiv, lov)) as loop:
                    j = builder.add(lov, loop.index)
                    row = builder.mul(builder.add(builder.mul(j, Hkv), kvhv), Dvf)
                    pj = [_splat(builder, builder.load(builder.gep(pa.data, [builder.add(prow[t], j)])))
                          for t in range(T)]
                    for c, acc in zip(cs, accs):
                        emit_prefetch(builder, pfa.data, builder.add(pfov, builder.add(row, c)))
                        v = builder.load(_vptr(builder, va.data, builder.add(row, c)), align=4)
                        for t in range(T):
                            builder.store(_fma(builder, pj[t], v, builder.load(acc[t])), acc[t])
                for c, acc in zip(cs, accs):
                    for t in range(T):
                        builder.store(builder.load(acc[t]), _vptr(builder, aa.data, builder.add(arow[t], c)), align=4)

            n = builder.udiv(Dv, _const(context, VL))
            groups = builder.udiv(n, _const(context, C))
            with cgutils.for_range(builder, groups) as g:       # C chunks a pass over the rows
                c0 = builder.mul(g.index, _const(context, C * VL))
                chunks([builder.add(c0, _const(context, k * VL)) for k in range(C)])
            done = builder.mul(groups, _const(context, C))
            with cgutils.for_range(builder, builder.sub(n, done)) as g:
                chunks([builder.mul(builder.add(done, g.index), _const(context, VL))])
            return context.get_dummy_value()

        return sig, codegen

    return pv


qk8, qk4, qk1 = _make_qk(8), _make_qk(4), _make_qk(1)
pv8, pv4, pv1 = _make_pv(8), _make_pv(4), _make_pv(1)


@intrinsic
def bits_to_f32(typingctx, v):
    """The FP32 whose bits are the low 32 bits of the integer ``v``."""
    if isinstance(v, types.Integer):
        def codegen(context, builder, sig, args):
            return builder.bitcast(builder.trunc(args[0], ir.IntType(32)) if v.bitwidth > 32 else args[0],
                                   ir.FloatType())

        return types.float32(v), codegen
    return None


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)                  # 8 significant bits: kf * _LN2_HI is exact
_LN2_LO = np.float32(-2.12194440e-4)               # ln 2 - _LN2_HI
EXP_MIN = np.float32(-87.0)                       # exp(-87) = 1.6e-38, just above FP32's normals


@njit(cache=True, fastmath={"contract"})
def exp_le0(x):
    """exp(x) for x <= 0, in FP32, within ~2 ulp; NaN stays NaN; x below -87 gives
    exp(-87) (1.6e-38: below every tolerance, and never a denormal, whose arithmetic
    is 60x slower on this Xeon). Cody-Waite: x = k ln 2 + r, |r| <= ln 2 / 2, then
    2^k times a degree-6 Taylor polynomial of exp(r) (truncation 1.2e-7 relative).
    Straight-line code, so a loop over it vectorises (np.exp is a libm call per value)."""
    x = EXP_MIN if x < EXP_MIN else x            # NaN passes (the comparison is false)
    kf = np.floor(x * _LOG2E + np.float32(0.5))
    kf = kf if kf >= np.float32(-126.0) else np.float32(-126.0)   # NaN: any k (r is NaN)
    r = (x - kf * _LN2_HI) - kf * _LN2_LO
    p = np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    return p * bits_to_f32((np.int32(kf) + np.int32(127)) << 23)
