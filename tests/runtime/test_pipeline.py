"""One model over two processes (runtime.pipeline): torchrun starts two gloo ranks on
the CPU, each loading only its own range of layers; greedy and seeded sampled output equal the
single-process run's, token for token, through the API and the CLI; a rank that dies gives
rank 0 a clear error rather than a hang."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import slipstream
from slipstream.errors import BadArgument
from slipstream.memory.devices import REMOTE, pad_stage_plan
from slipstream.memory.planner import Plan, StagePlan

PROMPT = "Write a haiku about the sea."
SRC = str(Path(slipstream.__file__).resolve().parents[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(args: list[str], timeout: float = 240, env: dict | None = None
              ) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "--master-addr", "127.0.0.1", "--master-port",
                           str(_free_port()), *args], capture_output=True, text=True,
                          timeout=timeout, env=full)


RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    import slipstream
    from slipstream.errors import PipelineBroken
    path, out, n, temp, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
    m = slipstream.load(path, device="cpu", ctx=512,
                        placement=slipstream.Placement(distributed=True))
    rank = dist.get_rank()
    info = {"held": [i for i, w in enumerate(m.engine.weights.layers) if w is not None],
            "embed": m.engine.weights.embed is not None,
            "head": m.engine.weights.output is not None,
            "remote": sum(t == "remote" for t in m.plan.tiers)}
    if rank == 0:
        import time
        t0 = time.perf_counter()
        try:
            info["ids"] = [e.id for e in m.generate(%r, max_tokens=n, temperature=temp,
                                                    seed=7)]
        except PipelineBroken as e:
            info["error"], info["error_s"] = str(e), time.perf_counter() - t0
        json.dump(info, open(f"{out}.0", "w"))
        m.close()
        if "error" in info:
            # a group whose peer vanished cannot be torn down: gloo may abort (SIGABRT) in
            # destroy_process_group or at the interpreter's exit, as the CLI avoids too
            os._exit(0)
    else:
        json.dump(info, open(f"{out}.{rank}", "w"))
        if mode == "die":
            os._exit(0)  # gone without a word: rank 0's next pass finds no peer
        if mode == "hang":
            import time
            time.sleep(25)  # alive but silent, past rank 0's timeout
            os._exit(0)
        m.serve()
        m.close()
    dist.destroy_process_group()
""" % PROMPT)


def _ranks(tmp_path: Path, model: Path, tokens: int, temp: float, mode: str = "serve",
           env: dict | None = None):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = tmp_path / "out"
    done = _torchrun([str(script), str(model), str(out), str(tokens), str(temp), mode],
                     env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]


def _single(model: Path, tokens: int, temp: float) -> list[int]:
    with slipstream.load(model, device="cpu", ctx=512) as m:
        return [e.id for e in m.generate(PROMPT, max_tokens=tokens, temperature=temp, seed=7)]


@pytest.mark.slow
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_two_gloo_ranks_give_the_single_process_tokens(smollm_path, tmp_path, temp):
    first, second = _ranks(tmp_path, smollm_path, 40, temp)
    assert first["ids"] == _single(smollm_path, 40, temp)
    # each rank built its own 15 of the 30 layers, the embedding on rank 0, the head on 1
    assert first["held"] == list(range(15)) and second["held"] == list(range(15, 30))
    assert first["remote"] == second["remote"] == 15
    assert (first["embed"], first["head"], second["embed"], second["head"]) == \
        (True, False, False, True)


@pytest.mark.slow
def test_the_cli_under_torchrun_prints_what_one_process_prints(smollm_path):
    args = ["-m", str(smollm_path), "-n", "24", "--temp", "0", "-p", PROMPT]
    env = {**os.environ, "PYTHONPATH": SRC}
    alone = subprocess.run([sys.executable, "-m", "slipstream", "run", *args],
                           capture_output=True, text=True, timeout=240, env=env)
    assert alone.returncode == 0, alone.stderr[-2000:]
    both = _torchrun(["-m", "slipstream", "run", "--distributed", *args])
    assert both.returncode == 0, both.stderr[-3000:]
    assert both.stdout == alone.stdout and alone.stdout.strip()


@pytest.mark.slow
def test_a_rank_that_dies_gives_rank_0_a_clear_error(smollm_path, tmp_path):
    t0 = time.perf_counter()
    first, _ = _ranks(tmp_path, smollm_path, 8, 0.0, mode="die")
    assert "rank 1" in first["error"] and "restart every rank" in first["error"]
    assert "ids" not in first
    assert time.perf_counter() - t0 < 200  # an error, not a hang until the test's timeout


@pytest.mark.slow
def test_a_silent_rank_gives_rank_0_an_error_after_the_timeout(smollm_path, tmp_path):
    first, _ = _ranks(tmp_path, smollm_path, 8, 0.0, mode="hang",
                      env={"SLIPSTREAM_DIST_TIMEOUT": "8"})
    assert "rank 1" in first["error"] and "stopped answering" in first["error"]
    assert "ids" not in first
    assert 7 < first["error_s"] < 20  # the 8 s timeout, not the peer's 25 s of silence


@pytest.mark.slow
def test_a_rank_whose_load_fails_stops_the_others_with_a_clear_error(smollm_path, tmp_path):
    """Rank 1 gets a RAM budget too small for its layers: it prints its own one-line error,
    and rank 0, waiting for the ranks' plans, gives one too (or torchrun stops it first)
    instead of waiting forever."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import os, sys
        from slipstream.cli import main
        budget = "1MiB" if os.environ["RANK"] == "1" else "4GiB"
        sys.exit(main(["run", "-m", sys.argv[1], "--distributed", "--ram-budget", budget,
                       "-n", "4", "-p", "hi"]))
    """))
    t0 = time.perf_counter()
    done = _torchrun([str(script), str(smollm_path)], env={"SLIPSTREAM_DIST_TIMEOUT": "10"})
    assert done.returncode != 0
    assert "budget cannot run this model" in done.stderr  # rank 1's own error
    # rank 0: its own line if it reaches the plans' gather first, else torchrun stops it
    assert "another rank did not" in done.stderr or "SIGTERM" in done.stderr
    assert "slipstream/" not in done.stderr  # one line each, no traceback through our code
    assert time.perf_counter() - t0 < 120


def test_distributed_outside_torchrun_says_how_to_start_it(smollm_path, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(BadArgument, match="torchrun --nproc-per-node 2"):
        slipstream.load(smollm_path, device="cpu",
                        placement=slipstream.Placement(distributed=True))


def test_distributed_refuses_the_self_drafts(smollm_path):
    for kw in (dict(draft=slipstream.SelfDraft(skip_layers=4)),
               dict(draft=slipstream.SelfDraft(lowbit="Q2_K"))):
        with pytest.raises(BadArgument, match="self-drafts do not combine"):
            slipstream.load(smollm_path, device="cpu", **kw,
                            placement=slipstream.Placement(distributed=True))


SPEC_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch.distributed as dist
    import slipstream
    path, draft, out = sys.argv[1], sys.argv[2], sys.argv[3]
    m = slipstream.load(path, device="cpu", ctx=512, precision="exact", draft=draft,
                        placement=slipstream.Placement(distributed=True))
    rank = dist.get_rank()
    if rank == 0:
        runs = {}
        for name, kw in (("spec", dict(spec_nodes=16, spec_depth=6)), ("plain", dict(draft=False)),
                         ("sampled", dict(spec_nodes=12, spec_depth=4, temperature=0.8, seed=3))):
            kw = {"temperature": 0, **kw}
            gen = m.generate(%r, max_tokens=40, **kw)
            runs[name] = [e.id for e in gen]
            runs[name + "_spec"] = gen.speculation
        json.dump(runs | {"has_draft": m.draft is not None}, open(out, "w"))
        m.close()
    else:
        assert m.draft is None
        m.serve()
        m.close()
    dist.destroy_process_group()
""" % PROMPT)


@pytest.mark.slow
def test_speculative_decoding_across_two_gloo_ranks(smollm_path, tmp_path):
    """A draft file on rank 0 grows the trees; each verify pass is a tree step sent to both
    ranks and the walk's compaction follows it: greedy output equals one process's plain
    greedy output (precision "exact"), and a seeded sampled run its plain sampled run."""
    from speculative.test_speculative import requantize

    draft = requantize(smollm_path, tmp_path / "draft-q4_0.gguf")
    script = tmp_path / "spec.py"
    script.write_text(SPEC_SCRIPT)
    out = tmp_path / "spec.json"
    done = _torchrun([str(script), str(smollm_path), str(draft), str(out)], timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())
    assert runs["has_draft"] and runs["plain_spec"] is None
    with slipstream.load(smollm_path, device="cpu", ctx=512, precision="exact") as alone:
        greedy = [e.id for e in alone.generate(PROMPT, max_tokens=40, temperature=0)]
        sampled = [e.id for e in alone.generate(PROMPT, max_tokens=40, temperature=0.8, seed=3)]
    assert runs["spec"] == runs["plain"] == greedy
    assert runs["sampled"] == sampled
    spec = runs["spec_spec"]
    assert spec["target_passes"] < 39 and spec["tokens_per_pass"] > 1, spec


def test_a_stage_plan_padded_to_layer_indices():
    plan = Plan("cpu", ["ram", "packed", "disk"], [10, 11, 12], [20, 21, 22], 5, None, 1)
    stage = StagePlan("cpu", range(2, 5), holds_embedding=False, holds_head=False)
    plan = pad_stage_plan(plan, stage, 7)
    assert plan.tiers == [REMOTE, REMOTE, "ram", "packed", "disk", REMOTE, REMOTE]
    assert plan.resident_bytes_per_layer == [0, 0, 10, 11, 12, 0, 0]
    assert plan.file_bytes_per_layer == [0, 0, 20, 21, 22, 0, 0]
    assert plan.disk_layers == [4] and plan.streamed_layers == [3, 4]
    assert plan.stages == [stage]
    with pytest.raises(ValueError, match="3 layers"):
        pad_stage_plan(Plan("cpu", ["ram"] * 3, [1] * 3, [1] * 3, 0, None, 1),
                       StagePlan("cpu", range(0, 2)), 4)


@pytest.mark.slow
def test_a_scaled_embedding_family_over_two_ranks_gives_the_single_process_tokens(tmp_path):
    """Gemma 3 multiplies its embeddings by sqrt(hidden): rank 0's pipeline applies it too
    (it once took the raw rows, and every token differed from one process's)."""
    from slipstream.synth import write_synth

    path = write_synth(tmp_path / "gemma3.gguf", "tiny", "Q8_0", n_layers=4, arch="gemma3",
                       from_floats=True, seed=3, std=0.15)
    first, _ = _ranks(tmp_path, path, 12, 0.0)
    assert first["ids"] == _single(path, 12, 0.0)
