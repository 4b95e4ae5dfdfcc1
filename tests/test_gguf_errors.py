"""Malformed GGUF files end in a specific error naming the offending value, and the CLI prints
one line and exits non-zero."""

from __future__ import annotations

import shutil
import struct
import subprocess
import sys

import pytest
from gguf import GGUFWriter

from helpers import patch, tensor_info_offset
from slipstream.config import ModelConfig
from slipstream.errors import (GGUFError, MissingMetadata, ModelNotFound,
                               UnsupportedArchitecture, UnsupportedTensorType)
from slipstream.gguf_file import GGUFFile
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
    with pytest.raises(GGUFError, match="corrupt or truncated GGUF header"):
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


def test_shape_disagrees_with_metadata(copy):
    # ne[1] 256 -> 128 is self-consistent bytes-wise but not what the config expects
    at = tensor_info_offset(copy, "blk.0.attn_q.weight")
    patch(copy, at + 12, struct.pack("<Q", 128))
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_q\.weight' has shape \[128, 256\], "
                                        r"expected \[256, 256\]"):
        load_all(copy)


def test_unknown_type_id(copy):
    at = tensor_info_offset(copy, "blk.0.attn_k.weight")
    patch(copy, at + 4 + 16, struct.pack("<I", 99))  # n_dims u32, 2 dims u64, then type u32
    with pytest.raises(UnsupportedTensorType, match="'blk.0.attn_k.weight' has unknown GGML "
                                                    "type id 99"):
        GGUFFile(copy)


def test_unsupported_known_type(copy):
    at = tensor_info_offset(copy, "blk.0.attn_k.weight")
    patch(copy, at + 4 + 16, struct.pack("<I", 16))  # IQ2_XXS: smaller blocks, still fits
    with pytest.raises(UnsupportedTensorType, match="tensor type IQ2_XXS is not supported"):
        load_all(copy)


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
