//! Per-layer format plans: the library's [`kvq::plan`] (choice, JSON, reading), and writing a
//! plan file all or nothing.

use std::path::Path;

pub use kvq::plan::{Candidate, Choice, Plan, check_budget, choose};

use crate::CliError;
use crate::files;

/// Write `plan` to `path` (all or nothing).
pub fn write(plan: &Plan, path: &Path) -> Result<(), CliError> {
    files::write_bytes_atomic(path, plan.to_json().as_bytes())
}
