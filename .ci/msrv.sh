#!/usr/bin/env bash
# rust-version (Cargo.toml) must be true for every feature: at least the highest rust-version
# declared by any crate of the resolved dependency tree (normal and build dependencies, this
# host, the locked versions), and at least 1.85 (edition 2024). Checked per feature set without
# building or the network, so that a dependency update that raises the floor fails here with the
# crate that raised it named (.ci/run then also type-checks the crate with that toolchain). `candle` is printed, not
# checked: its locked zip 9.8 wants 1.89, while an MSRV-aware resolver picks zip 9.5 (1.88).
# Usage: .ci/msrv.sh [FEATURES...]   (default: the default features, cuda, cli)
set -euo pipefail
cd "$(dirname "$0")/.."

host=$(rustc -vV | sed -n 's/^host: //p')
declared=$(cargo metadata --format-version 1 --no-deps | python3 -c '
import json, sys
print(next(p["rust_version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "kvq"))')

# The highest rust-version in the tree of `cargo metadata "$@"`, and the crates that set it.
floor() {
    # Offline when the registry cache has the tree (it has after the builds); else fetch.
    { cargo metadata --format-version 1 --offline --filter-platform "$host" "$@" 2>/dev/null ||
        cargo metadata --format-version 1 --filter-platform "$host" "$@"; } | python3 -c '
import json, sys
meta = json.load(sys.stdin)
pkgs = {p["id"]: p for p in meta["packages"]}
nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
root = meta["resolve"]["root"]
seen, todo = set(), [root]
while todo:
    i = todo.pop()
    if i not in seen:
        seen.add(i)
        # Dev-dependencies never reach a user build.
        todo += [d["pkg"] for d in nodes[i]["deps"]
                 if any(k["kind"] in (None, "build") for k in d["dep_kinds"])]
ver = lambda v: tuple(int(x) for x in (v.split(".") + ["0", "0"])[:3])
need = [(ver(pkgs[i]["rust_version"]), pkgs[i]["name"] + " " + pkgs[i]["version"])
        for i in seen if i != root and pkgs[i].get("rust_version")]
top = max([(ver("1.85"), "edition 2024")] + need)[0]
print(".".join(map(str, top)), " ".join(sorted(n for v, n in need if v == top)) or "edition 2024")
'
}

ver() { awk -F. '{printf "%d%04d%04d\n", $1, $2, $3}' <<<"$1"; }

status=0
check() {
    local label=$1 enforce=$2
    shift 2
    local need by
    read -r need by < <(floor "$@")
    printf 'msrv %-18s needs %-7s (%s); Cargo.toml says %s\n' "$label:" "$need" "$by" "$declared"
    if [ "$enforce" = 1 ] && [ "$(ver "$declared")" -lt "$(ver "$need")" ]; then
        echo "FAIL: rust-version $declared is below what $label needs ($need, $by)" >&2
        status=1
    fi
}

if [ $# -gt 0 ]; then
    for f in "$@"; do check "--features $f" 1 --features "$f"; done
else
    check "default features" 1
    check "--features cuda" 1 --features cuda
    check "--features cli" 1 --features cli
    check "--features candle" 0 --features candle
fi
exit $status
