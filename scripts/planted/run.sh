#!/usr/bin/env bash
# Plant one bug in a checkout, run the modules that should catch it, list the tests that fail,
# and take the bug out again (docs/testing.md, "Planted bugs").
#
#   scripts/planted/run.sh CHECKOUT BUG MODULE...
#   e.g. scripts/planted/run.sh . lease-not-renewed tests/test_output_dir.py tests/test_lease_gcs.py
set -u
here=$(cd "$(dirname "$0")" && pwd)
tree=$1; bug=$2; shift 2
cd "$tree"
git apply "$here/$bug.patch" || exit 2
out=$(mktemp -d)
timeout 1500 .venv/bin/python -m pytest -q -p no:cacheprovider -p no:xdist \
  --junitxml="$out/run.xml" "$@" > "$out/run.log" 2>&1
git apply -R "$here/$bug.patch"
python3 "$here/../test_durations.py" --failed "$out/run.xml"
echo "$bug: $(tail -1 "$out/run.log")"
