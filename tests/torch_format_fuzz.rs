//! Random and mutated bytes fed to the torch.save readers: they return
//! errors, never panic, and stay fast (no absurd allocations).

use proptest::prelude::*;
use storage_sharing::content_store::dtype::Dtype;
use storage_sharing::content_store::meta::TensorMeta;
use storage_sharing::content_store::torch_format::{parse_tensor_file, storage_data_range, storage_file, tensor_file};

fn seed_files() -> Vec<Vec<u8>> {
    let m = TensorMeta { dtype: Dtype::Float32, storage_hash: "ab12".into(), offset: 3, shape: vec![2, 3], stride: vec![3, 1] };
    vec![tensor_file(&m), storage_file(&[7u8; 200])]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let _ = parse_tensor_file(&bytes);
        let _ = storage_data_range(&bytes);
    }

    #[test]
    fn mutated_files_never_panic(which in 0usize..2, edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8), cut in any::<usize>()) {
        let mut f = seed_files()[which].clone();
        for (at, b) in edits {
            let i = at % f.len();
            f[i] = b;
        }
        let keep = f.len() - cut % 4.min(f.len());
        f.truncate(keep);
        if let Ok(r) = storage_data_range(&f) {
            prop_assert!(r.end <= f.len());
        }
        let _ = parse_tensor_file(&f);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, ..ProptestConfig::default() })]

    /// The unpickler itself, on mutated real pickles (the zip's CRC would
    /// otherwise stop most mutations before the unpickler sees them).
    #[test]
    fn mutated_pickles_never_panic(edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6), cut in 0usize..16) {
        use storage_sharing::content_store::torch_format::unpickle::{unpickle, Allow};
        let m = TensorMeta { dtype: Dtype::Int64, storage_hash: "ff".into(), offset: 70000, shape: vec![1, 2, 3, 4], stride: vec![24, 12, 4, 1] };
        let file = tensor_file(&m);
        let start = file.windows(2).position(|w| w == [0x80, 0x02]).unwrap();
        let end = start + file[start..].iter().position(|b| *b == b'.').unwrap() + 1;
        let mut pkl = file[start..end].to_vec();
        for (at, b) in edits {
            let i = at % pkl.len();
            pkl[i] = b;
        }
        pkl.truncate(pkl.len().saturating_sub(cut));
        let _ = unpickle(&pkl, Allow::TensorEntry);
        let _ = unpickle(&pkl, Allow::StorageFile);
    }
}
