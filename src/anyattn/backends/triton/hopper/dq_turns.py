"""The dQ add turns of the Hopper backward with dQ inside: the key tiles whose programs
visit a query tile add their fp32 dQ partials into its accumulator in a FIXED order
(no float atomics: bitwise repeatable), through a counter per (b, h, query tile).

Shape legend: Sq / Sk queries / keys, BM / BN the query / key tile, nq = cdiv(Sq, BM),
nkv = cdiv(Sk, BN).

The adder of rank r waits until the counter reads r (spin_acquire: ld.acquire, traps
after about a second of polls: a launch error instead of a hang), issues a bulk tensor
copy (rank 0) or a bulk tensor reduce-add (rank > 0) of its staged partial
(add_partial), waits until that is complete (bulk_wait_all) and releases the counter
(+1, red.release: release).  The order (dq_rank, ORDER):

    ORDER 1, no band: key tile j visits its query tiles rotated, starting at
      o_j = j * nq // nkv (visit_offset); at tile t the adders come in the order of their
      step (t - o_j) mod nq.  In steady state the previous adder of a tile got there
      nq / nkv steps earlier: no waiting.
    ORDER 1, a band: natural order; the adders of tile t come nearest the diagonal first
      (descending j: their steps t - s0_j ascend).
    ORDER 0: ascending j (a program waits only for programs launched before it).

With ORDER 1 a program may wait for a program of its (b, kv head) launched after it:
deadlock-free when all nkv programs of one (b, kv head) are co-resident (the launcher
takes ORDER 0 otherwise: launch.dq_order).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma

from .tile_ranges import cdiv_pos, div_pos

__all__ = ["RELEASE_WARP", "spin_acquire", "bulk_wait_all", "release", "add_partial",
           "visit_offset", "dq_rank"]

SPIN_LIMIT = 1 << 22              # polls (~1 s) before a wait for a dQ turn traps
_SPIN_ASM = gl.constexpr(
    "{\n.reg .pred %p;\n.reg .u32 %n;\nmov.u32 %n, 0;\nSPIN${:uid}:\n"
    "ld.acquire.gpu.global.b32 $0, [$1];\nsetp.ne.s32 %p, $0, $2;\n"
    "@!%p bra DONE${:uid};\nadd.u32 %n, %n, 1;\n"
    f"setp.lt.u32 %p, %n, {SPIN_LIMIT};\n"
    "@%p bra SPIN${:uid};\ntrap;\nDONE${:uid}:\nfence.proxy.async.global;\n}")


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """cp.reduce.async.bulk.tensor .add of shared ``src`` into the block of
    ``tensor_desc`` at ``coord`` (one thread issues it; a bulk group like a TMA store:
    tma.store_wait waits for its reads, bulk_wait_all for its writes)."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                              tensor_desc.handle, coord, src.handle)


@gluon.jit
def spin_acquire(ptrs, target):
    """Per thread: spin until *ptr == target (ld.acquire.gpu; traps after SPIN_LIMIT
    polls), then fence.proxy.async (the bulk copies that follow see what was acquired)
    -> the value read."""
    return gl.inline_asm_elementwise(_SPIN_ASM, "=r,l,r", [ptrs, target], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def bulk_wait_all(ptrs):
    """Per thread: wait until this thread's bulk copies are complete (writes included:
    cp.async.bulk.wait_group 0), then fence.proxy.async.global (what they wrote is seen by
    later acquires / copies).  One thread then adds 1 to *ptr with release semantics
    (after a CTA / warp barrier: _release)."""
    return gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\nfence.proxy.async.global;\nmov.u32 $0, 0;",
        "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1)


def _release_asm(who: str) -> str:
    """PTX: the thread whose ``who`` reads 0 adds 1 to *$1 (red.release.gpu); $0 = 0."""
    return ("{\n.reg .pred %p;\n.reg .u32 %t;\n"
            f"mov.u32 %t, {who};\nsetp.eq.u32 %p, %t, 0;\n"
            "@%p red.release.gpu.global.add.s32 [$1], 1;\nmov.u32 $0, 0;\n}")


RELEASE_WARP = gl.constexpr(_release_asm("%laneid"))   # lane 0 of each warp


@gluon.jit
def release(ptrs, WHO: gl.constexpr):
    """*ptr += 1 (red.release.gpu) by lane 0 of each warp (WHO = RELEASE_WARP: the
    one-warp dQ writer); the others nothing."""
    return gl.inline_asm_elementwise(WHO, "=r,l", [ptrs], dtype=gl.int32, is_pure=False,
                                     pack=1)


@gluon.jit
def add_partial(dqa_desc, src, row, t, rank, BM: gl.constexpr, col: gl.constexpr = 0):
    """The bulk add of one staged partial into accumulator rows [row, t * BM ...] from
    column ``col`` on: a bulk tensor store for the first adder (rank 0), else a bulk
    tensor reduce-add.  dqa_desc is launch.dqa_desc's interleaved 5-D view (rows in
    groups of 8)."""
    if rank == 0:
        tma.async_copy_shared_to_global(dqa_desc, [row, t * (BM // 8), 0, 0, col], src)
    else:
        _tma_reduce_add(dqa_desc, [row, t * (BM // 8), 0, 0, col], src)


@gluon.jit
def visit_offset(jt, nq, nkv, HAS_BAND: gl.constexpr, ORDER):
    """Where key tile jt's program starts its loop over its query tiles (an index into
    its range): ORDER 1 without a band rotates by jt * nq // nkv, else 0."""
    if HAS_BAND:
        off = 0
    else:
        off = gl.where(ORDER == 1, (jt * nq) // nkv, 0)
    return off


@gluon.jit
def dq_rank(jt, t, Sk, nq, lo, hi, HAS_BAND: gl.constexpr, ORDER, BM: gl.constexpr,
            BN: gl.constexpr):
    """(rank, last): key tile jt's place in the order in which the key tiles whose
    programs visit query tile t (query_tile_range's rule: a contiguous run [jlo, jhi])
    add their dQ partials (module doc), and whether it is the last."""
    nkv = (Sk + BN - 1) // BN
    if HAS_BAND:
        jlo = div_pos(t * BM + lo, BN)                  # first j with j1 - lo > t * BM
        jhi = cdiv_pos((t + 1) * BM + hi, BN) - 1       # last j with j0 - hi < (t+1) * BM
        jhi = gl.minimum(jhi, nkv - 1)
        rank = gl.where(ORDER == 1, jhi - jt, jt - jlo)  # steps t - s0_j ascend as j falls
        last = gl.where(ORDER == 1, jt == jlo, jt == jhi)
    else:
        # rotated: j <= J(t) got there at step t - o_j, the others at t - o_j + nq
        big_j = gl.minimum(((t + 1) * nkv - 1) // nq, nkv - 1)
        rot = gl.where(jt <= big_j, big_j - jt, big_j + nkv - jt)
        rank = gl.where(ORDER == 1, rot, jt)
        last = rank == nkv - 1
    return rank, last
