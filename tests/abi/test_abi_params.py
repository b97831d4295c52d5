"""Params: the seed's 38 u32 fields, names, order, bytes, range checks, layouts."""
from __future__ import annotations

import dataclasses
import re
import struct

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from anyattn import abi as A

from abi_seed_shader import SEED_PATH
from helpers import examples

SEED_ORDER = (
    "batch heads seq_q seq_k head_dim q_off k_off v_off dy_off out_off mask_off mask_kind "
    "scale_bits window wrt seq_q_stride seq_k_stride mask_batch_stride mask_head_stride "
    "_pad_mask_0 _pad_mask_1 _pad_mask_2 "
    "q_batch_stride q_head_stride q_seq_stride _pad_q "
    "k_batch_stride k_head_stride k_seq_stride _pad_k "
    "v_batch_stride v_head_stride v_seq_stride _pad_v "
    "o_batch_stride o_head_stride o_seq_stride _pad_o").split()

REQUIRED = dict(batch=2, heads=3, seq_q=5, seq_k=7, head_dim=4, q_off=0, k_off=1, v_off=2,
                dy_off=3, out_off=4, wrt=1,
                q_batch_stride=10, q_head_stride=11, q_seq_stride=12,
                k_batch_stride=13, k_head_stride=14, k_seq_stride=15,
                v_batch_stride=16, v_head_stride=17, v_seq_stride=18,
                o_batch_stride=19, o_head_stride=20, o_seq_stride=21)


def test_field_names_and_order_are_the_seeds():
    assert A.FIELD_NAMES == tuple(SEED_ORDER)
    assert len(A.FIELD_NAMES) == 38 and A.PARAMS_NBYTES == 152
    assert [f.name for f in dataclasses.fields(A.Params)] == SEED_ORDER


@pytest.mark.skipif(not SEED_PATH.is_file(), reason=f"seed shader absent ({SEED_PATH})")
def test_field_order_matches_the_seed_shader_struct():
    src = SEED_PATH.read_text()
    body = re.search(r"struct\s+Params\s*\{(.*?)\}", src, re.S).group(1)
    names = re.findall(r"(\w+)\s*:\s*u32", body)
    assert tuple(names) == A.FIELD_NAMES


def test_kind_constants():
    assert (A.MASK_NONE, A.MASK_CAUSAL, A.MASK_KEEP, A.MASK_CAUSAL_WINDOW, A.MASK_BIAS) == \
        (0, 1, 2, 3, 4)
    assert (A.WRT_Q, A.WRT_K, A.WRT_V) == (0, 1, 2)


def test_pack_layout_is_little_endian_u32_in_field_order():
    vals = {n: i * 1000 + 7 for i, n in enumerate(A.FIELD_NAMES)}
    p = A.Params(**vals)
    raw = p.pack()
    assert isinstance(raw, bytes) and len(raw) == 152
    for i, n in enumerate(A.FIELD_NAMES):
        assert struct.unpack_from("<I", raw, 4 * i)[0] == vals[n], n
    assert raw[:4] == (7).to_bytes(4, "little")
    assert A.Params.unpack(raw) == p
    assert A.Params.unpack(bytearray(raw)) == p
    assert A.Params.unpack(memoryview(raw)) == p
    assert A.Params.unpack(np.frombuffer(raw, dtype="<u4")) == p


@settings(max_examples=examples(50, 200), deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=38, max_size=38))
def test_pack_unpack_round_trip(values):
    p = A.Params(**dict(zip(A.FIELD_NAMES, values)))
    raw = p.pack()
    assert struct.unpack("<38I", raw) == tuple(values)
    assert A.Params.unpack(raw) == p
    assert A.Params.unpack(raw).pack() == raw


def test_optional_fields_default_to_zero_and_pads_are_optional():
    p = A.Params(**REQUIRED)
    for n in ("mask_off", "mask_kind", "window", "seq_q_stride", "seq_k_stride",
              "mask_batch_stride", "mask_head_stride", "_pad_mask_0", "_pad_mask_1",
              "_pad_mask_2", "_pad_q", "_pad_k", "_pad_v", "_pad_o"):
        assert getattr(p, n) == 0, n
    assert p.scale == pytest.approx(0.5)          # default 1/sqrt(head_dim=4)
    assert p.scale_bits == A.f32_bits(0.5)


def test_missing_required_field_is_a_type_error():
    kw = dict(REQUIRED)
    del kw["q_seq_stride"]
    with pytest.raises(TypeError, match="q_seq_stride"):
        A.Params(**kw)


def test_scale_convenience():
    p = A.Params(**REQUIRED, scale=0.1)
    assert p.scale_bits == struct.unpack("<I", struct.pack("<f", 0.1))[0]
    assert p.scale == float(np.float32(0.1))
    assert A.Params(**REQUIRED, scale_bits=p.scale_bits) == p
    assert A.bits_f32(A.f32_bits(0.375)) == 0.375
    # replace keeps scale_bits (the InitVar defaults to None)
    assert dataclasses.replace(p, wrt=2).scale_bits == p.scale_bits
    with pytest.raises(ValueError, match="scale or scale_bits"):
        A.Params(**REQUIRED, scale=0.1, scale_bits=3)
    with pytest.raises(TypeError, match="scale"):
        A.Params(**REQUIRED, scale="big")


def test_params_is_frozen_and_hashable():
    p = A.Params(**REQUIRED)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.batch = 3
    assert hash(p) == hash(A.Params(**REQUIRED))


@pytest.mark.parametrize("name", A.FIELD_NAMES)
def test_every_field_is_range_checked(name):
    base = {n: 0 for n in A.FIELD_NAMES}
    A.Params(**{**base, name: 2**32 - 1})
    for bad in (-1, 2**32):
        with pytest.raises(ValueError, match=rf"Params\.{name}=.*u32"):
            A.Params(**{**base, name: bad})
    for bad in (1.0, True, "3", None if name != "scale_bits" else 2.5):
        with pytest.raises(TypeError, match=rf"Params\.{name}"):
            A.Params(**{**base, name: bad})
    assert A.Params(**{**base, name: np.uint32(5)}).__getattribute__(name) == 5


def test_unpack_errors():
    with pytest.raises(ValueError, match="152 bytes"):
        A.Params.unpack(b"\0" * 151)
    with pytest.raises(ValueError, match="152 bytes"):
        A.Params.unpack(b"\0" * 156)
    with pytest.raises(TypeError, match="152 bytes"):
        A.Params.unpack(3.5)


def test_meanings():
    p = A.Params(**{**REQUIRED, "wrt": 0, "mask_kind": 3})
    assert (p.out_rows, p.wrt_name, p.mask_kind_name) == (5, "q", "causal_window")
    p = A.Params(**{**REQUIRED, "wrt": 2, "mask_kind": 4})
    assert (p.out_rows, p.wrt_name, p.mask_kind_name) == (7, "v", "bias")


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("wrt", [0, 1, 2])
def test_for_layout_strides(layout, wrt):
    B, H, Sq, Sk, D = 2, 3, 5, 7, 4
    p = A.Params.for_layout(batch=B, heads=H, seq_q=Sq, seq_k=Sk, head_dim=D, wrt=wrt,
                            q_off=1, k_off=2, v_off=3, dy_off=4, out_off=5, layout=layout,
                            mask_kind=A.MASK_KEEP, mask_off=6, mask_shape=(1, Sq, Sk),
                            window=2, scale=0.25)
    R = Sq if wrt == 0 else Sk
    if layout == "bhsd":
        assert (p.q_batch_stride, p.q_head_stride, p.q_seq_stride) == (H * Sq * D, Sq * D, D)
        assert (p.k_batch_stride, p.k_head_stride, p.k_seq_stride) == (H * Sk * D, Sk * D, D)
        assert (p.o_batch_stride, p.o_head_stride, p.o_seq_stride) == (H * R * D, R * D, D)
    else:
        assert (p.q_batch_stride, p.q_head_stride, p.q_seq_stride) == (Sq * H * D, D, H * D)
        assert (p.v_batch_stride, p.v_head_stride, p.v_seq_stride) == (Sk * H * D, D, H * D)
        assert (p.o_batch_stride, p.o_head_stride, p.o_seq_stride) == (R * H * D, D, H * D)
    # a [1, Sq, Sk] mask: broadcast over batch and heads with stride 0
    assert (p.mask_batch_stride, p.mask_head_stride, p.seq_q_stride, p.seq_k_stride) == \
        (0, 0, Sk, 1)
    assert (p.q_off, p.k_off, p.v_off, p.dy_off, p.out_off, p.mask_off) == (1, 2, 3, 4, 5, 6)
    assert p.scale == 0.25 and p.window == 2 and p.mask_kind == A.MASK_KEEP


def test_for_layout_errors():
    kw = dict(batch=1, heads=1, seq_q=2, seq_k=2, head_dim=2, wrt=0, q_off=0, k_off=0,
              v_off=0, dy_off=0, out_off=0)
    with pytest.raises(ValueError, match="layout"):
        A.Params.for_layout(**kw, layout="sbhd")
    with pytest.raises(ValueError, match="mask_shape"):
        A.Params.for_layout(**kw, mask_kind=A.MASK_BIAS, mask_shape=(3, 2))
    with pytest.raises(ValueError, match="layout"):
        A.layout_strides("hsd", 1, 1, 1)
