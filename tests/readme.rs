//! The README's GPU snippets are the compiled example `examples/gpu_quickstart.rs`: the lines
//! between its `README:begin` / `README:end` markers (decode) and `README:prefill-begin` /
//! `README:prefill-end` (prefill), as the README shows them. Its CPU snippet is the doc test of
//! `src/lib.rs` ("A step on the CPU"), less the test's hidden lines.

/// The lines of the first rust block after `heading` in the README.
fn readme_block(heading: &str) -> Vec<String> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let section = &readme[readme.find(heading).expect("README section")..];
    let code = &section[section.find("```rust\n").expect("rust block") + 8..];
    code[..code.find("```").expect("block end")]
        .lines()
        .map(String::from)
        .collect()
}

/// The first rust block after `heading` in the README equals the example's lines between
/// `// {marker}-begin` (or `begin`) and `// {marker}-end`, unindented by one level.
fn check(heading: &str, begin_marker: &str, end_marker: &str) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let example =
        std::fs::read_to_string(root.join("examples/gpu_quickstart.rs")).expect("example");
    let begin_line = format!("// {begin_marker}\n");
    let begin = example.find(&begin_line).expect("begin marker") + begin_line.len();
    let end = example
        .find(&format!("    // {end_marker}"))
        .expect("end marker");
    let want: Vec<&str> = example[begin..end]
        .lines()
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect();
    let got = readme_block(heading);
    assert_eq!(
        got, want,
        "README's snippet under {heading:?} differs from examples/gpu_quickstart.rs (copy it over)"
    );
}

#[test]
fn readme_gpu_snippet_is_the_compiled_example() {
    check("## Using the GPU path", "README:begin", "README:end");
}

#[test]
fn readme_prefill_snippet_is_the_compiled_example() {
    check(
        "## Prefill, prefix hits and speculative verification",
        "README:prefill-begin",
        "README:prefill-end",
    );
}

#[test]
fn readme_cpu_snippet_is_the_library_doc_test() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).expect("src/lib.rs");
    let section = &lib[lib
        .find("//! ## A step on the CPU")
        .expect("lib.rs section")..];
    let code = &section[section.find("//! ```\n").expect("doc test") + 8..];
    let want: Vec<String> = code[..code.find("//! ```").expect("doc test end")]
        .lines()
        .map(|l| l.strip_prefix("//!").expect("a doc line"))
        .map(|l| l.strip_prefix(' ').unwrap_or(l))
        .filter(|l| !l.starts_with("# "))
        .map(String::from)
        .collect();
    assert_eq!(
        readme_block("### A step on the CPU"),
        want,
        "README's CPU snippet differs from src/lib.rs's doc test (copy it over)"
    );
}
