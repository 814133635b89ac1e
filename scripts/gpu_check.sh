#!/usr/bin/env bash
# The one command for a GPU machine: scripts/gpu_check.sh OUTDIR [--dry-run] [--sections a,b] [--box-scale F]
# Time-boxed sections (gpu tests, the registry's tests on CUDA, the GPU-sized bench), at most 8 files in OUTDIR, a
# summary printed last; nothing installed over the machine's torch. See scripts/gpu_check.py for the details.
set -u
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-}"
if [ -z "$python" ]; then
  # The machine's own Python with torch (never a torch installed by this script); the project's venv as a fallback.
  for candidate in python3 python "$here/../.venv/bin/python"; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c "import torch" >/dev/null 2>&1; then
      python="$candidate"
      break
    fi
  done
fi
if [ -z "$python" ]; then
  echo "gpu_check: no Python with torch found (set PYTHON=/path/to/python)" >&2
  exit 2
fi
exec "$python" "$here/gpu_check.py" "$@"
