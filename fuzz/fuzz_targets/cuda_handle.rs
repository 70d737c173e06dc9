//! Coverage-guided: the CUDA IPC handle text form and memory-handle bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use storage_sharing::cuda::handle::{decode_mem_handle, encode_mem_handle, IpcHandle};

fuzz_target!(|data: &[u8]| {
    if let Ok(raw) = decode_mem_handle(data) {
        assert_eq!(decode_mem_handle(&encode_mem_handle(&raw)).unwrap(), raw);
    }
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(h) = IpcHandle::from_text(text) {
        assert_eq!(IpcHandle::from_text(&h.to_text()).unwrap(), h);
        let fields: Vec<&str> = text.split_whitespace().collect();
        let out = h.to_text();
        let outs: Vec<&str> = out.split(' ').collect();
        for i in [1, 6] {
            assert_eq!(fields[i].to_ascii_lowercase(), outs[i]);
        }
    }
});
