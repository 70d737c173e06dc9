//! Coverage-guided: any bytes as a torch.save file of the content store:
//! the zip reader (entries in bounds, disjoint, uniquely named) and both
//! file readers (an accepted entry re-encodes to an equal one, an accepted
//! storage range lies inside the file).
#![no_main]
use libfuzzer_sys::fuzz_target;
use storage_sharing::content_store::torch_format::zip::read_entries;
use storage_sharing::content_store::torch_format::{parse_tensor_file, storage_data_range, tensor_file};

fuzz_target!(|data: &[u8]| {
    if let Ok(entries) = read_entries(data) {
        let mut spans: Vec<_> = entries.iter().map(|e| e.data.clone()).collect();
        spans.sort_by_key(|r| r.start);
        for w in spans.windows(2) {
            assert!(w[0].end <= w[1].start);
        }
        assert!(spans.iter().all(|r| r.end <= data.len()));
        let mut names: Vec<&str> = entries.iter().map(|e| e.name.as_str()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), entries.len());
    }
    if let Ok(m) = parse_tensor_file(data) {
        assert_eq!(parse_tensor_file(&tensor_file(&m)).unwrap(), m);
    }
    if let Ok(r) = storage_data_range(data) {
        assert!(r.start <= r.end && r.end <= data.len());
    }
});
