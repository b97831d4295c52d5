"""Helpers of the transformers-backend tests (tests/torch/test_transformers*.py)."""
import torch

from anyattn.masks import AndMask, KeepMask
from anyattn.torch.transformers_backend import StructuredMask


def rel(got, want) -> float:
    """max |got - want| / max |want|."""
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def terms(mask):
    """The and-ed terms of an anyattn mask."""
    return mask.terms if isinstance(mask, AndMask) else (mask,)


def dense_masks(mask):
    """The KeepMask terms of ``mask`` that vary over queries (a dense [.., Sq, Sk] mask)."""
    return [t for t in terms(mask) if isinstance(t, KeepMask) and t.mask.shape[-2] != 1]


def assert_structure_equals(got, want: torch.Tensor) -> None:
    """The builder's StructuredMask ``got`` is transformers' bool mask ``want``
    [B, 1, Sq, Sk] with no dense term, and lists exactly the rows that keep no key."""
    B, _, Sq, Sk = want.shape
    assert isinstance(got, StructuredMask) and got.shape == (B, 1, Sq, Sk)
    assert got.mask is None or not dense_masks(got.mask)
    assert torch.equal(got.to_dense(), want)
    empty = ~want[:, 0].any(-1)                                       # [B, Sq]
    listed = torch.zeros_like(empty)
    if got.empty_rows is not None:
        rows, valid = got.empty_rows
        listed[torch.arange(B)[:, None].expand_as(rows)[valid], rows[valid]] = True
    assert torch.equal(listed, empty)
