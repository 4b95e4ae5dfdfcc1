"""Native CPU ops, compiled once per machine with the system's C compiler and called through
ctypes: decode_ops.c, decode_layer.c, decode_moe_layer.c, q4_matvec.c, q6_matvec.c, cb4_matvec.c, iq_matvec.c and
moe_ffn.c (a token's routed experts) for decode (and hybrid decode's CPU share), moe_rows.c for
a prefill's routed experts, int4_pack.c for load-time packing (int4pack, q4vnni and q8vnni;
q6vnni's and cb4's packers are in their kernels' files), dequant.c for the dense weights a CPU
prefill multiplies.

Why C: a CPU decode token of a small model spends as long in ~25 tiny torch calls a layer as in
its matmuls, each call a few microseconds of dispatch around a few hundred floats of work.
torch has no fused op for a norm into bfloat16, a one-token
attention with RoPE and the cache write, or SwiGLU into bfloat16, and a ctypes call costs what
one small torch call does. The matmuls stay torch's packed kernels.

Why compiled here rather than shipped: `-march=native` vectorizes for the CPU that runs it, and
the build needs nothing but `cc` (no torch headers: about half a second). The library is cached
under ~/.cache/slipstream/native (SLIPSTREAM_NATIVE_DIR overrides), keyed by the source, the
compiler and the CPU's flags. Without a compiler, or with SLIPSTREAM_NATIVE=0, `library()` is
None and decode takes the torch ops (model.cpu_decode), which compute the same math.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from importlib import resources
from pathlib import Path

from .. import envs

# compiled together into one library
SOURCES = ("decode_ops.c", "q4_matvec.c", "q6_matvec.c", "cb4_matvec.c", "iq_matvec.c",
           "moe_ffn.c", "moe_rows.c", "int4_pack.c", "decode_layer.c", "decode_moe_layer.c",
           "dequant.c")
# what they include: written beside them, and part of the cache key
HEADERS = ("bf16.h", "half.h", "parallel.h", "moe_expert.h")
# -ffp-contract=off: no fused multiply-adds, so that every product is rounded as torch rounds
# it (RoPE as torch's complex multiply) and the bits do not depend on whether the CPU has FMA.
FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fno-math-errno", "-ffp-contract=off")
ARCH_FLAGS = ("-march=native",)  # dropped when the compiler does not know it
# q4_matvec.c splits rows over threads with OpenMP. The library links libgomp.so.1, which in a
# process that has imported torch resolves to torch's own bundled copy (same SONAME, already
# loaded), so the matmuls share torch's thread pool rather than starting a second one. Dropped
# (one thread) where the compiler has no OpenMP.
OPENMP_FLAGS = ("-fopenmp",)
# Build-time settings for experiments (q4_matvec.c's prefetch distances): whitespace-separated
# -DNAME or -DNAME=VALUE, part of the cache key. Benchmarks only: the defaults are measured.
DEFINES_ENV = "SLIPSTREAM_NATIVE_DEFINES"
_DEFINE = re.compile(r"-D[A-Z][A-Z0-9_]*(=[A-Za-z0-9_]+)?")

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # decode_ops.c's functions: argument types (all return void)
    "ss_rms_norm_bf16": (_P, _P, _I64, _F, _P),
    "ss_rms_norm_rows_f32": (_P, _P, _I64, _I64, _F, _P),
    "ss_add_rms_norm_bf16": (_P, _P, _P, _I64, _F, _P, _P),
    "ss_silu_mul_bf16": (_P, _I64, _P),
    "ss_decode_attention": (_P, _INT, _P, _P, _I64, _INT, _I64, _P, _P, _I64, _I64, _I64, _I64,
                            _F, _P, _P),
    # q4_matvec.c
    "ss_q16_quantize_row": (_P, _I64, _P, _P, _P, _P),
    "ss_q4_matvec": (_P, _P, _P, _I64, _I64),
    "ss_q4_ffn": (_P, _P, _P, _P, _P, _P, _I64, _I64),
    "ss_silu_mul_f32": (_P, _I64, _I64, _P),
    "ss_gelu_mul_f32": (_P, _I64, _I64, _P),
    # decode_ops.c: (gate_up, bias or NULL, m, n, act, out)
    "ss_glu_f32": (_P, _P, _I64, _I64, _I64, _P),
    # (gate_up, down, x, gu, act, out, m, flags, arrived, seq, done, threads, timeout_s,
    # waited_s): returns 0, or -1 on a timeout
    "ss_q4_ffn_on_signal": (_P, _P, _P, _P, _P, _P, _I64, _I64, _P, _I64, _P, _I64,
                            ctypes.c_double, _P),
    "ss_omp_touch": (_INT,),
    # q6_matvec.c: (weight, x, y, m, flags); (raw, row_bytes, rows, cols, row0, packed, threads)
    "ss_q6_matvec": (_P, _P, _P, _I64, _I64),
    "ss_q6vnni_rows": (_P, _I64, _I64, _I64, _I64, _P, _INT),
    # cb4_matvec.c: (weight, x, y, m, flags); (raw, row_bytes, fmt, rows, cols, row0, packed,
    # threads)
    "ss_cb4_matvec": (_P, _P, _P, _I64, _I64),
    "ss_cb4_rows": (_P, _I64, _INT, _I64, _I64, _I64, _P, _INT),
    # iq_matvec.c: (weight, x, y, m, flags)
    "ss_iq_matvec": (_P, _P, _P, _I64, _I64),
    # moe_ffn.c: (experts, k, x, w, out, threads, act): returns 0, or -1 (no scratch)
    "ss_moe_ffn": (_P, _I64, _P, _P, _P, _I64, _I64),
    # moe_rows.c: (experts, n_experts, T, k, threads): bytes, or -1 (shapes); (experts,
    # n_experts, x, T, ids, w, k, out, workspace, threads, act): 0, -1 (shapes) or -2 - i
    # (ids[i])
    "ss_moe_rows_workspace": (_P, _I64, _I64, _I64, _I64),
    "ss_moe_rows": (_P, _I64, _P, _I64, _P, _P, _I64, _P, _P, _I64, _I64),
    # decode_layer.c: (layer, scratch, x, x_out, ang, ang_sin, pos, k_cache, v_cache, max_ctx,
    # threads)
    "ss_decode_layer": (_P, _P, _P, _P, _P, _P, _I64, _P, _P, _I64, _I64),
    # decode_moe_layer.c: (layer, x, x_out, ang, ang_sin, pos, k_cache, v_cache, max_ctx,
    # threads, mid, hf, ids, w): 1 (x_out written), 0 (routed only) or -1 (no scratch)
    "ss_decode_moe_layer": (_P, _P, _P, _P, _P, _I64, _P, _P, _I64, _I64, _P, _P, _P, _P),
    # int4_pack.c
    "ss_int4pack_rows": (_P, _I64, _INT, _I64, _I64, _I64, _I64, _I64, _P, _P, _INT),
    "ss_q4vnni_rows": (_P, _I64, _INT, _I64, _I64, _I64, _P, _I64, _P, _P, _INT),
    "ss_q8vnni_rows": (_P, _I64, _I64, _I64, _I64, _P, _INT),
    # dequant.c: (raw, fmt, blocks, out, out_f16, threads)
    "ss_dequant_blocks": (_P, _INT, _I64, _P, _INT, _INT),
}
INT_RESULTS = ("ss_q4_ffn_on_signal", "ss_moe_ffn", "ss_moe_rows", "ss_decode_moe_layer")  # returning an int
I64_RESULTS = ("ss_moe_rows_workspace",)  # of SIGNATURES, those returning an int64
# functions that return something (and take nothing)
RETURNS = {"ss_q4_has_vnni": _INT, "ss_q4_has_simd": _INT, "ss_q6_has_vnni": _INT,
           "ss_cb4_loops": _INT, "ss_iq_loops": _INT}


def enabled() -> bool:
    """SLIPSTREAM_NATIVE: 0 turns the library off (read at each call, so tests may set it)."""
    return envs.get("SLIPSTREAM_NATIVE")


_BUILD_LOCK = threading.Lock()  # one build per process, however many threads ask at once


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled decode ops, built at the first call on this machine; None where they
    cannot be (no C compiler, a failed build) or are turned off (SLIPSTREAM_NATIVE=0)."""
    with _BUILD_LOCK:
        return _load()


def required(what: str) -> ctypes.CDLL:
    """library(), for a layout that cannot run without it: RuntimeError naming `what` where
    this process has none."""
    lib = library()
    if lib is None:
        raise RuntimeError(f"{what} needs the native library (slipstream.native), which this "
                           f"process does not have (no C compiler, or SLIPSTREAM_NATIVE=0)")
    return lib


def build_in_background() -> None:
    """Have `library()` ready by the first decode token: api.load starts it beside the load
    (a first build takes about 2 s on 2 busy cores; afterwards a cached library loads in ms)."""
    if enabled():
        threading.Thread(target=library, name="slipstream-native-build", daemon=True).start()


def _load() -> ctypes.CDLL | None:
    if not enabled():
        return None
    try:
        path = _built()
    except (OSError, subprocess.SubprocessError):
        return None
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes = list(args)
        fn.restype = _INT if name in INT_RESULTS else _I64 if name in I64_RESULTS else None
    for name, ret in RETURNS.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [], ret
    return lib


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    return cc if cc and shutil.which(cc) else shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    env = envs.get("SLIPSTREAM_NATIVE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "slipstream" / "native"


def _built() -> Path | None:
    """The shared library for this source, compiler and CPU: cached, or compiled now."""
    cc = _compiler()
    if cc is None:
        return None
    sources = {name: resources.files(__package__).joinpath(name).read_bytes()
               for name in SOURCES + HEADERS}
    version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    defines = _defines()
    flags = " ".join(FLAGS + ARCH_FLAGS + OPENMP_FLAGS + defines).encode()
    key = hashlib.sha256(b"\0".join([*sources.values(), version.encode(), flags,
                                     platform.machine().encode(), _cpu_flags().encode(),
                                     sys.platform.encode()])).hexdigest()[:16]
    for root in (_cache_dir(), Path(tempfile.gettempdir()) / "slipstream-native"):
        path = root / f"decode_ops-{key}.so"
        if path.exists():
            return path
        try:
            root.mkdir(parents=True, exist_ok=True)
            return _compile(cc, sources, path, defines)
        except OSError:
            continue  # not writable: the next place
    return None


def _defines() -> tuple[str, ...]:
    """SLIPSTREAM_NATIVE_DEFINES' -D settings; anything else in it is refused."""
    value = envs.get(DEFINES_ENV)
    words = tuple(value.split())
    bad = [w for w in words if not _DEFINE.fullmatch(w)]
    if bad:
        raise ValueError(f"{DEFINES_ENV}={value!r}: {bad[0]!r} is not "
                         f"-DNAME or -DNAME=VALUE (letters, digits, underscores)")
    return words


def _compile(cc: str, sources: dict[str, bytes], path: Path,
             defines: tuple[str, ...] = ()) -> Path | None:
    """Compile into a temporary name and rename it into place, so that processes building at
    once never load a half-written library. Tries without OpenMP, then without -march=native,
    where the compiler refuses them."""
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        srcs = []
        for name, text in sources.items():
            (Path(tmp) / name).write_bytes(text)
            if name in SOURCES:
                srcs.append(Path(tmp) / name)
        out = Path(tmp) / path.name
        for arch, omp in ((ARCH_FLAGS, OPENMP_FLAGS), (ARCH_FLAGS, ()), ((), OPENMP_FLAGS),
                          ((), ())):
            r = subprocess.run([cc, *FLAGS, *defines, *arch, *omp, *map(str, srcs), "-o",
                                str(out), "-lm"], capture_output=True, text=True, timeout=120)
            if r.returncode == 0:
                os.replace(out, path)
                return path
    return None
