#!/usr/bin/env bash
# Stamp the current commit into .h3gate-revision (git-ignored) so evidence written on a host without .git
# (the offline GPU host gets a plain copy of the tree) still records the revision it ran.
set -euo pipefail
cd "$(dirname "$0")/.."
git rev-parse HEAD > .h3gate-revision
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then echo "warning: tracked files are modified" >&2; fi
cat .h3gate-revision
