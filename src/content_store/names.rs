//! Which tensor names a store accepts: relative paths under `tensors/`
//! whose parts are plain file names.

use crate::error::{Error, ErrorKind, Result};

/// Prefix of the temporary files writers rename into place; no stored
/// name may start with it, and listings skip it.
pub const TEMP_PREFIX: &str = ".ss-tmp-";

/// Longest accepted tensor name, in bytes (PATH_MAX less room for the root).
pub const MAX_NAME_LEN: usize = 3072;

/// Splits a tensor name into its folder parts and file name, refusing
/// anything that could leave `tensors/` or clash with a temporary file:
/// empty names or parts, `.` and `..`, a leading `/`, NUL bytes, parts
/// over 255 bytes, names over [`MAX_NAME_LEN`].
pub fn tensor_name_parts(name: &str) -> Result<Vec<&str>> {
    let bad = |why: &str| Error::new(ErrorKind::InvalidArgument, format!("tensor name {name:?} {why}"));
    if name.is_empty() {
        return Err(bad("is empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(Error::new(ErrorKind::NameTooLong, format!("tensor name of {} bytes is longer than {MAX_NAME_LEN}", name.len())));
    }
    if name.contains('\0') {
        return Err(bad("contains a NUL byte"));
    }
    if name.starts_with('/') {
        return Err(bad("is an absolute path"));
    }
    let parts: Vec<&str> = name.split('/').collect();
    for part in &parts {
        match *part {
            "" => return Err(bad("has an empty part (`//` or a trailing `/`)")),
            "." | ".." => return Err(bad("has a `.` or `..` part")),
            p if p.starts_with(TEMP_PREFIX) => {
                return Err(bad(&format!("has a part starting with {TEMP_PREFIX:?}, kept for temporary files")))
            }
            p if p.len() > 255 => {
                return Err(Error::new(ErrorKind::NameTooLong, format!("tensor name {name:?} has a part longer than 255 bytes")))
            }
            _ => {}
        }
    }
    Ok(parts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_and_nested_names() {
        assert_eq!(tensor_name_parts("x").unwrap(), ["x"]);
        assert_eq!(tensor_name_parts("layer.0/weight").unwrap(), ["layer.0", "weight"]);
        assert_eq!(tensor_name_parts("..a/b..").unwrap(), ["..a", "b.."]);
    }

    #[test]
    fn refuses_escapes_and_odd_parts() {
        for (name, why) in [
            ("", "empty"),
            ("/etc/passwd", "absolute"),
            ("a/../../b", "`..`"),
            ("..", "`..`"),
            ("./a", "`.`"),
            ("a//b", "empty part"),
            ("a/", "empty part"),
            ("a\0b", "NUL"),
            (".ss-tmp-1-2", "temporary"),
        ] {
            let e = tensor_name_parts(name).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{name:?}");
            assert!(e.message().contains(why), "{name:?}: {}", e.message());
        }
        assert_eq!(tensor_name_parts(&"a".repeat(256)).unwrap_err().kind(), ErrorKind::NameTooLong);
        assert_eq!(tensor_name_parts(&"a/".repeat(2000)).unwrap_err().kind(), ErrorKind::NameTooLong);
    }
}
