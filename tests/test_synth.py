"""slipstream synth's files as other GGUF readers see them."""

from __future__ import annotations

from collections import Counter

import gguf
import pytest

from slipstream.synth import QUANT_MIXES, SHAPES, write_synth


@pytest.mark.parametrize("mix", sorted(QUANT_MIXES))
def test_file_type_names_the_layers_format_in_llamacpps_enum(tmp_path, mix):
    """general.file_type is llama.cpp's LlamaFileType (it labels the model by it), not the
    GGML type id of the tensors: Q4_K's id read as a file type is "Q3_K - Medium"."""
    reader = gguf.GGUFReader(write_synth(tmp_path / f"{mix}.gguf", "tiny", mix))
    field = reader.fields["general.file_type"]
    file_type = gguf.LlamaFileType(int(field.parts[field.data[0]][0]))
    matrices = Counter(gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors
                       if t.name.startswith("blk.") and len(t.shape) == 2)
    most_common = matrices.most_common(1)[0][0]
    assert file_type.name.startswith(f"MOSTLY_{most_common}"), (file_type, matrices)


def test_a_skewed_router_scales_its_rows_by_rank():
    """skewed_router: expert rows scaled by rank^-s in a random order of the experts, the
    scales' mean 1; s = 0 leaves the router as it was."""
    import numpy as np

    from slipstream.synth import skewed_router

    router = np.random.default_rng(0).standard_normal((16, 64)).astype(np.float32)
    out = skewed_router(router, 1.0, np.random.default_rng(1))
    scale = np.linalg.norm(out, axis=1) / np.linalg.norm(router, axis=1)
    ranks = np.argsort(np.argsort(-scale)) + 1  # the longest row has rank 1
    np.testing.assert_allclose(scale, ranks ** -1.0 / np.mean(ranks ** -1.0), rtol=1e-5)
    assert sorted(ranks) == list(range(1, 17))
    np.testing.assert_array_equal(skewed_router(router, 0.0, np.random.default_rng(1)), router)


def test_expert_skew_is_refused_without_experts(tmp_path):
    from slipstream.errors import BadArgument

    with pytest.raises(BadArgument, match="no experts"):
        write_synth(tmp_path / "l.gguf", "tiny", "Q8_0", arch="llama", expert_skew=1.0)
    with pytest.raises(BadArgument, match=">= 0"):
        write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", arch="qwen3moe", expert_skew=-1.0)


@pytest.mark.slow
def test_expert_skew_makes_long_rowed_experts_popular(tmp_path):
    """With --expert-skew the experts whose router rows are longest are chosen most, layer
    after layer (rank correlation of row length and use well above the unskewed file's)."""
    import torch

    import slipstream
    from slipstream.model import moe

    def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
        ra, rb = (t.argsort().argsort().double() for t in (a, b))
        ra, rb = ra - ra.mean(), rb - rb.mean()
        return float((ra * rb).sum() / (ra.norm() * rb.norm()))

    gen = torch.Generator().manual_seed(0)
    ids = [int(t) for t in torch.randint(5, 1000, (300,), generator=gen)]
    corr = {}
    for skew in (0.0, 1.0):
        path = write_synth(tmp_path / f"m{skew}.gguf", "tiny", "Q8_0", n_layers=6,
                           arch="qwen3moe", seed=1, expert_skew=skew)
        seen, real = [], moe.route

        def record(h, router, *args, **kwargs):
            weights, chosen = real(h, router, *args, **kwargs)
            seen.append((router.norm(dim=1), chosen))
            return weights, chosen

        moe.route = record
        try:
            with slipstream.load(path, device="cpu", ctx=512, precision="exact") as m:
                m.logits(ids)
        finally:
            moe.route = real
        corr[skew] = [spearman(norms, torch.bincount(c.reshape(-1), minlength=len(norms)))
                      for norms, c in seen]
    mean = {k: sum(v) / len(v) for k, v in corr.items()}
    assert mean[1.0] > 0.4 and mean[1.0] > mean[0.0] + 0.3, corr


def test_cli_offers_every_mix(tmp_path):
    """`slipstream synth --quant` lists its choices without importing synth (a fast --help):
    they must be QUANT_MIXES' names, and a grid i-quant one writes its file."""
    from slipstream.cli import build_parser, main

    synth = next(a for a in build_parser()._actions if a.dest == "command").choices["synth"]
    quant = next(a for a in synth._actions if a.dest == "quant")
    assert sorted(quant.choices) == sorted(QUANT_MIXES)
    shape = next(a for a in synth._actions if a.dest == "shape")
    assert sorted(shape.choices) == sorted(SHAPES)
    out = tmp_path / "iq3s.gguf"
    assert main(["synth", "--shape", "tiny", "--quant", "IQ3_S", "--layers", "1",
                 "-o", str(out)]) == 0
    types = {gguf.GGMLQuantizationType(t.tensor_type).name
             for t in gguf.GGUFReader(out).tensors if t.name == "blk.0.ffn_down.weight"}
    assert types == {"IQ3_S"}
