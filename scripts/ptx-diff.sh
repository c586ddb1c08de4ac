#!/usr/bin/env bash
# Compare the PTX of every cuda/*.cu file in the working tree against a git revision, for the
# default build's targets (80, 90a) and those a build may add (89, 90). A pure refactor of the
# device code must leave the PTX byte-identical (only comment lines are ignored).
#
#   scripts/ptx-diff.sh [REV] [ARCH...]     REV defaults to HEAD; ARCH like 80 89 90a 90
#
# WORK_REV=<rev> compares that revision instead of the working tree (e.g. each commit of a
# series against its parent).
# Environment: FILES (the .cu files to compare, e.g. "append.cu"; default all), NVCC (default
# nvcc on PATH), JOBS (parallel nvcc runs, default nproc),
# KVQ_PTX_DIR (cache of generated PTX, default /tmp/kvq-ptx; a revision's PTX is kept by its
# commit id and reused). Exit status 0 iff every file/arch is identical.
#
# Both trees are compiled from the same directory ($KVQ_PTX_DIR/tree): nvcc names anonymous
# namespaces after the source's path, so kernels in one would differ in name otherwise.
set -euo pipefail

root=$(git rev-parse --show-toplevel)
cd "$root"
rev=${1:-HEAD}
shift || true
archs=("$@")
[ ${#archs[@]} -gt 0 ] || archs=(80 89 90a 90)
sha=$(git rev-parse --verify "$rev^{commit}")
nvcc=${NVCC:-nvcc}
jobs=${JOBS:-$(nproc)}
cache=${KVQ_PTX_DIR:-/tmp/kvq-ptx}

# Per-file flags: keep in step with FILE_FLAGS in build.rs.
file_flags() {
    case "$1" in
    append.cu) echo "-fmad=false" ;;
    esac
}

# gen OUT_DIR: PTX of every .cu under $tree/cuda for every arch, in parallel.
gen() {
    local src=$tree out=$1
    mkdir -p "$out"
    local cmds=()
    for cu in "$src"/cuda/*.cu; do
        local f
        f=$(basename "$cu")
        [ -z "${FILES:-}" ] || [[ " $FILES " == *" $f "* ]] || continue
        for a in "${archs[@]}"; do
            [ -s "$out/$f.$a.ptx" ] && continue
            cmds+=("cd '$src' && '$nvcc' -ptx -std=c++17 -O3 -Icuda $(file_flags "$f") \
-arch=compute_$a cuda/$f -o '$out/$f.$a.ptx.tmp' && mv '$out/$f.$a.ptx.tmp' '$out/$f.$a.ptx'")
        done
    done
    [ ${#cmds[@]} -eq 0 ] && return 0
    printf '%s\0' "${cmds[@]}" | xargs -0 -P "$jobs" -n 1 bash -c
}

ref=$cache/$sha
work=$cache/work
tree=$cache/tree
echo "ptx-diff: reference $sha, ${WORK_REV:-working tree} ($root), archs ${archs[*]}" >&2
rm -rf "$tree" "$work"
mkdir -p "$tree" "$work"
git archive "$sha" cuda | tar -x -C "$tree"
gen "$ref/ptx" || echo "ptx-diff: the reference did not compile in full" >&2
rm -rf "$tree"
mkdir -p "$tree"
if [ -n "${WORK_REV:-}" ]; then
    git archive "$(git rev-parse --verify "$WORK_REV^{commit}")" cuda | tar -x -C "$tree"
else
    cp -r "$root/cuda" "$tree/"
fi
gen "$work/ptx" || echo "ptx-diff: the working tree did not compile in full" >&2

strip() { grep -v '^[[:space:]]*//' "$1"; }
status=0
for ptx in "$ref"/ptx/*.ptx; do
    name=$(basename "$ptx")
    [ -z "${FILES:-}" ] || [[ " $FILES " == *" ${name%%.cu.*}.cu "* ]] || continue
    arch=${name%.ptx}
    arch=${arch##*.}
    [[ " ${archs[*]} " == *" $arch "* ]] || continue
    if [ ! -f "$work/ptx/$name" ]; then
        echo "MISSING  $name"
        status=1
    elif cmp -s <(strip "$ptx") <(strip "$work/ptx/$name"); then
        echo "same     $name"
    else
        n=$(diff <(strip "$ptx") <(strip "$work/ptx/$name") | grep -c '^[<>]' || true)
        echo "DIFFERS  $name ($n lines; diff $ptx $work/ptx/$name)"
        status=1
    fi
done
for ptx in "$work"/ptx/*.ptx; do
    [ -e "$ptx" ] || continue
    [ -f "$ref/ptx/$(basename "$ptx")" ] || { echo "EXTRA    $(basename "$ptx")"; status=1; }
done
exit $status
