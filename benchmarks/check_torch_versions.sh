#!/usr/bin/env bash
# Run the test suite on each supported torch: the floor (pyproject's torch>=, the
# TORCH_FLOOR of src/ampkit/_torch_compat.py) and a recent release. One venv per version,
# made once and reused; one summary line per version; exit 1 if any version fails.
#
#   benchmarks/check_torch_versions.sh                 # torch 2.5.1 and 2.11.0
#   benchmarks/check_torch_versions.sh 2.5.1 2.13.0    # any versions
#
# Environment:
#   VENV_ROOT        where the venvs go (default /tmp): ampkit-torch-<version>
#   TORCH_INDEX_URL  a wheel index for torch, e.g. https://download.pytorch.org/whl/cpu for
#                    the CPU-only wheels (about 200 MB; PyPI's default builds carry CUDA
#                    libraries, about 5 GB per venv)
#   PYTEST_ARGS      extra pytest arguments (default none: the suite as `pytest` runs it)
set -uo pipefail

cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(2.5.1 2.11.0)
root=${VENV_ROOT:-/tmp}
index=()
[ -n "${TORCH_INDEX_URL:-}" ] && index=(--extra-index-url "$TORCH_INDEX_URL")
status=0
summaries=()

for version in "${versions[@]}"; do
    venv="$root/ampkit-torch-$version"
    log="$root/ampkit-torch-$version.log"
    python="$venv/bin/python"
    if ! "$python" -c "import torch, sys; sys.exit(not torch.__version__.startswith('$version'))" 2>/dev/null; then
        echo "torch $version: creating $venv (minutes; the log is $log)"
        { python3 -m venv "$venv" \
            && "$python" -m pip install -q "${index[@]}" "torch==$version" \
            && "$python" -m pip install -q "${index[@]}" -e ".[cli,test]" "torch==$version"; } >"$log" 2>&1
        if [ $? -ne 0 ]; then
            summaries+=("torch $version: INSTALL FAILED (see $log)")
            status=1
            continue
        fi
    fi
    # PYTHONPATH: this checkout's ampkit, whichever one a reused venv was installed from.
    # shellcheck disable=SC2086 # PYTEST_ARGS is a list of arguments
    PYTHONPATH="$PWD/src" "$python" -m pytest -p no:cacheprovider --junitxml="$root/ampkit-torch-$version.xml" \
        ${PYTEST_ARGS:-} >>"$log" 2>&1
    rc=$?
    line=$("$python" - "$root/ampkit-torch-$version.xml" 2>/dev/null <<'EOF'
import sys
import xml.etree.ElementTree as ET

suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
count = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
failed = count["failures"] + count["errors"]
passed = count["tests"] - failed - count["skipped"]
names = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
         if c.find("failure") is not None or c.find("error") is not None]
print(f"{passed} passed, {failed} failed, {count['skipped']} skipped/xfailed in "
      f"{float(suite.get('time', 0)):.0f}s" + (f"; failed: {', '.join(names[:5])}" if names else ""))
EOF
) || line="no test report (pytest stopped before running tests)"
    actual=$("$python" -c "import torch; print(torch.__version__)")
    if [ $rc -eq 0 ]; then
        summaries+=("torch $actual: OK, $line")
    else
        summaries+=("torch $actual: FAILED (pytest exit $rc), $line (log: $log)")
        status=1
    fi
done

printf '%s\n' "${summaries[@]}"
exit $status
