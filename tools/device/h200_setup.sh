#!/usr/bin/env bash
# Installs MLX's CUDA backend and what unikern needs on the GPU machine (Python 3.12,
# PyTorch in the image, no network) from the wheel folders carried there
# (tools/device/pack_h200_bundle.sh built them; tools/device/README.md says how to send them):
#
#   bash tools/device/h200_setup.sh /tmp/w0 .whl/p1     # WHEEL_DIR...
#
# It reassembles the CUDA wheel from its parts (checking the SHA256), installs every wheel
# with pip --target into $H200_TMP/py, links the image's CUDA libraries where libmlx.so
# looks for them, lays out the `unikern` package as pyproject.toml maps it (a symlink farm
# in $H200_TMP/src: no pip install of the checkout), and caps MLX's memory in every
# process at MLX_MEMORY_LIMIT_GIB. Then:
#   export PYTHONPATH=$H200_TMP/py:$H200_TMP/src:$REPO
# (tools/device/h200_gpu.sh calls this and sets that itself).
set -uo pipefail
T=${H200_TMP:-/tmp}
PY=$T/py
SRC=$T/src
REPO=$(cd "$(dirname "$0")/../.." && pwd)
start=$SECONDS
mkdir -p "$T/whl" "$PY"
for dir in "$@"; do cp -r "$dir"/. "$T/whl/" 2>/dev/null || true; done
for parts in "$T"/whl/*.whl.parts; do
  [ -d "$parts" ] || continue
  name=$(basename "$parts" .parts)
  cat "$parts"/part.* > "$T/whl/$name"
  if [ "$(sha256sum "$T/whl/$name" | cut -d' ' -f1)" != "$(cat "$parts/SHA256")" ]; then
    echo "SHA256 MISMATCH for $name: send its parts again" >&2; exit 1
  fi
  echo "reassembled $name (sha256 ok)"
done
if ls "$T"/whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$PY" "$T"/whl/*.whl > "$T/pip.log" 2>&1 || { tail -5 "$T/pip.log" >&2; exit 1; }
fi
# libmlx.so looks for the CUDA libraries at $ORIGIN/../../nvidia/...: point that at the
# image's own nvidia-* wheels (PyTorch's)
nv=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null)
if [ -n "$nv" ] && [ ! -e "$PY/nvidia" ]; then ln -s "$nv" "$PY/nvidia"; fi
# the package map of pyproject.toml, as a symlink farm
rm -rf "$SRC"; mkdir -p "$SRC/unikern"
ln -s "$REPO"/kernel/* "$SRC/unikern/"
ln -s "$REPO/stages" "$SRC/unikern/stages"
ln -s "$REPO/pipelines" "$SRC/unikern/pipelines"
# cap MLX's memory in every process: set the limit as soon as mlx.core is imported,
# without importing it earlier (unikern must preload its BLAS before mlx loads)
cat > "$PY/sitecustomize.py" <<'EOF'
import importlib.machinery, importlib.util, os, sys

_limit = int(float(os.environ.get("MLX_MEMORY_LIMIT_GIB", "0")) * (1 << 30))


class _CapMLX:
    def find_spec(self, name, path=None, target=None):
        if name != "mlx.core" or not _limit:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        inner = spec.loader

        class Loader:
            def create_module(self, spec):
                return inner.create_module(spec)

            def exec_module(self, module):
                inner.exec_module(module)
                module.set_memory_limit(_limit)

        spec.loader = Loader()
        return spec


sys.meta_path.insert(0, _CapMLX())

# run the sitecustomize this one shadows, if any
_here = os.path.dirname(os.path.abspath(__file__))
for _d in sys.path:
    _f = os.path.join(_d or ".", "sitecustomize.py")
    if os.path.abspath(_d or ".") != _here and os.path.isfile(_f):
        _s = importlib.util.spec_from_file_location("_shadowed_sitecustomize", _f)
        _s.loader.exec_module(importlib.util.module_from_spec(_s))
        break
EOF
echo "setup done in $((SECONDS - start)) s"
