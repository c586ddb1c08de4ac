//! `src/cuda/sys.rs` is generated from `cuda/kvq.h` by `scripts/gen-sys.sh` and checked in.
//! This test regenerates it and fails when the checked-in file differs: kvq.h changed and the
//! bindings were not regenerated, or sys.rs was edited by hand.
//!
//! Generating needs libclang (Debian / Ubuntu: `apt-get install libclang-dev`). Without it the
//! test prints `SKIPPED` and passes, so `cargo test` still needs nothing but cargo; with
//! `KVQ_REQUIRE_LIBCLANG=1` (CI) a missing libclang fails instead. The first run builds the
//! generator (tools/gen-sys, bindgen) once, which takes a minute or two.

use std::process::Command;

#[test]
fn sys_rs_is_generated_from_kvq_h() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let required = std::env::var("KVQ_REQUIRE_LIBCLANG").is_ok_and(|v| v == "1");
    // A published package has no tools/ (cargo leaves nested packages out).
    if !root.join("tools/gen-sys/Cargo.toml").is_file() && !required {
        eprintln!("SKIPPED sys_rs_is_generated_from_kvq_h: no tools/gen-sys in this source tree");
        return;
    }
    let out = Command::new("bash")
        .args(["scripts/gen-sys.sh", "--check"])
        .current_dir(root)
        .output()
        .expect("running bash scripts/gen-sys.sh --check");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    match out.status.code() {
        Some(0) => {}
        // The script's code for "libclang not found".
        Some(3) if !required => eprintln!("SKIPPED sys_rs_is_generated_from_kvq_h: {text}"),
        _ => panic!(
            "scripts/gen-sys.sh --check failed ({}):\n{text}",
            out.status
        ),
    }
}
