//! File names for the keys of a [`super::file::FileStore`]: any key (with
//! `/`, `..`, spaces, any bytes, UTF-8 or not) becomes one safe name inside the folder,
//! so no key can reach outside it or collide with the store's own files.

/// Longest name we produce; file systems allow 255 bytes.
const MAX_NAME: usize = 200;
/// How much of a long key's encoding stays readable before its hash.
const LONG_PREFIX: usize = 64;

/// The file name holding `key`.
///
/// Bytes outside `[A-Za-z0-9._-]` become `%XX`; the name starts with `k.`
/// (so it is never `.`, `..` or one of the store's dot files). An encoding
/// longer than 200 bytes becomes `h.` + its first 64 bytes + `.` + a
/// 128-bit hash of the whole key, unique for all practical purposes.
pub fn file_name(key: &[u8]) -> String {
    let mut enc = String::with_capacity(key.len() + 2);
    for &b in key {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            enc.push(b as char);
        } else {
            enc.push_str(&format!("%{b:02X}"));
        }
    }
    if enc.len() + 2 <= MAX_NAME {
        return format!("k.{enc}");
    }
    // Cut at a byte that does not split a %XX escape (all ASCII here).
    let mut cut = LONG_PREFIX;
    while enc.as_bytes()[cut - 1] == b'%' || enc.as_bytes()[cut - 2] == b'%' {
        cut -= 1;
    }
    format!("h.{}.{:016x}{:016x}", &enc[..cut], fnv1a(key, 0xcbf2_9ce4_8422_2325), fnv1a(key, 0x6c62_272e_07bb_0142))
}

/// Whether a folder entry is a key's file (not a temporary or the lock).
pub fn is_key_file(name: &std::ffi::OsStr) -> bool {
    let b = name.as_encoded_bytes();
    b.starts_with(b"k.") || b.starts_with(b"h.")
}

/// FNV-1a over the key's bytes from `basis`: stable across builds and
/// machines (unlike std's hasher), so every process finds the same file.
fn fnv1a(key: &[u8], basis: u64) -> u64 {
    key.iter().fold(basis, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0000_0100_0000_01b3))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn safe(name: &str) -> bool {
        !name.contains('/') && name != "." && name != ".." && !name.starts_with('.') && name.len() <= 255
    }

    #[test]
    fn plain_and_escaped() {
        assert_eq!(file_name(b"rank_0"), "k.rank_0");
        assert_eq!(file_name(b"symm/3/1"), "k.symm%2F3%2F1");
        assert_eq!(file_name(b""), "k.");
        assert_eq!(file_name(b".."), "k...");
        assert_eq!(file_name(b"../../etc/passwd"), "k...%2F..%2Fetc%2Fpasswd");
        assert_eq!(file_name(b"a b%"), "k.a%20b%25");
        assert_eq!(file_name("é".as_bytes()), "k.%C3%A9");
        assert_eq!(file_name(b"\xff\x00"), "k.%FF%00");
    }

    #[test]
    fn distinct_keys_distinct_names() {
        let keys: [&[u8]; 9] = [b"a/b", b"a%2Fb", b"a_b", b"a.b", b"A/b", b"a//b", b"", b"\xff", b"%FF"];
        let names: std::collections::HashSet<_> = keys.iter().map(|k| file_name(k)).collect();
        assert_eq!(names.len(), keys.len());
        for k in keys {
            assert!(safe(&file_name(k)), "{k:?}");
        }
    }

    #[test]
    fn long_keys_hash_and_stay_short() {
        let a = "x/".repeat(300);
        let b = format!("{}y", &a[..a.len() - 1]);
        let (na, nb) = (file_name(a.as_bytes()), file_name(b.as_bytes()));
        assert!(na.starts_with("h.x%2Fx"), "{na}");
        assert_ne!(na, nb);
        assert!(safe(&na) && na.len() < MAX_NAME, "{na}");
        assert_eq!(na, file_name(a.as_bytes()));
        let exact = "z".repeat(MAX_NAME - 2);
        assert_eq!(file_name(exact.as_bytes()), format!("k.{exact}"));
        assert!(file_name(format!("{exact}z").as_bytes()).starts_with("h."));
    }
}
