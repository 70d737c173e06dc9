//! Coverage-guided: any bytes as the TCPStore server's request stream.
//! The scanner (which frames requests as bytes arrive) and the parser must
//! agree, and every accepted request re-encodes to exactly its bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use storage_sharing::store::tcp::protocol::{parse_request, RequestScanner};

fuzz_target!(|data: &[u8]| {
    let mut at = 0;
    while at < data.len() {
        let rest = &data[at..];
        // Feed the scanner in two pieces, as two reads would.
        let mut s = RequestScanner::new();
        let first = s.scan(&rest[..rest.len() / 2]);
        let scanned = match first {
            Ok(Some(n)) => Ok(Some(n)),
            Ok(None) => s.scan(rest),
            Err(e) => Err(e),
        };
        match parse_request(rest) {
            Ok(Some((req, n))) => {
                assert_eq!(req.to_bytes(), &rest[..n]);
                assert_eq!(scanned.unwrap(), Some(n));
                at += n;
            }
            Ok(None) => {
                assert_eq!(scanned.unwrap(), None);
                return;
            }
            Err(_) => {
                assert!(scanned.is_err());
                return;
            }
        }
    }
});
