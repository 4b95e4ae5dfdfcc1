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
