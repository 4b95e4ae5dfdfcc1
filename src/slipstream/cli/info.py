"""`slipstream info`: describe a GGUF model from its metadata (and, with --plan, the tier plan
its budgets give), without loading it."""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..hub.pull import pull
from ..model.families import FAMILIES, family_for  # pure data: no torch
from .loading import plan
from .options import add_model_args


def add_parser(command: Callable[[str, str], argparse.ArgumentParser]) -> None:
    i = command("info", "describe a GGUF model")
    add_model_args(i)
    i.add_argument("--plan", action="store_true", help="also show the tier plan for the budgets")
    i.add_argument("--families", action="store_true",
                   help="list the model families slipstream runs, and exit")
    i.set_defaults(func=run)


def families_table() -> Table:
    t = Table(title="model families")
    t.add_column("family", style="bold")
    t.add_column("general.architecture")
    t.add_column("what sets it apart")
    for f in FAMILIES:
        t.add_row(f.name, ", ".join(sorted(f.architectures)), f.quirks)
    return t


def run(a: argparse.Namespace) -> int:
    # numpy and gguf: about 0.2 s that the other commands' --help need not pay
    from ..modelfile.config import ModelConfig
    from ..modelfile.gguf_file import GGUFFile

    if a.families:
        Console().print(families_table())
        return 0
    path = Path(a.model) if a.model else pull(quiet=True)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_metadata(gf.metadata, set(gf.tensors), source=path.name)
    out = Console()
    t = Table(title=f"{path.name}", show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    rows = [("name", cfg.name), ("architecture", cfg.architecture),
            ("family", f"{family_for(cfg.architecture).name}: "
                       f"{family_for(cfg.architecture).quirks}"),
            ("file size", f"{gf.file_size:,} bytes ({gf.file_size / 2**20:.1f} MiB)"),
            ("layers", cfg.n_layers), ("hidden", cfg.hidden), ("ffn", cfg.ffn),
            ("heads (q / kv)", f"{cfg.n_heads} / {cfg.n_kv_heads}"),
            ("head dim", cfg.head_dim), ("vocab", cfg.vocab_size),
            ("context length", cfg.context_length),
            ("rope", f"{cfg.rope_style}, base {cfg.rope_base:g}, dim {cfg.rope_dim}"
                     + (", llama3 rope_freqs" if "rope_freqs.weight" in gf.tensors else "")),
            # model.layer_spec's head lookup; importing model/ would import torch, which
            # `info` has no use for
            ("tied embeddings", "output.weight" not in gf.tensors),
            ("tokenizer", f"{gf.metadata.get('tokenizer.ggml.model')} "
                          f"(pre: {gf.metadata.get('tokenizer.ggml.pre', '-')})"),
            ("chat template", "yes" if gf.metadata.get("tokenizer.chat_template") else "no")]
    if cfg.n_experts:
        extra = (f", {cfg.n_shared_experts} shared" if cfg.n_shared_experts else "") + (
            f"; the first {cfg.dense_lead} layer(s) dense" if cfg.dense_lead else "") + (
            f"; {cfg.nextn_layers} MTP layer(s) skipped" if cfg.nextn_layers else "")
        rows.insert(rows.index(("ffn", cfg.ffn)) + 1,
                    ("experts", f"{cfg.n_experts}, {cfg.n_experts_used} per token, "
                                f"{cfg.expert_ffn} wide{extra}"))
    if cfg.mla:  # the cache's head is the latent's; the heads' own widths beside it
        rows.insert(rows.index(("head dim", cfg.head_dim)) + 1,
                    ("latent attention", f"q latent {cfg.q_lora_rank or '-'}, kv latent "
                                         f"{cfg.kv_lora_rank}; heads {cfg.mla_k_head} key / "
                                         f"{cfg.mla_v_head} value; cached {cfg.head_dim} a "
                                         f"token a layer"))
    n_params = sum(ti.n_elements for ti in gf.tensors.values())
    rows.append(("parameters", f"{n_params:,}"))
    for k, v in rows:
        t.add_row(k, str(v))
    out.print(t)
    types = Counter(ti.ggml_type.name for ti in gf.tensors.values())
    nbytes = Counter()
    for ti in gf.tensors.values():
        nbytes[ti.ggml_type.name] += ti.n_bytes
    tt = Table(title="tensor types")
    tt.add_column("type")
    tt.add_column("tensors", justify="right")
    tt.add_column("bytes", justify="right")
    for name, n in types.most_common():
        tt.add_row(name, str(n), f"{nbytes[name]:,}")
    out.print(tt)
    if a.plan:
        out.print(plan(path, a).table())
    return 0
