//! Growable C structs start with `struct_size`, the `sizeof` the caller
//! was built with, so a newer library can add fields at the end and still
//! read what an older caller passes.

use crate::error::{Error, ErrorKind, Result};

/// Checks the `struct_size` a caller gave for `name`: 0 (never
/// initialized) or less than the first version is refused as invalid; more
/// than this library knows means a newer header: unsupported. Sizes in
/// between are older versions whose missing tail fields take defaults.
pub fn check(name: &str, given: usize, first_version: usize, current: usize) -> Result<()> {
    if given == 0 {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("{name}.struct_size is 0: initialize it with {} or its _default function", init_macro(name)),
        ));
    }
    if given < first_version {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("{name}.struct_size is {given}, less than the smallest version ({first_version} bytes)"),
        ));
    }
    if given > current {
        return Err(Error::new(
            ErrorKind::Unsupported,
            format!("{name}.struct_size is {given}, more than this library knows ({current} bytes): the caller was built against a newer header"),
        ));
    }
    Ok(())
}

fn init_macro(name: &str) -> String {
    format!("{}_INIT", name.to_uppercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_zero_short_and_newer_sizes() {
        let zero = check("ss_arena_options", 0, 16, 24).unwrap_err();
        assert_eq!(zero.kind(), ErrorKind::InvalidArgument);
        assert!(zero.message().contains("SS_ARENA_OPTIONS_INIT"), "{}", zero.message());
        assert_eq!(check("ss_x", 8, 16, 24).unwrap_err().kind(), ErrorKind::InvalidArgument);
        assert_eq!(check("ss_x", 32, 16, 24).unwrap_err().kind(), ErrorKind::Unsupported);
        assert!(check("ss_x", 16, 16, 24).is_ok());
        assert!(check("ss_x", 24, 16, 24).is_ok());
    }
}
