#!/usr/bin/env bash
# The lean-dependency claim (README): `cargo add kvq` pulls half, bytemuck and thiserror, plus
# cudarc with `cuda`, and nothing that belongs behind `bench`, `plot` or `cli`. Checked on the
# normal dependency tree (no dev- or build-dependencies: they never reach a user's build).
set -euo pipefail
cd "$(dirname "$0")/.."

# Crates that only the optional features may bring in.
feature_only='^(serde|serde_json|plotters|safetensors|clap|indicatif)$'

check() {
    local label=$1 expected=$2 extra_deny=$3
    shift 3
    local direct all
    direct=$(cargo tree -e normal --depth 1 --prefix none --format '{p}' "$@" |
        awk 'NR > 1 {print $1}' | sort -u | tr '\n' ' ')
    all=$(cargo tree -e normal --prefix none --format '{p}' "$@" | awk '{print $1}' | sort -u)
    printf '%s: direct %s\n%s: whole tree %s\n' "$label" "$direct" "$label" "$(echo $all)"
    if [ "$direct" != "$expected" ]; then
        echo "FAIL: $label direct dependencies are '$direct', expected '$expected'" >&2
        exit 1
    fi
    local deny="$feature_only"
    [ -n "$extra_deny" ] && deny="${deny%)\$}|$extra_deny)\$"
    if grep -Eq "$deny" <<<"$all"; then
        echo "FAIL: $label pulls $(grep -E "$deny" <<<"$all" | tr '\n' ' ')" >&2
        exit 1
    fi
}

check "default features" "bytemuck half thiserror " "rand"
# With `cuda`, rand is in the tree: cudarc's `f16` feature turns on half's `rand_distr`.
check "--features cuda" "bytemuck cudarc half thiserror " "" --features cuda
