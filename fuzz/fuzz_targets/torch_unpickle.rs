//! Coverage-guided: any bytes as a pickle for the restricted unpickler, in
//! both modes (tensor entry, storage file). A tensor entry never yields a
//! storage reference anywhere inside it (shared items are visited once:
//! memo sharing can make a value's tree exponentially bigger than it).
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::collections::HashSet;
use storage_sharing::content_store::torch_format::unpickle::{unpickle, Allow, Value};

fn has_storage(v: &Value, seen: &mut HashSet<usize>) -> bool {
    match v {
        Value::Storage(_) => true,
        Value::Tuple(t) => seen.insert(std::rc::Rc::as_ptr(t) as usize) && t.items.iter().any(|i| has_storage(i, seen)),
        Value::Dict(d) => d.pairs.iter().any(|(k, v)| has_storage(k, seen) || has_storage(v, seen)),
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(v) = unpickle(data, Allow::TensorEntry) {
        assert!(!has_storage(&v, &mut HashSet::new()));
    }
    let _ = unpickle(data, Allow::StorageFile);
});
