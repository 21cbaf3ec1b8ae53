#!/usr/bin/env bash
# Stages a branch (or any commit) for a GPU round beside the working tree: its files and its
# built extension under .devcarry/NAME/ (ignored by git), so one device call can run main and a
# branch A/B without touching the editable install here. Builds in a throwaway worktree.
#   bash scripts/dev/stage_branch.sh perf/combine-inflight inflight
#   then, in the device call (carry [".devcarry/inflight", ...]):
#   (cd .devcarry/inflight && JAX_EP_COMMIT=<hash> bash scripts/gpu_round.sh peer8 bench)
set -euo pipefail
cd "$(dirname "$0")/../.."
rev=${1:?usage: stage_branch.sh REV NAME}
name=${2:?usage: stage_branch.sh REV NAME}
dest=.devcarry/$name
work=$(mktemp -d)
trap 'git worktree remove --force "$work/tree" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add -q --detach "$work/tree" "$rev"
(cd "$work/tree" && JAX_EP_ENABLE_CUDA=ON python -m pip wheel -q --no-build-isolation --no-deps \
  -w "$work/wheel" .)
rm -rf "$dest" && mkdir -p "$dest"
git archive "$rev" | tar -x -C "$dest"
git rev-parse --short "$rev" > "$dest/.jax_ep_commit"  # read by ab_bench.sh
python - "$work/wheel" "$dest/jax_ep" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z:
  # The extension, and the NVSHMEM module where the wheel was present at build time.
  for so in [n for n in z.namelist() if n.startswith("jax_ep/_jax_ep_") and n.endswith(".so")]:
    open(sys.argv[2] + "/" + so.split("/")[-1], "wb").write(z.read(so))
PY
echo "$dest: $(git rev-parse --short "$rev"), $(du -sh "$dest" | cut -f1)"
