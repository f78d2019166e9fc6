#!/usr/bin/env bash
# The README's test command: set up (cached, idempotent), then run every test.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
source scripts/env.sh
exec python -m pytest -q -p no:cacheprovider --durations=20 tests "$@"
