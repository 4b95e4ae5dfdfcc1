"""The model file of a running `slipstream serve` (CPU) is truncated, then overwritten: the
server keeps answering with the same output, since its weights live in private memory (with
the weights a view of the file's memory map, the process died by SIGBUS)."""

from __future__ import annotations

import shutil

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

import httpx  # noqa: E402
from server_process import ServerProcess  # noqa: E402

from slipstream.modelfile.gguf_file import GGUFFile  # noqa: E402

BODY = {"prompt": "The three most useful kitchen tools are", "max_tokens": 8, "temperature": 0}


@pytest.mark.slow
def test_server_survives_its_file_truncated_and_overwritten(smollm_path, tmp_path):
    path = tmp_path / smollm_path.name
    shutil.copy(smollm_path, path)
    gf = GGUFFile(path)
    data_start = gf.reader.data_offset
    gf.close()
    server = ServerProcess("-m", str(path), "--ctx", "256")
    try:
        server.wait_ready()

        def complete() -> str:
            r = httpx.post(server.url + "/v1/completions", json=BODY, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        before = complete()
        with open(path, "r+b") as f:
            f.truncate(data_start)  # every tensor's bytes gone
        assert complete() == before
        with open(path, "r+b") as f:  # and written again with other bytes
            f.seek(data_start)
            f.write(b"\xff" * (smollm_path.stat().st_size - data_start))
        assert complete() == before
        assert server.alive  # a SIGBUS would have ended it at the first request
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_streamed_server_reports_a_changed_file(tmp_path, precision):
    """A server whose layers stream from disk: after the file its decode reads is rewritten in
    place (the model file at "exact"; at "fast" the packed layer images written at load),
    requests fail with a 500 that names the file (code model_file_changed), not with other
    output; the process stays up."""
    from helpers import cpu_budget
    from slipstream.memory.image_file import image_paths
    from slipstream.synth import write_synth

    path = write_synth(tmp_path / "tiny.gguf", "tiny", "Q4_K", n_layers=6, from_floats=True,
                       std=0.08, seed=11)
    gf = GGUFFile(path)
    data_start = gf.reader.data_offset
    gf.close()
    budget = cpu_budget(path, precision=precision)  # every layer streamed
    changed, start = (path, data_start) if precision == "exact" else \
        (image_paths(path, "slipstream-cpu", layers=range(6))[0], 0)
    server = ServerProcess("-m", str(path), "--ctx", "64", "--ram-budget", str(budget),
                           "--precision", precision)
    body = {"prompt": [5, 77, 300, 12], "max_tokens": 4, "temperature": 0}
    try:
        server.wait_ready()
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        with open(changed, "r+b") as f:
            f.seek(start)
            data = f.read()
            f.seek(start)
            f.write(bytes(b ^ 0x5A for b in data))
        for _ in range(2):  # and the next request too
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 500, r.text
            err = r.json()["error"]
            assert err["code"] == "model_file_changed" and str(changed) in err["message"]
        assert server.alive
    finally:
        server.stop()
