"""Malformed GGUF files end in a specific error naming the offending value, and the CLI prints
one line and exits non-zero."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gguf import GGUFWriter

from helpers import patch, tensor_info_offset
from slipstream.modelfile.config import ModelConfig
from slipstream.errors import (GGUFError, GGUFLayoutError, InvalidMetadata, MissingMetadata,
                               ModelNotFound, SlipstreamError, TensorInfoError, TokenizerError,
                               UnsupportedArchitecture, UnsupportedTensorType)
from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.synth import write_synth
from slipstream.weights import load_weights


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_synth(tmp_path_factory.mktemp("gguf") / "good.gguf", "tiny", "Q8_0")


@pytest.fixture
def copy(good, tmp_path):
    dst = tmp_path / "bad.gguf"
    shutil.copy(good, dst)
    return dst


def load_all(path):
    import torch

    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    from slipstream.precision import Precision

    cpu = torch.device("cpu")
    return load_weights(gf, cfg, cpu, Precision.of("fast", cpu))


def test_good_file_loads(good):
    load_all(good)


def test_missing_file(tmp_path):
    with pytest.raises(ModelNotFound, match="does not exist"):
        GGUFFile(tmp_path / "nope.gguf")


def test_bad_magic(copy):
    patch(copy, 0, b"GGML")
    with pytest.raises(GGUFError, match=r"bad magic b'GGML'"):
        GGUFFile(copy)


def test_bad_version(copy):
    patch(copy, 4, struct.pack("<I", 99))
    with pytest.raises(GGUFError, match="unsupported GGUF version 99"):
        GGUFFile(copy)


def test_file_shorter_than_header(copy):
    copy.write_bytes(copy.read_bytes()[:10])
    with pytest.raises(GGUFError, match="10 bytes, too short"):
        GGUFFile(copy)


def test_truncated_in_metadata(copy):
    copy.write_bytes(copy.read_bytes()[:2000])
    with pytest.raises(GGUFLayoutError, match=r"metadata array 'tokenizer\.ggml\.tokens' "
                                              r"declares 1024 STRING elements.*truncated"):
        GGUFFile(copy)


def test_truncated_tensor_data(copy):
    data = copy.read_bytes()
    copy.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"'output\.weight'.*the file has only \d+ bytes.*"
                                        r"truncated"):
        GGUFFile(copy)


def test_row_length_not_whole_blocks(copy):
    # blk.0.attn_q.weight is Q8_0 (block 32), shape ne = [256, 256]: make ne[0] 200
    at = tensor_info_offset(copy, "blk.0.attn_q.weight")
    patch(copy, at + 4, struct.pack("<Q", 200))
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_q\.weight': row length 200 is not a "
                                        r"multiple of the Q8_0 block size 32"):
        GGUFFile(copy)


def test_shape_larger_than_its_bytes(copy):
    # ne[1] 256 -> 300: the tensor now claims more bytes than lie before the next tensor
    at = tensor_info_offset(copy, "blk.0.attn_q.weight")
    patch(copy, at + 12, struct.pack("<Q", 300))
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_q\.weight'.*runs into tensor"):
        GGUFFile(copy)


def test_shape_smaller_than_its_bytes(copy):
    # ne[1] 256 -> 128: the tensor now ends half-way to the next one (llama.cpp refuses gaps)
    at = tensor_info_offset(copy, "blk.0.attn_q.weight")
    patch(copy, at + 12, struct.pack("<Q", 128))
    with pytest.raises(TensorInfoError, match=r"'blk\.0\.attn_k\.weight' has data offset "
                                              r"\d+, but the data section puts it at \d+, where "
                                              r"tensor 'blk\.0\.attn_q\.weight' \(Q8_0, shape "
                                              r"\[256, 128\]"):
        GGUFFile(copy)


def test_shape_disagrees_with_metadata(copy):
    # ne [256, 256] -> [512, 128] keeps the byte size but is not what the config expects
    at = tensor_info_offset(copy, "blk.0.attn_q.weight")
    patch(copy, at + 4, struct.pack("<QQ", 512, 128))
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_q\.weight' has shape \[128, 512\], "
                                        r"expected \[256, 256\]"):
        load_all(copy)


def test_unknown_type_id(copy):
    at = tensor_info_offset(copy, "blk.0.attn_k.weight")
    patch(copy, at + 4 + 16, struct.pack("<I", 99))  # n_dims u32, 2 dims u64, then type u32
    with pytest.raises(UnsupportedTensorType, match="'blk.0.attn_k.weight' has unknown GGML "
                                                    "type id 99"):
        GGUFFile(copy)


def test_unsupported_known_type(copy):
    at = tensor_info_offset(copy, "blk.0.attn_norm.weight")
    patch(copy, at + 4 + 8, struct.pack("<I", 26))  # F32 -> I32: the same bytes, no format
    with pytest.raises(UnsupportedTensorType, match="tensor type I32 is not supported"):
        load_all(copy)


def test_type_with_fewer_bytes_leaves_a_gap(copy):
    at = tensor_info_offset(copy, "blk.0.attn_k.weight")
    patch(copy, at + 4 + 16, struct.pack("<I", 16))  # IQ2_XXS: smaller blocks, a gap after
    with pytest.raises(TensorInfoError, match=r"'blk\.0\.attn_v\.weight' has data offset \d+, "
                                              r"but the data section puts it at \d+, where "
                                              r"tensor 'blk\.0\.attn_k\.weight' \(IQ2_XXS"):
        GGUFFile(copy)


def _metadata_only(path, arch: str, **keys):
    w = GGUFWriter(path, arch)
    for k, v in keys.items():
        getattr(w, f"add_{k}")(v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def test_unsupported_architecture(tmp_path):
    p = _metadata_only(tmp_path / "mamba.gguf", "mamba", block_count=2)
    gf = GGUFFile(p)
    with pytest.raises(UnsupportedArchitecture, match="architecture 'mamba' is not supported"):
        ModelConfig.from_metadata(gf.metadata, source=p.name)


def test_missing_metadata(tmp_path):
    p = _metadata_only(tmp_path / "nolayers.gguf", "llama", embedding_length=64)
    gf = GGUFFile(p)
    with pytest.raises(MissingMetadata, match="missing required metadata 'llama.block_count'"):
        ModelConfig.from_metadata(gf.metadata, source=p.name)


def test_missing_tensor(tmp_path):
    p = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0")
    at = tensor_info_offset(p, "blk.1.ffn_up.weight")
    patch(p, at - len("blk.1.ffn_up.weight"), b"blk.1.ffn_XX.weight")
    with pytest.raises(GGUFError, match="missing tensor 'blk.1.ffn_up.weight'"):
        load_all(p)


@pytest.mark.slow
@pytest.mark.parametrize("mutate,needle", [
    (lambda p: patch(p, 0, b"XXXX"), "bad magic"),
    (lambda p: p.write_bytes(p.read_bytes()[:-1000]), "truncated"),
])
def test_cli_prints_one_line_and_fails(copy, mutate, needle):
    mutate(copy)
    for cmd in (["info", "-m", str(copy)], ["run", "-m", str(copy), "-n", "1"]):
        r = subprocess.run([sys.executable, "-m", "slipstream.cli", *cmd], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 1
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0]
        assert "Traceback" not in r.stderr


# -- validation of hostile files (see slipstream.modelfile.validate) -----------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
import fuzz_gguf  # noqa: E402


def rewrite(src: Path, dst: Path, edit) -> Path:
    """dst: src with `edit(doc)` applied to its fuzz_gguf document, written back."""
    doc = fuzz_gguf.parse(src.read_bytes())
    edit(doc)
    dst.write_bytes(fuzz_gguf.serialize(doc))
    return dst


def set_kv(key: str, value, vtype: int | None = None, itype: int | None = None):
    def edit(doc):
        kv = doc.kv(key)
        if kv is None:
            kv = fuzz_gguf.KV(key.encode(), vtype if vtype is not None else 4, None)
            doc.kvs.append(kv)
        kv.value = value
        if vtype is not None:
            kv.vtype = vtype
        if itype is not None:
            kv.itype = itype
    return edit


def open_model(path: Path):
    """What load() does with a file before it allocates anything."""
    from slipstream.modelfile.chat_template import ChatTemplate
    from slipstream.modelfile.tokenizer import Tokenizer

    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    Tokenizer.from_metadata(gf.metadata)
    ChatTemplate.from_metadata(gf.metadata)
    return gf, cfg


def _kv_info(path: Path, key: str):
    return next(k for k in GGUFFile(path).layout.kvs if k.key == key)


@pytest.mark.parametrize("count", [2**40, 2**64 - 1, 10**6])
def test_huge_array_count_is_refused_at_once(copy, count):
    # gguf-py would loop once per element (one numpy view each) for hours
    info = _kv_info(copy, "tokenizer.ggml.token_type")
    patch(copy, info.count_offset, struct.pack("<Q", count))
    t0 = time.perf_counter()
    with pytest.raises(GGUFLayoutError, match=rf"metadata array 'tokenizer\.ggml\.token_type' "
                                              rf"declares {count} INT32 elements .* hold at most"):
        GGUFFile(copy)
    assert time.perf_counter() - t0 < 2


def test_huge_string_length(copy):
    info = _kv_info(copy, "tokenizer.chat_template")
    patch(copy, info.value_offset, struct.pack("<Q", 2**62))
    with pytest.raises(GGUFLayoutError, match=r"value of 'tokenizer\.chat_template' .* needs "
                                              r"4611686018427387904 bytes but only \d+ remain"):
        GGUFFile(copy)


@pytest.mark.parametrize("at,what", [(8, "tensor_count"), (16, "kv_count")])
def test_huge_header_counts(copy, at, what):
    patch(copy, at, struct.pack("<Q", 2**63))
    with pytest.raises(GGUFLayoutError, match=rf"declares 9223372036854775808 .*GGUF {what}"):
        GGUFFile(copy)


def test_tensor_count_one_less_shifts_nothing_silently(copy):
    # the last tensor info becomes padding, the data section starts earlier: every offset
    # would be read shifted; the bytes left over after the last tensor give it away
    n = len(GGUFFile(copy).tensors)
    patch(copy, 8, struct.pack("<Q", n - 1))
    with pytest.raises(GGUFLayoutError, match=r"bytes after the last tensor \('output_norm"
                                              r"\.weight'\) belong to no tensor"):
        GGUFFile(copy)


def test_tensor_count_one_more(copy):
    n = len(GGUFFile(copy).tensors)
    patch(copy, 8, struct.pack("<Q", n + 1))
    with pytest.raises(GGUFError):
        GGUFFile(copy)


def test_misaligned_tensor_offset(good, tmp_path):
    def edit(doc):
        doc.tensors[3].offset += 8
    p = rewrite(good, tmp_path / "m.gguf", edit)
    with pytest.raises(TensorInfoError, match=r"data offset \d+, which is not a multiple of "
                                              r"the file's alignment 32"):
        GGUFFile(p)


def test_tensor_offsets_swapped(good, tmp_path):
    def edit(doc):
        doc.tensors[3].offset, doc.tensors[4].offset = doc.tensors[4].offset, doc.tensors[3].offset
    p = rewrite(good, tmp_path / "m.gguf", edit)
    with pytest.raises(TensorInfoError, match="unaccounted for"):
        GGUFFile(p)


@pytest.mark.parametrize("align", [0, 3, 48])
def test_alignment_not_a_power_of_two(good, tmp_path, align):
    p = rewrite(good, tmp_path / "m.gguf", set_kv("general.alignment", align, 4))
    with pytest.raises(InvalidMetadata, match=rf"'general\.alignment' is {align}; it must be a "
                                              rf"power of two"):
        GGUFFile(p)


def test_alignment_of_the_wrong_type(good, tmp_path):
    p = rewrite(good, tmp_path / "m.gguf", set_kv("general.alignment", 32, 10))
    with pytest.raises(InvalidMetadata, match=r"'general\.alignment' has type UINT64, expected "
                                              r"UINT32"):
        GGUFFile(p)


def test_other_alignment_laid_out_again_loads(good, tmp_path):
    def edit(doc):
        set_kv("general.alignment", 64, 4)(doc)
        fuzz_gguf.relayout(doc, None)
    p = rewrite(good, tmp_path / "m.gguf", edit)
    gf, cfg = open_model(p)
    assert gf.layout.alignment == 64 and cfg.n_layers == 2


def test_tensor_name_too_long(good, tmp_path):
    def edit(doc):
        doc.tensors[-1].name = b"x" * 70
    with pytest.raises(TensorInfoError, match="is 70 bytes long; GGUF allows at most 63"):
        GGUFFile(rewrite(good, tmp_path / "m.gguf", edit))


def test_duplicate_metadata_key(good, tmp_path):
    def edit(doc):
        doc.kvs.append(doc.kv("llama.block_count"))
    with pytest.raises(GGUFLayoutError, match="metadata key 'llama.block_count' appears twice"):
        GGUFFile(rewrite(good, tmp_path / "m.gguf", edit))


def test_unknown_value_type(copy):
    info = _kv_info(copy, "llama.block_count")
    patch(copy, info.type_offset, struct.pack("<I", 77))
    with pytest.raises(GGUFLayoutError, match="metadata 'llama.block_count' at byte \\d+ has "
                                              "unknown value type id 77"):
        GGUFFile(copy)


@pytest.mark.parametrize("key,value,vtype,exc,needle", [
    ("llama.rope.freq_base", 0.0, 6, InvalidMetadata, r"'llama\.rope\.freq_base' is 0\.0"),
    ("llama.rope.freq_base", -10000.0, 6, InvalidMetadata, r"'llama\.rope\.freq_base' is "
                                                            r"-10000\.0"),
    ("llama.rope.freq_base", float("inf"), 6, InvalidMetadata, r"freq_base' is inf"),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), 6, InvalidMetadata,
     r"'llama\.attention\.layer_norm_rms_epsilon' is nan; it must be a finite number"),
    ("llama.attention.layer_norm_rms_epsilon", 0.0, 6, InvalidMetadata, r"epsilon' is 0\.0"),
    ("llama.rope.dimension_count", 33, 4, InvalidMetadata, r"is 33; RoPE rotates pairs"),
    ("llama.rope.dimension_count", 2**32 - 1, 4, InvalidMetadata,
     r"'llama\.rope\.dimension_count' is 4294967295, outside the valid range 1\.\.64 \(at most "
     r"the head size 64\)"),
    ("llama.rope.dimension_count", -48, 5, InvalidMetadata, r"is -48, outside"),
    ("llama.attention.head_count_kv", 3, 4, GGUFError, r"head counts 4 \(query\) and 3"),
    ("llama.attention.head_count", 0, 4, InvalidMetadata, r"head_count' is 0, outside"),
    ("llama.attention.head_count", 6, 4, InvalidMetadata, r"embedding_length 256 is not a "
                                                          r"multiple of .*head_count 6"),
    ("llama.embedding_length", 2**40, 10, InvalidMetadata, r"embedding_length' is "
                                                           r"1099511627776, outside"),
    ("llama.context_length", 0, 4, InvalidMetadata, r"'llama\.context_length' is 0"),
    ("llama.context_length", 2**40, 10, InvalidMetadata, r"'llama\.context_length' is "
                                                         r"1099511627776"),
    ("llama.vocab_size", 1023, 4, InvalidMetadata, r"'llama\.vocab_size' is 1023 but "
                                                   r"'tokenizer\.ggml\.tokens' has 1024 tokens"),
    ("llama.block_count", 3, 4, GGUFError, r"missing tensor 'blk\.2\.attn_norm\.weight' \(the "
                                           r"file has no tensors of layer 2"),
    ("llama.block_count", 1, 4, InvalidMetadata, r"'llama\.block_count' is 1 but the file has "
                                                 r"tensors of layer 1"),
    ("llama.block_count", 0, 4, InvalidMetadata, r"'llama\.block_count' is 0, outside"),
    ("llama.block_count", b"2", 8, InvalidMetadata, r"'llama\.block_count' has type STRING, "
                                                    r"expected an integer"),
    ("llama.rope.freq_base", [1.0, 2.0], 9, InvalidMetadata, r"freq_base' has type ARRAY of "
                                                             r"FLOAT32, expected a float"),
    ("llama.attention.key_length", 32, 4, UnsupportedArchitecture,
     r"value_length 64 differs|value_length"),
    ("llama.attention.head_count_kv", [2, 1], 9, InvalidMetadata, r"per-layer array \[2, 1\]"),
    ("llama.rope.scaling.factor", float("nan"), 6, InvalidMetadata, r"factor' is nan"),
    ("llama.rope.scaling.type", 7, 4, InvalidMetadata, r"scaling\.type' has type UINT32, "
                                                       r"expected a string"),
    ("tokenizer.chat_template", 5, 4, InvalidMetadata, r"'tokenizer\.chat_template' has type "
                                                       r"UINT32, expected a string"),
    ("tokenizer.ggml.tokens", [1, 2, 3], 9, InvalidMetadata, r"'tokenizer\.ggml\.tokens' has type "
                                                             r"ARRAY of UINT32, expected an array "
                                                             r"of strings"),
    ("tokenizer.ggml.bos_token_id", 1.5, 6, InvalidMetadata, r"bos_token_id' has type FLOAT32"),
])
def test_hyperparameters(good, tmp_path, key, value, vtype, exc, needle):
    itype = 4 if isinstance(value, list) and isinstance(value[0], int) else 6

    def edit(doc):
        set_kv(key, value, vtype, itype if vtype == 9 else None)(doc)
        if key == "llama.attention.key_length":
            set_kv("llama.attention.value_length", 64, 4)(doc)
    p = rewrite(good, tmp_path / "m.gguf", edit)
    with pytest.raises(exc, match=needle):
        open_model(p)


def test_per_layer_head_counts_that_agree_are_accepted(good, tmp_path):
    p = rewrite(good, tmp_path / "m.gguf", set_kv("llama.attention.head_count_kv", [2, 2], 9, 4))
    _, cfg = open_model(p)
    assert cfg.n_kv_heads == 2


def test_rope_freqs_must_be_positive(tmp_path):
    p = write_synth(tmp_path / "r.gguf", "tiny", "Q8_0", rope_freqs=True)
    info = GGUFFile(p).tensors["rope_freqs.weight"]
    patch(p, info.offset + 4 * 5, struct.pack("<f", 0.0))
    with pytest.raises(InvalidMetadata, match=r"'rope_freqs\.weight' has value 0\.0 at index 5"):
        GGUFFile(p)


@pytest.mark.parametrize("edit,needle", [
    (lambda m: m.__setitem__(7, b"a"), r"malformed merge 'a' in tokenizer\.ggml\.merges"),
    (lambda m: m.__setitem__(7, b"e "), r"malformed merge 'e '"),
    (lambda m: m.__setitem__(7, b"zzz q"), r"tokenizer\.ggml\.merges\[7\] 'zzz q' uses 'zzz', "
                                           r"which is not in tokenizer\.ggml\.tokens"),
])
def test_damaged_merges(good, tmp_path, edit, needle):
    p = rewrite(good, tmp_path / "m.gguf", lambda doc: edit(doc.kv("tokenizer.ggml.merges").value))
    with pytest.raises(TokenizerError, match=needle):
        open_model(p)


def test_token_type_out_of_range(good, tmp_path):
    def edit(doc):
        doc.kv("tokenizer.ggml.token_type").value[9] = 12
    with pytest.raises(TokenizerError, match=r"token_type\[9\] is 12, not a token type"):
        open_model(rewrite(good, tmp_path / "m.gguf", edit))


def test_token_types_shorter_than_tokens(good, tmp_path):
    def edit(doc):
        doc.kv("tokenizer.ggml.token_type").value.pop()
    with pytest.raises(TokenizerError, match=r"token_type has 1023 entries for 1024 tokens"):
        open_model(rewrite(good, tmp_path / "m.gguf", edit))


def test_tokenizers_library_errors_are_wrapped(good, monkeypatch):
    from slipstream.modelfile import vocab

    def boom(*a, **k):
        raise Exception("Error while initializing BPE: something")

    monkeypatch.setattr(vocab.models, "BPE", boom)
    with pytest.raises(TokenizerError, match=r"rejected by the tokenizers library: Exception: "
                                             r"Error while initializing BPE"):
        open_model(good)


@pytest.mark.parametrize("edit", [
    set_kv("llama.rope.dimension_count", 2**33, 10),
    set_kv("llama.rope.freq_base", -1.0, 6),
    set_kv("llama.block_count", 3, 4),
    set_kv("tokenizer.ggml.merges", [b"zz qq"], 9, 8),
])
def test_load_raises_only_slipstream_errors(good, tmp_path, edit):
    import slipstream

    p = rewrite(good, tmp_path / "m.gguf", edit)
    with pytest.raises(SlipstreamError):
        slipstream.load(p, device="cpu", ctx=64)


# -- long metadata arrays, read in one piece (gguf_file._BulkArrayField) ----------------------

def test_bulk_arrays_read_as_the_gguf_reader_does(tmp_path):
    """Every metadata value, and contents() by index and by slice, as gguf-py's own reader
    gives them, for arrays of strings, integers, floats and bools of lengths around the point
    where reading in one piece starts."""
    from gguf import GGUFReader

    p = tmp_path / "arrays.gguf"
    w = GGUFWriter(p, "llama")
    rng = __import__("random").Random(5)
    for n in (0, 1, 15, 16, 17, 300):
        w.add_array(f"test.str{n}", ["".join(rng.choice("ab \u0120\u2581\u00e9") for _ in
                                              range(rng.randint(0, 9))) for _ in range(n)])
        w.add_array(f"test.int{n}", [rng.randint(-2**31, 2**31 - 1) for _ in range(n)])
        w.add_array(f"test.float{n}", [rng.uniform(-1e3, 1e3) for _ in range(n)])
        w.add_array(f"test.bool{n}", [rng.random() < 0.5 for _ in range(n)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = GGUFFile(p), GGUFReader(p)
    bulk = 0
    for key, field in ref.fields.items():
        if not key.startswith("test."):
            continue
        mine = ours.reader.fields[key]
        bulk += type(mine).__name__ == "_BulkArrayField"
        assert mine.types == field.types, key
        assert ours.metadata[key] == field.contents(), key
        n = len(field.contents())
        for i in {0, n // 2, n - 1} if n else ():
            assert mine.contents(i) == field.contents(i), (key, i)
        assert mine.contents(slice(1, 7, 2)) == field.contents(slice(1, 7, 2)), key
    assert bulk == 4 * 3  # the 16, 17 and 300 long ones, of each kind


def test_bulk_string_array_not_utf8(tmp_path):
    p = tmp_path / "bad-utf8.gguf"
    w = GGUFWriter(p, "llama")
    w.add_array("test.strings", [f"token{i}" for i in range(40)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = bytearray(p.read_bytes())
    at = data.index(b"token17")
    data[at:at + 2] = b"\xff\xfe"
    p.write_bytes(bytes(data))
    with pytest.raises(GGUFError, match=r"metadata field 'test\.strings' cannot be decoded"):
        GGUFFile(p)


def test_unreadable_file_is_a_clean_error(copy, monkeypatch):
    import mmap

    def fail(*args, **kwargs):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(mmap, "mmap", fail)
    with pytest.raises(GGUFError, match=r"bad\.gguf: cannot read the file \(Input/output error\)"):
        GGUFFile(copy)


def test_the_scans_string_array_ends_give_the_readers_own_parse(good):
    """GGUFFile hands the reader the ends validate.scan_layout walked (not walked again): the
    same metadata as the reader's own walk; an end past the file is walked as before."""
    from slipstream.modelfile.gguf_file import _CheckedReader, _field_value

    gf = GGUFFile(good)
    own = _CheckedReader(good, "r")
    assert {k: _field_value(f) for k, f in own.fields.items() if not k.startswith("GGUF.")} \
        == gf.metadata
    bogus = {kv.value_offset: 1 << 40 for kv in gf.layout.kvs}
    again = _CheckedReader(good, "r", bogus)
    assert again.fields["tokenizer.ggml.tokens"].contents() == \
        gf.metadata["tokenizer.ggml.tokens"]
