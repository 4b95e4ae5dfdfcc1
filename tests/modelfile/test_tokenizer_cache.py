"""The tokenizer cache: an entry read back tokenizes as the tokenizer built from the file does,
and a changed file, a changed entry or an unwritable folder never gives another tokenizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from slipstream.modelfile.gguf_file import GGUFFile
from slipstream.modelfile.tokenizer import Tokenizer
from slipstream.modelfile.tokenizer_cache import cache_key, load_tokenizer
from slipstream.synth import write_synth

TEXTS = ["Hello world", " leading space", "héllo wörld ✓ 日本語",
         "<|im_start|>user\nhi<|im_end|>", "tabs\tand\nnewlines  ", "1234567890 + 3.14", ""]


def _same(a: Tokenizer, b: Tokenizer) -> None:
    for text in TEXTS:
        ids = a.encode(text)
        assert b.encode(text) == ids, text
        assert b.decode(ids) == a.decode(ids)
    assert (b.bos_id, b.eos_id, b.eot_ids, b.vocab_size) == \
        (a.bos_id, a.eos_id, a.eot_ids, a.vocab_size)
    assert [b.decode([i]) for i in range(0, a.vocab_size, 97)] == \
        [a.decode([i]) for i in range(0, a.vocab_size, 97)]


@pytest.fixture(scope="module")
def synth_model(tmp_path_factory) -> Path:
    return write_synth(tmp_path_factory.mktemp("tok") / "m.gguf", "tiny", "Q4_K_M", seed=3)


def test_entry_read_back_tokenizes_as_built(smollm_path, tmp_path):
    gf = GGUFFile(smollm_path)
    built = Tokenizer.from_metadata(gf.metadata)
    first = load_tokenizer(gf, tmp_path)  # builds and writes the entry
    entries = list(tmp_path.glob("*.json"))
    assert len(entries) == 1
    again = load_tokenizer(GGUFFile(smollm_path), tmp_path)  # from the entry
    _same(built, first)
    _same(built, again)


def test_changed_file_gets_its_own_entry(synth_model, tmp_path):
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(synth_model.read_bytes())
    folder = tmp_path / "cache"
    load_tokenizer(GGUFFile(copy), folder)
    key = cache_key(copy)
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert cache_key(copy) != key
    load_tokenizer(GGUFFile(copy), folder)
    assert {p.stem for p in folder.glob("*.json")} == {key, cache_key(copy)}


def test_damaged_entry_is_rebuilt_and_replaced(synth_model, tmp_path):
    gf = GGUFFile(synth_model)
    built = Tokenizer.from_metadata(gf.metadata)
    load_tokenizer(gf, tmp_path)
    entry = tmp_path / f"{cache_key(synth_model)}.json"
    good = entry.read_text()
    damages = ("{not json", '{"_backend": {"t": "tokenizer", "v": "{}"}}', good[:len(good) // 2])
    for damage in damages:
        entry.write_text(damage)
        _same(built, load_tokenizer(GGUFFile(synth_model), tmp_path))
        assert entry.read_text() == good


def test_unwritable_folder_still_builds(synth_model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the folder would be")
    gf = GGUFFile(synth_model)
    _same(Tokenizer.from_metadata(gf.metadata), load_tokenizer(gf, blocker / "tokenizers"))
    assert blocker.read_text() == "a file where the folder would be"


def test_a_cuda_load_reads_a_cached_tokenizer_beside_it_and_builds_a_new_one_first(
        synth_model, tmp_path, monkeypatch):
    """runtime.build.tokenizer_beside: on CUDA, a tokenizer already in the cache is read in a
    thread of its own beside the load; one not yet built is built before the load goes on (a
    file whose tokenizer cannot be built fails before its weights load), and so is every CPU
    load's."""
    import threading

    import torch

    from slipstream.errors import TokenizerError
    from slipstream.modelfile import tokenizer_cache
    from slipstream.runtime import build

    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    threads: list[str] = []
    real = tokenizer_cache.load_tokenizer

    def spy(gf, folder):
        threads.append(threading.current_thread().name)
        return real(gf, folder)

    monkeypatch.setattr(build, "load_tokenizer", spy)
    gf, cuda = GGUFFile(synth_model), torch.device("cuda")  # only its type is read
    first = build.tokenizer_beside(gf, cuda)
    assert first.done() and threads == [threading.current_thread().name]  # built here
    assert tokenizer_cache.is_cached(gf, tmp_path / "tokenizers")
    beside = build.tokenizer_beside(gf, cuda).result(timeout=60)
    assert threads[1].startswith("slipstream-tokenizer")
    _same(first.result(), beside)
    assert build.tokenizer_beside(gf, torch.device("cpu")).done()
    assert threads[2] == threading.current_thread().name
    bad = write_synth(tmp_path / "bad.gguf", "tiny", "Q8_0", seed=3)
    monkeypatch.setattr(Tokenizer, "from_metadata",
                        staticmethod(lambda md: (_ for _ in ()).throw(TokenizerError("no"))))
    with pytest.raises(TokenizerError):
        build.tokenizer_beside(GGUFFile(bad), cuda)
