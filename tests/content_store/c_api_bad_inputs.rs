//! The content store's C API on inputs that must give a fitting status
//! and a message naming what was wrong.

use std::ffi::{CStr, CString};
use std::path::PathBuf;
use storage_sharing::ffi::content_store::*;
use storage_sharing::ffi::errors::ss_last_error_message;
use storage_sharing::ffi::status::ss_status;

fn last_message() -> String {
    // SAFETY: the library's thread-local message, valid until the next call.
    unsafe { CStr::from_ptr(ss_last_error_message()) }.to_string_lossy().into_owned()
}

fn temp(tag: &str) -> PathBuf {
    let p = std::env::temp_dir().join(format!("ss-cs-ffi-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    let _ = std::fs::remove_file(&p);
    p
}

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

#[test]
fn reading_a_folder_of_tensors_as_a_tensor_is_not_found() {
    let root = temp("folder");
    let path = c(root.to_str().unwrap());
    let mut w = std::ptr::null_mut();
    let data = [0u8; 16];
    let (shape, stride) = ([4i64], [1i64]);
    // SAFETY: valid pointers and live handles throughout.
    unsafe {
        assert_eq!(ss_content_writer_open(path.as_ptr(), SS_CONTENT_FORMAT_NATIVE, &mut w), ss_status::SS_OK);
        let name = c("p/q");
        let st = ss_content_writer_write_tensor(
            w,
            name.as_ptr(),
            data.as_ptr().cast(),
            data.len(),
            SS_DTYPE_FLOAT32,
            0,
            1,
            shape.as_ptr(),
            stride.as_ptr(),
        );
        assert_eq!(st, ss_status::SS_OK);
        ss_content_writer_free(w);
        let mut r = std::ptr::null_mut();
        assert_eq!(ss_content_reader_open(path.as_ptr(), &mut r), ss_status::SS_OK);
        let mut t = std::ptr::null_mut();
        for (name, why) in [("p", "folder"), ("p/q/r", "p/q")] {
            let n = c(name);
            let st = ss_content_reader_read_tensor(r, n.as_ptr(), &mut t);
            let msg = last_message();
            assert_eq!(st, ss_status::SS_ERR_NOT_FOUND, "{name}: {msg}");
            assert!(msg.contains(&format!("{name:?}")) && msg.contains(why), "{name}: {msg}");
        }
        let n = c("p/q");
        assert_eq!(ss_content_reader_read_tensor(r, n.as_ptr(), &mut t), ss_status::SS_OK);
        ss_content_tensor_free(t);
        ss_content_reader_free(r);
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn opening_a_writer_on_a_file_says_it_is_not_a_folder() {
    let file = temp("file");
    std::fs::write(&file, b"x").unwrap();
    let path = c(file.to_str().unwrap());
    let mut w = std::ptr::null_mut();
    // SAFETY: valid pointers.
    let st = unsafe { ss_content_writer_open(path.as_ptr(), SS_CONTENT_FORMAT_TORCH, &mut w) };
    let msg = last_message();
    assert_eq!(st, ss_status::SS_ERR_INVALID_ARGUMENT, "{msg}");
    assert!(msg.contains(file.to_str().unwrap()) && msg.contains("not a folder"), "{msg}");
    assert!(w.is_null());
    let _ = std::fs::remove_file(&file);
}

#[test]
fn write_storage_with_a_short_buffer_writes_nothing() {
    let root = temp("short-buf");
    let path = c(root.to_str().unwrap());
    let data = [7u8; 100];
    let mut buf = [0 as std::os::raw::c_char; SS_HASH_HEX_MAX];
    // SAFETY: valid pointers and a live handle throughout.
    unsafe {
        let mut w = std::ptr::null_mut();
        assert_eq!(ss_content_writer_open(path.as_ptr(), SS_CONTENT_FORMAT_NATIVE, &mut w), ss_status::SS_OK);
        let st = ss_content_writer_write_storage(w, data.as_ptr().cast(), data.len(), buf.as_mut_ptr(), 10);
        assert_eq!(st, ss_status::SS_ERR_BUFFER_TOO_SMALL, "{}", last_message());
        assert!(last_message().contains("33 bytes"), "{}", last_message());
        let mut written = u64::MAX;
        ss_content_writer_counts(w, &mut written, std::ptr::null_mut(), std::ptr::null_mut());
        assert_eq!(written, 0, "a refused call wrote the storage");
        assert_eq!(std::fs::read_dir(root.join("storages")).unwrap().count(), 0);
        assert_eq!(ss_content_writer_write_storage(w, data.as_ptr().cast(), data.len(), buf.as_mut_ptr(), buf.len()), ss_status::SS_OK);
        let hash = CStr::from_ptr(buf.as_ptr()).to_str().unwrap().to_string();
        assert!(root.join("storages").join(&hash).exists());
        ss_content_writer_free(w);
    }
    let _ = std::fs::remove_dir_all(&root);
}
