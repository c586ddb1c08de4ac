#!/usr/bin/env bash
# Regenerate src/cuda/sys.rs, kvq's raw Rust bindings, from cuda/kvq.h: bindgen (through the
# generator in tools/gen-sys, which pins its version and options), then rustfmt. Run it after
# every change to kvq.h; tests/sys_bindings.rs fails while sys.rs is stale.
#
#   scripts/gen-sys.sh            rewrite src/cuda/sys.rs
#   scripts/gen-sys.sh --check    write nothing; exit 1 with a diff if sys.rs is stale
#   scripts/gen-sys.sh --libclang exit 0 if libclang can be found, else 3
#
# Needs cargo, rustfmt and libclang (the C API library, not libclang-cpp): on Debian / Ubuntu
# `apt-get install libclang-dev`, elsewhere LIBCLANG_PATH=<dir holding libclang.so>. Without
# it the script exits 3. The generator builds once into $CARGO_TARGET_DIR/gen-sys (or
# target/gen-sys), away from kvq's own build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

mode=write
case "${1:-}" in
    "") ;;
    --check) mode=check ;;
    --libclang) mode=libclang ;;
    *) echo "usage: scripts/gen-sys.sh [--check | --libclang]" >&2; exit 2 ;;
esac

# Where clang-sys (bindgen's loader) looks first: LIBCLANG_PATH, the linker cache, LLVM's dirs.
have_libclang() {
    [ -n "${LIBCLANG_PATH:-}" ] && return 0
    ldconfig -p 2>/dev/null | grep -Eq 'libclang(-[0-9.]+)?\.so' && return 0
    # libclang.so / libclang-17.so.1, not libclang-cpp (the C++ library bindgen cannot load).
    compgen -G '/usr/lib/llvm-*/lib/libclang.so*' >/dev/null ||
        compgen -G '/usr/lib/llvm-*/lib/libclang-[0-9]*.so*' >/dev/null
}
if ! have_libclang; then
    echo "gen-sys: libclang not found: apt-get install libclang-dev, or set LIBCLANG_PATH" >&2
    exit 3
fi
[ "$mode" = libclang ] && exit 0

target="${CARGO_TARGET_DIR:-$root/target}/gen-sys"
"${CARGO:-cargo}" build --quiet --locked --manifest-path tools/gen-sys/Cargo.toml \
    --target-dir "$target"
# Beside sys.rs, so rustfmt finds the same configuration as `cargo fmt`.
tmp=$(mktemp --suffix=.tmp src/cuda/.sys.rs.XXXXXX)
trap 'rm -f "$tmp"' EXIT
"$target/debug/kvq-gen-sys" cuda/kvq.h >"$tmp"
rustfmt --edition 2024 "$tmp"

if [ "$mode" = check ]; then
    if ! diff -u src/cuda/sys.rs "$tmp"; then
        echo "gen-sys: src/cuda/sys.rs is stale (cuda/kvq.h changed): run scripts/gen-sys.sh" >&2
        exit 1
    fi
else
    cp "$tmp" src/cuda/sys.rs
fi
