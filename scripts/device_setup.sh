# Source this on the GPU machine (device tool): installs the package over the image's JAX,
# carried wheels (.whl/), reassembles the SmolLM2 GGUF from parts carried in earlier calls, and
# gathers token shards carried under .data/ or .data0/, .data1/, ... (xz-compressed .npy.xz: unpacked)
# into /root/data.
# Usage in a device call:  source scripts/device_setup.sh
set -e
[ -f .commit ] && export SPARDA_COMMIT=$(cat .commit)  # written by `git rev-parse HEAD > .commit` before the call
# not preallocated, but allowed 90% of the GPU (the default 75% is 104 of 139 GiB): a 128K x 4
# prefill's temporaries are one allocation of ~57 GiB (bench/results/prefill.json's first run)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_MEM_FRACTION=0.90
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install --no-deps --no-build-isolation -e .
if ls .whl*/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p /root/model
for p in .model*/smol.part*; do if [ -f "$p" ]; then cp "$p" /root/model/; fi; done
for d in .data*/; do  # a corpus's manifest.json and shards, in .data/ or .data0/, .data1/, ... over several calls
  if [ -d "$d" ]; then
    mkdir -p /root/data && cp -r "$d." /root/data/
    find /root/data -name '*.xz' -exec xz -d -f -T0 {} +
  fi
done
# the GGUF travels as parts (.model*/smol.part00, 01, ...: one folder per call) with its sha256
# (smol.sha256): joined once all are there
for p in .model*/smol.sha256; do if [ -f "$p" ]; then cp "$p" /root/model/; fi; done
if [ -f /root/model/smol.sha256 ] && [ ! -f /root/model/smollm2.gguf ]; then
  cat /root/model/smol.part* > /root/model/joined.gguf
  if [ "$(sha256sum < /root/model/joined.gguf | cut -c1-64)" = "$(cut -c1-64 /root/model/smol.sha256)" ]; then
    mv /root/model/joined.gguf /root/model/smollm2.gguf
  else
    rm -f /root/model/joined.gguf; echo "device_setup: SmolLM2 GGUF incomplete ($(ls /root/model | tr '\n' ' '))"
  fi
fi
if [ -f /root/model/smollm2.gguf ]; then export SPARDA_SMOLLM2_GGUF=/root/model/smollm2.gguf; fi
set +e
