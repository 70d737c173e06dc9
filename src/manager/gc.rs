//! Removing the segments whose creator is dead (or whose pid now belongs
//! to a newer process) and that no live process maps or holds open: what
//! `ssctl gc` does.

use super::segments::{scan, Segment};
use crate::error::{Error, ErrorKind, Result};
use crate::shm::flags::SHAREDMEM;
use crate::shm::map::unlink_name;
use std::ffi::CString;

/// What one gc pass did.
#[derive(Debug, Default)]
pub struct Report {
    pub removed: Vec<Segment>,
    pub kept: Vec<Segment>,
    pub failed: Vec<(Segment, Error)>,
}

/// Collects segments named with `prefix`; with `dry_run` only reports.
pub fn collect(prefix: &str, dry_run: bool) -> Report {
    let mut report = Report::default();
    for s in scan(prefix) {
        if !s.collectable() {
            report.kept.push(s);
            continue;
        }
        if dry_run {
            report.removed.push(s);
            continue;
        }
        match unlink(&s.name) {
            Ok(()) => report.removed.push(s),
            Err(e) => report.failed.push((s, e)),
        }
    }
    report
}

fn unlink(name: &str) -> Result<()> {
    let c = CString::new(name).map_err(|_| Error::new(ErrorKind::InvalidArgument, format!("segment name <{name}> contains NUL")))?;
    unlink_name(&c, name, SHAREDMEM)
}
