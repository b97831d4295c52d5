"""The uniform block every anyattn WGSL kernel reads (group 0, binding 0).

One flat struct of 4-byte scalars; the WGSL text of the struct is generated
from ``FIELDS`` so the shader and the packer cannot disagree.  Offsets and
strides count elements of the bound buffer (u32); a broadcast dim has stride 0.
"""
from __future__ import annotations

import struct
from typing import Dict

__all__ = ["FIELDS", "FLAGS", "wgsl_struct", "pack", "NBYTES", "SEED_OFFSET", "seed_bytes"]

# (name, wgsl type) in order; every entry is 4 bytes.
FIELDS = [
    ("B", "u32"), ("HQ", "u32"), ("HKV", "u32"), ("G", "u32"),
    ("SQ", "u32"), ("SK", "u32"), ("D", "u32"), ("flags", "u32"),
    ("scale", "f32"), ("band_lo", "i32"), ("band_hi", "i32"), ("inv_sk", "f32"),
    ("neg_inf", "f32"), ("t0", "u32"), ("t1", "u32"), ("bh0", "u32"),
    ("q_off", "u32"), ("q_sb", "u32"), ("q_sh", "u32"), ("q_ss", "u32"),
    ("k_off", "u32"), ("k_sb", "u32"), ("k_sh", "u32"), ("k_ss", "u32"),
    ("v_off", "u32"), ("v_sb", "u32"), ("v_sh", "u32"), ("v_ss", "u32"),
    ("g_off", "u32"), ("g_sb", "u32"), ("g_sh", "u32"), ("g_ss", "u32"),
    ("o_off", "u32"), ("o_sb", "u32"), ("o_sh", "u32"), ("o_ss", "u32"),
    ("bi_off", "u32"), ("bi_sb", "u32"), ("bi_sh", "u32"), ("bi_si", "u32"),
    ("bi_sj", "u32"), ("kp_off", "u32"), ("kp_sb", "u32"), ("kp_sh", "u32"),
    ("kp_si", "u32"), ("kp_sj", "u32"), ("qid_off", "u32"), ("qid_sb", "u32"),
    ("kid_off", "u32"), ("kid_sb", "u32"), ("tm_off", "u32"), ("tm_sb", "u32"),
    ("tm_sh", "u32"), ("nqt", "u32"), ("nkt", "u32"), ("stat_n", "u32"),
    ("out2_off", "u32"), ("n_out", "u32"), ("red_b", "u32"), ("red_h", "u32"),
    ("red_i", "u32"), ("red_j", "u32"), ("db_sb", "u32"), ("db_sh", "u32"),
    ("db_si", "u32"), ("db_sj", "u32"), ("db_nb", "u32"), ("db_nh", "u32"),
    ("db_ni", "u32"), ("db_nj", "u32"), ("ml_rd", "u32"), ("ml_wr", "u32"),
    # score modifiers (anyattn.modifiers; read only by kernels compiled with the
    # SOFTCAP / ALIBI / SINKS defines): the cap c, ALiBi's diagonal (signed: i' - j' =
    # i - j + alibi_diag), the slopes [Ba, HQ] and sinks [HQ] as f32 bits in aux
    ("softcap", "f32"), ("alibi_diag", "i32"), ("al_off", "u32"), ("al_sb", "u32"),
    ("snk_off", "u32"),
    # dropout (anyattn.dropout; read only by kernels compiled with DROPOUT): the
    # Philox key (seed mod 2**32, seed >> 32), the keep threshold t (keep iff
    # mix32(row ^ col) >= t), 1 / (1 - p) in f32, and the global position of local
    # query 0, key 0 and batch 0 (q_offset, k_offset, the first batch of a chunk);
    # drop_b0 is also the batch offset the generated score / mask functions add to b
    ("drop_k0", "u32"), ("drop_k1", "u32"), ("drop_t", "u32"), ("drop_rs", "f32"),
    ("drop_qo", "u32"), ("drop_ko", "u32"), ("drop_b0", "u32"),
    # the 5-product backward's dS scratch (DSQ_OUT / DSQ_IN), chunked over (batch, KV
    # head) rows: the first query-head row b*HQ + h the scratch holds (row 0 of it)
    ("ds_bh0", "u32"),
    # v's head dim where it differs from D (kernels compiled with VDIM); 0 otherwise
    ("DV", "u32"),
    # a paged key/value cache (kernels compiled with PAGED; anyattn.paged): the aux
    # index of the per-sequence records (key count, band, block-table row) and the
    # page size P
    ("pg_off", "u32"), ("pg_p", "u32"),
]
#: fields that only the kernels compiled with a define read, and the define: the struct
#: of every other kernel names them ``_pad<index>`` (padding), so its text does not
#: depend on them
DEFINE_FIELDS = {"DV": "VDIM", "pg_off": "PAGED", "pg_p": "PAGED"}
while len(FIELDS) % 4:
    FIELDS.append((f"_pad{len(FIELDS)}", "u32"))
NBYTES = 4 * len(FIELDS)
#: byte offset of the dropout seed (drop_k0, drop_k1: 8 consecutive bytes) in the block
SEED_OFFSET = 4 * [n for n, _ in FIELDS].index("drop_k0")
assert FIELDS[SEED_OFFSET // 4 + 1][0] == "drop_k1"

#: bits of ``flags``
FLAGS = dict(HAS_LO=1, HAS_HI=2, HAS_DOCS=4, HAS_KEEP=8, HAS_BIAS=16, QUIRK=32,
             FIRST=64, LAST=128, TILEMAP=256, WRITE_DS=512, WANT_DK=1024, WANT_DV=2048,
             SEED_FLOOR=4096)

_FMT = {"u32": "I", "i32": "i", "f32": "f"}


def wgsl_struct(defines=()) -> str:
    """The WGSL struct ``Uni``; a field of ``DEFINE_FIELDS`` is named only where its
    define is among ``defines``."""
    names = [n if n not in DEFINE_FIELDS or DEFINE_FIELDS[n] in defines else f"_pad{i}"
             for i, (n, _) in enumerate(FIELDS)]
    body = ",\n".join(f"  {n}: {t}" for n, (_, t) in zip(names, FIELDS))
    consts = "\n".join(f"const F_{k}: u32 = {v}u;" for k, v in FLAGS.items())
    return f"struct Uni {{\n{body},\n}};\n{consts}\n"


def pack(values: Dict[str, object]) -> bytes:
    """Values by field name (missing -> 0) -> the little-endian uniform bytes."""
    unknown = set(values) - {n for n, _ in FIELDS}
    if unknown:
        raise KeyError(f"unknown uniform fields {sorted(unknown)}")
    out = []
    for n, t in FIELDS:
        v = values.get(n, 0)
        if t == "u32":
            v = int(v)
            if not 0 <= v < 1 << 32:
                raise OverflowError(f"uniform field {n}={v} does not fit a u32 (an index past "
                                    "2**32 elements); split the problem")
        elif t == "i32":
            v = int(v)
            if not -(1 << 31) <= v < 1 << 31:
                raise OverflowError(f"uniform field {n}={v} does not fit an i32")
        else:
            v = float(v)
            try:
                struct.pack("<f", v)
            except OverflowError:
                raise ValueError(f"{n}: {v!r} overflows float32 (the uniform field {n} of the "
                                 "webgpu kernels); pass a value within float32's range") from None
        out.append(struct.pack("<" + _FMT[t], v))
    return b"".join(out)


def seed_bytes(seed: int) -> bytes:
    """The 8 bytes of (drop_k0, drop_k1) at ``SEED_OFFSET`` for a dropout seed in [0, 2**64)."""
    return struct.pack("<II", seed & 0xFFFFFFFF, seed >> 32)
