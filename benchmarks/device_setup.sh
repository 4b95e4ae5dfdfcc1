# Sourced by the device scripts (device_run.sh, spec_device.sh) from the project root: install
# the carried wheels (.whl: gguf; .whl/kvikio), point PYTHONPATH at them and at src/, and
# reassemble the default model from the parts carried in two calls (.model/a/part1 and
# .model/b/part2, parked in /tmp/slipstream-cache) into $MODEL. Needs $OUTDIR.
# Exports SLIPSTREAM_MODELS, where the synthetic 70B and 8B files go: /dev/shm where it has room
# (a RAM disk: the ~45 GB are written at memory speed, with no writeback to disk running under
# the first measurements: on the disk, synthesis took about 5 of call 1's 7 minutes in session
# 13, and the first 70B decodes after it ran 10-20% under later ones), else /tmp.
if ls .whl/*.whl >/dev/null 2>&1; then
  # once per machine: a script started in the background while another imports from /tmp/site
  # must not reinstall under it
  if [ ! -f /tmp/site/.installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
    touch /tmp/site/.installed
  fi
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 COLUMNS=140
# Triton's compiled kernels: a fresh machine compiles every one (session 39: the kernel tests
# ran 242 and 270 s cold and still did not finish). A cache brought back by
# bench/triton_cache_out.sh and carried as .triton/ (bench/triton_cache_in.sh) is unpacked once
# per machine; the cache stays in /tmp while the machine is warm.
export TRITON_CACHE_DIR=/tmp/triton-cache
if ls .triton/triton.tgz.part-* >/dev/null 2>&1 && [ ! -f "$TRITON_CACHE_DIR/.unpacked" ]; then
  mkdir -p "$TRITON_CACHE_DIR"
  cat .triton/triton.tgz.part-* | tar xzf - -C "$TRITON_CACHE_DIR" \
    && touch "$TRITON_CACHE_DIR/.unpacked"
fi
if ls .whl/kvikio/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site-kvikio ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/site-kvikio .whl/kvikio/*.whl
fi
if [ -d /tmp/site-kvikio ]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/site-kvikio
  # libkvikio finds libcufile in site-packages; the wheel's copy sits in a --target folder, so
  # the loader is pointed at it only where the system has none, and only if torch still works
  if ! python3 -c "import kvikio" 2>/dev/null; then
    lib=/tmp/site-kvikio/nvidia/cu13/lib
    if LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} python3 -c \
        "import torch, kvikio; torch.zeros(1, device='cuda')" 2>/dev/null; then
      export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
  fi
  python3 -c "import kvikio; print('kvikio', kvikio.__version__)" 2>&1 | tail -1 \
    | tee "$OUTDIR/kvikio.txt"
fi
if [ -z "${SLIPSTREAM_MODELS:-}" ]; then
  if [ -d /dev/shm/slipstream-models ]; then SLIPSTREAM_MODELS=/dev/shm/slipstream-models
  elif [ -d /tmp/slipstream-models ]; then SLIPSTREAM_MODELS=/tmp/slipstream-models
  elif [ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1 | tr -d ' ')" -ge 50 ] 2>/dev/null
  then SLIPSTREAM_MODELS=/dev/shm/slipstream-models
  else SLIPSTREAM_MODELS=/tmp/slipstream-models
  fi
fi
export SLIPSTREAM_MODELS
export SLIPSTREAM_CACHE=/tmp/slipstream-cache SLIPSTREAM_OFFLINE=1
mkdir -p "$SLIPSTREAM_CACHE"
for part in .model/a/part1 .model/b/part2; do
  [ -f "$part" ] && cp "$part" "$SLIPSTREAM_CACHE/$(basename "$part")"
done
MODEL=$SLIPSTREAM_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$MODEL" ] && [ -f "$SLIPSTREAM_CACHE/part1" ] && [ -f "$SLIPSTREAM_CACHE/part2" ]; then
  cat "$SLIPSTREAM_CACHE/part1" "$SLIPSTREAM_CACHE/part2" > "$MODEL"
fi
# the host as this call found it (session 29's H100 host ran one plan at two speeds across loads:
# its NUMA layout and CPU were not recorded then)
if [ -n "${OUTDIR:-}" ] && [ ! -f "$OUTDIR/host.txt" ]; then
  { lscpu; echo; for n in /sys/devices/system/node/node*; do
      [ -d "$n" ] && echo "$(basename "$n"): cpus $(cat "$n/cpulist") $(grep MemTotal "$n/meminfo")"
    done; echo; nproc; free -g; } > "$OUTDIR/host.txt" 2>&1
fi
