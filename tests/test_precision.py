"""Precision: made once from a name and a device, with the fields the old dtype pair meant."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.errors import BadArgument
from slipstream.precision import Precision

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU


def test_bad_name():
    with pytest.raises(BadArgument, match=r"precision='bogus' is invalid: use 'fast' or 'exact'"):
        Precision.of("bogus", CPU)


@pytest.mark.parametrize("name,device,weight,kv,int8", [
    # (weight dtype, KV dtype) as api.dtypes_for gave them
    ("fast", CPU, torch.float16, torch.float32, False),
    ("exact", CPU, torch.float32, torch.float32, False),
    ("fast", CUDA, torch.float16, torch.float16, True),
    ("exact", CUDA, torch.float32, torch.float16, False),
])
def test_fields(name, device, weight, kv, int8):
    p = Precision.of(name, device)
    assert (p.name, p.weight_dtype, p.kv_dtype, p.act_dtype) == (name, weight, kv, torch.float32)
    assert p.int8_activations is int8 and p.fuse_scales is int8  # both: CUDA fast only
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.name = "exact"


def test_load_rejects_a_bad_name(tmp_path):
    import slipstream
    from slipstream.synth import write_synth

    path = write_synth(tmp_path / "m.gguf", "tiny", "Q8_0", n_layers=1)
    with pytest.raises(BadArgument, match="precision='fp8' is invalid"):
        slipstream.load(path, device="cpu", precision="fp8")


def test_exact_keeps_an_unscaled_attentions_cache_in_float32_on_cuda():
    """Gemma 4's attention is unscaled: "exact" on CUDA keeps its KV cache in float32 (a
    float16 cache alone moved a tiny Gemma 4's CPU logits by 5.8e-2), "fast" keeps float16;
    a scaled attention's cache stays float16 on CUDA at both."""
    import torch

    from slipstream.precision import Precision

    cuda = torch.device("cuda")  # a device name only: nothing here touches CUDA
    assert Precision.of("exact", cuda, unscaled_attention=True).kv_dtype == torch.float32
    assert Precision.of("fast", cuda, unscaled_attention=True).kv_dtype == torch.float16
    assert Precision.of("exact", cuda).kv_dtype == torch.float16
    assert Precision.of("exact", torch.device("cpu")).kv_dtype == torch.float32


@pytest.mark.slow
def test_a_float16_cache_is_what_moves_an_unscaled_attentions_logits(tmp_path):
    """The reason for the rule above, on the CPU: the same tiny Gemma 4 with its KV cache in
    float16 moves its logits by more than 1e-2 somewhere, where Gemma 3's (scaled) stays
    under 2e-3."""
    import torch

    import slipstream
    from slipstream.synth import write_synth

    def moved(arch: str) -> float:
        path = write_synth(tmp_path / f"{arch}.gguf", "tiny", "Q4_K_M", n_layers=6, arch=arch,
                           from_floats=True, std=0.08, seed=4)
        ids = list(range(3, 40))
        outs = []
        for kv in (torch.float32, torch.float16):
            with slipstream.load(path, device="cpu", ctx=64, precision="exact") as m:
                for st in m.engine.stages:  # the same cache, rounded through float16
                    st.kv = type(st.kv)(m.engine.cfg, st.kv.max_ctx, st.device, kv,
                                        len(st.layers), st.layers.start)
                outs.append(m.logits(ids).float())
        return float(((outs[1] - outs[0]).norm(dim=-1) / outs[0].norm(dim=-1)).max())

    assert moved("gemma4") > 1e-2
    assert moved("gemma3") < 2e-3
