"""The native q4vnni and q8vnni packers (native/int4_pack.c's ss_q4vnni_rows and
ss_q8vnni_rows through weights.cpu.native_pack) against weights.cpu.vnni's torch-op paths
(group_affine, then q4vnni_params and q4vnni_codes; q8vnni_codes of q + 128 and the float16
scales): the same code bytes, scales and zeros for every 4-bit format and Q8_0, stacked parts
whose rows are not whole 16-row records, a mix of formats, any thread count, and the same
packed linear from Q4VnniLinear.from_raws (Q8VnniLinear.from_raws) either way. Whether the
packed weight computes what the GGUF dequantizer gives is tests/weights/test_cpu_packed.py's."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from slipstream import native
from slipstream.weights.cpu import vnni
from slipstream.weights.cpu.groups import Q4V_ROWS, row_chunks
from slipstream.weights.cpu.native_pack import FORMATS, q4vnni_native, q8vnni_native, \
    random_matrix
from slipstream.weights.cpu.vnni import Q4VnniLinear, Q8VnniLinear, q4vnni_codes, q4vnni_params

from test_int4_native import encoded

pytestmark = pytest.mark.skipif(native.library() is None,
                                reason="no C compiler: the torch ops pack")


def torch_path(raws, qtypes, shapes, padded: int):
    """vnni.py's torch-op packing, step by step: codes (blocks, groups, 256), s, z."""
    cols = shapes[0][1]
    u = torch.zeros(padded, cols, dtype=torch.uint8)
    s = torch.zeros(padded, cols // 32)
    z = torch.zeros(padded, cols // 32)
    for r0, ga in row_chunks(raws, qtypes, shapes):
        r1 = r0 + ga.shape[0]
        u[r0:r1], s[r0:r1], z[r0:r1] = q4vnni_params(ga)
    return q4vnni_codes(u), s, z


def same_bits(a, b) -> bool:
    return all(x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
               for x, y in zip(a, b))


def padded(shapes) -> int:
    return -(-sum(r for r, _ in shapes) // Q4V_ROWS) * Q4V_ROWS


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_stacked_parts_equal_the_torch_path(qtype):
    # 40 + 23 rows: the second part starts inside a record and the last record is padding
    shapes = [(40, 768), (23, 768)]
    parts = [encoded(qtype, *shapes[0], 1), encoded(qtype, *shapes[1], 2)]
    got = q4vnni_native(parts, [qtype, qtype], shapes, padded(shapes))
    assert got is not None
    assert same_bits(got, torch_path(parts, [qtype, qtype], shapes, padded(shapes)))


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_random_fields_and_signed_zeros_equal_the_torch_path(qtype):
    """Random codes, scales and mins (some scales zero, some negative): zeros' signs too."""
    gen = torch.Generator().manual_seed(7)
    raw = random_matrix(qtype, 48, 512, gen)
    shapes = [(48, 512)]
    got = q4vnni_native([raw], [qtype], shapes, 48)
    assert same_bits(got, torch_path([raw], [qtype], shapes, 48))
    assert (got[1] == 0).any()  # zero scales: the case whose -8 s and 0 s keep a sign


def test_a_mix_of_formats_and_threads():
    shapes = [(24, 1024), (40, 1024)]
    parts = [encoded(Q.Q4_K, *shapes[0], 3), encoded(Q.Q4_0, *shapes[1], 4)]
    want = torch_path(parts, [Q.Q4_K, Q.Q4_0], shapes, 64)
    for threads in (1, 2, 3):
        assert same_bits(q4vnni_native(parts, [Q.Q4_K, Q.Q4_0], shapes, 64, threads), want)


def test_other_formats_are_left_to_the_torch_path():
    assert q4vnni_native([encoded(Q.Q8_0, 16, 256, 5)], [Q.Q8_0], [(16, 256)], 16) is None


@pytest.mark.parametrize("qtypes", [(Q.Q4_K, Q.Q4_K), (Q.Q4_1, Q.Q4_0)],
                         ids=lambda qs: "+".join(q.name for q in qs))
def test_the_packed_linear_is_the_same_either_way(monkeypatch, qtypes):
    shapes = [(56, 512), (37, 512)]
    parts = [encoded(q, *s, 6 + i) for i, (q, s) in enumerate(zip(qtypes, shapes))]
    fast = Q4VnniLinear.from_raws(parts, list(qtypes), shapes)
    monkeypatch.setattr(vnni, "q4vnni_native", lambda *a, **k: None)
    slow = Q4VnniLinear.from_raws(parts, list(qtypes), shapes)
    assert torch.equal(fast.packed, slow.packed) and fast.out_features == slow.out_features
    x = torch.randn(2, 512)
    assert torch.equal(fast(x), slow(x))


def test_a_wrong_byte_count_is_refused():
    raw = encoded(Q.Q4_K, 16, 512, 8)
    with pytest.raises(ValueError, match="uint8 bytes"):
        q4vnni_native([raw[:, :-1]], [Q.Q4_K], [(16, 512)], 16)


def q8_torch_path(raws, shapes) -> torch.Tensor:
    """Q8VnniLinear.from_raws' torch ops, whatever the library: its packed records."""
    import unittest.mock

    with unittest.mock.patch.object(vnni, "q8vnni_native", lambda *a, **k: None):
        return Q8VnniLinear.from_raws(raws, [Q.Q8_0] * len(raws), shapes).packed


def test_q8_stacked_parts_equal_the_torch_path():
    # 40 + 23 rows: the second part starts inside a record and the last record is padding
    shapes = [(40, 768), (23, 768)]
    parts = [encoded(Q.Q8_0, *shapes[0], 11), encoded(Q.Q8_0, *shapes[1], 12)]
    got = q8vnni_native(parts, shapes, padded(shapes))
    want = q8_torch_path(parts, shapes)
    assert got is not None and got.shape == want.shape == (4, 24, 544)
    assert torch.equal(got, want)
    assert not got[-1, :, :].view(-1)[-1].item()  # the padding rows' scales stay 0


def test_q8_random_codes_and_scales_and_threads():
    """Every code byte (-128..127, where + 128 wraps) and random, zero and negative scales."""
    gen = torch.Generator().manual_seed(9)
    raw = torch.randint(0, 256, (32 * 8, 34), dtype=torch.uint8, generator=gen)
    f16 = (torch.randn(raw.shape[0], generator=gen) * 0.05).half()
    f16[::5] = 0.0
    raw[:, :2] = f16.view(torch.uint8).reshape(-1, 2)
    raw = raw.reshape(32, -1)  # 32 rows of 8 blocks: 256 columns
    want = q8_torch_path([raw], [(32, 256)])
    for threads in (1, 2, 3):
        assert torch.equal(q8vnni_native([raw], [(32, 256)], 32, threads), want)


def test_q8_a_record_byte_moved_is_seen():
    """Negative control: the comparison above sees one code in the wrong place."""
    raw = encoded(Q.Q8_0, 16, 64, 13)
    got = q8vnni_native([raw], [(16, 64)], 16)
    bad = got.clone()
    bad[0, 0, [0, 4]] = bad[0, 0, [4, 0]]  # row 0's and row 1's first codes swapped
    assert not torch.equal(bad, q8_torch_path([raw], [(16, 64)]))
    assert torch.equal(got, q8_torch_path([raw], [(16, 64)]))


def test_q8_the_packed_linear_is_the_same_either_way(monkeypatch):
    shapes = [(56, 512), (37, 512)]
    parts = [encoded(Q.Q8_0, *s, 14 + i) for i, s in enumerate(shapes)]
    fast = Q8VnniLinear.from_raws(parts, [Q.Q8_0, Q.Q8_0], shapes)
    monkeypatch.setattr(vnni, "q8vnni_native", lambda *a, **k: None)
    slow = Q8VnniLinear.from_raws(parts, [Q.Q8_0, Q.Q8_0], shapes)
    assert torch.equal(fast.packed, slow.packed) and fast.out_features == slow.out_features
    x = torch.randn(2, 512)
    assert torch.equal(fast(x), slow(x))


def test_q8_a_wrong_byte_count_is_refused():
    raw = encoded(Q.Q8_0, 16, 256, 15)
    with pytest.raises(ValueError, match="uint8 bytes"):
        q8vnni_native([raw[:, :-1]], [(16, 256)], 16)
