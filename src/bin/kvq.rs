//! The `kvq` command-line tool (feature `cli`).
fn main() {}
