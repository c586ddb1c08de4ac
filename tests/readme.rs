//! The README's GPU snippet is the compiled example `examples/gpu_quickstart.rs`: the lines
//! between its `README:begin` / `README:end` markers, as the README shows them.

#[test]
fn readme_gpu_snippet_is_the_compiled_example() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let example =
        std::fs::read_to_string(root.join("examples/gpu_quickstart.rs")).expect("example");
    let begin = example.find("// README:begin\n").expect("begin marker") + 16;
    let end = example.find("    // README:end").expect("end marker");
    let want: Vec<&str> = example[begin..end]
        .lines()
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect();
    let section = &readme[readme.find("## Using the GPU path").expect("GPU section")..];
    let code = &section[section.find("```rust\n").expect("rust block") + 8..];
    let got: Vec<&str> = code[..code.find("```").expect("block end")]
        .lines()
        .collect();
    assert_eq!(
        got, want,
        "README's GPU snippet differs from examples/gpu_quickstart.rs (copy it over)"
    );
}
