//! The signal kernels (`cuda_signals.ptx`): embedded PTX, its kernel names,
//! and the module a device loads them into.

use super::teardown;
use crate::cuda::driver::check;
use crate::error::Result;
use cudarc::driver::sys;
use std::ffi::c_void;

/// The signal kernels, NUL-terminated for `cuModuleLoadDataEx`.
pub const SIGNAL_PTX: &str = concat!(include_str!("../cuda_signals.ptx"), "\0");
/// Kernel names in the PTX, in `Op` order.
pub const KERNELS: [&str; 3] = ["ss_symm_put_signal", "ss_symm_wait_signal", "ss_symm_barrier"];

#[derive(Clone, Copy)]
pub(super) enum Op {
    Put = 0,
    Wait = 1,
    Barrier = 2,
}

/// The signal kernels loaded in a device's primary context.
pub(super) struct Module {
    pub(super) device: i32,
    pub(super) module: usize,
    pub(super) functions: [usize; 3],
    /// Each kernel's `CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK` on the device.
    pub(super) max_threads: [u32; 3],
}

impl Module {
    pub(super) fn load(device: i32) -> Result<Module> {
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // The JIT's error log, so a rejected kernel says why.
        let mut log = vec![0u8; 4096];
        let mut options = [sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER, sys::CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES];
        let mut values: [*mut c_void; 2] = [log.as_mut_ptr().cast(), log.len() as *mut c_void];
        // SAFETY: NUL-terminated PTX; two options whose values are the log
        // buffer and its size (passed by value in the pointer, as the API
        // wants); out-pointer ours.
        let r = unsafe { sys::cuModuleLoadDataEx(&mut module, SIGNAL_PTX.as_ptr().cast(), 2, options.as_mut_ptr(), values.as_mut_ptr()) };
        check(r, || {
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]).trim().to_string();
            format!(
                "cuModuleLoadDataEx of the signal kernels (PTX JIT) on device {device}{}",
                if text.is_empty() { String::new() } else { format!(" [JIT log: {text}]") }
            )
        })?;
        let mut m = Module { device, module: module as usize, functions: [0; 3], max_threads: [0; 3] };
        for (i, name) in KERNELS.iter().enumerate() {
            let c = std::ffi::CString::new(*name).expect("kernel names have no NUL");
            let mut f: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: live module, NUL-terminated name, out-pointer ours.
            check(unsafe { sys::cuModuleGetFunction(&mut f, module, c.as_ptr()) }, || format!("cuModuleGetFunction({name})"))?;
            m.functions[i] = f as usize;
            // Asking an attribute finishes loading the kernel now (under lazy
            // loading a handle may be only partly loaded, and a load at the
            // first launch may need the context idle, which it never is
            // while our own wait kernel spins for that launch's signal), and
            // gives the block size limit the barrier launch must respect.
            let mut most = 0;
            // SAFETY: live function, out-pointer ours.
            check(
                unsafe { sys::cuFuncGetAttribute(&mut most, sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, f) },
                || format!("cuFuncGetAttribute(MAX_THREADS_PER_BLOCK) of {name}"),
            )?;
            m.max_threads[i] = most.max(0) as u32;
        }
        Ok(m)
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        let module = self.module as sys::CUmodule;
        // SAFETY: our module; no launch of it is pending (synchronised first).
        teardown(self.device, || unsafe {
            sys::cuModuleUnload(module);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::symm::cuda_plan as plan;

    #[test]
    fn ptx_is_embedded_with_every_kernel_and_a_nul() {
        assert!(SIGNAL_PTX.ends_with('\0'));
        assert_eq!(SIGNAL_PTX.matches('\0').count(), 1);
        for k in KERNELS {
            assert!(SIGNAL_PTX.contains(&format!(".visible .entry {k}(")), "{k}");
        }
        // The three kernels take the eight parameters `launch` passes.
        assert_eq!(SIGNAL_PTX.matches(".param .u32 p_slot").count(), 3);
        assert_eq!(SIGNAL_PTX.matches(".param .u64 p_pads").count(), 3);
        // Each kernel writes the record as `parse_record` reads it: fields
        // at words 1-5, the elapsed u64 at byte 24, the state (2) last.
        for (field, count) in [("[%rd10+4]", 3), ("[%rd10+8]", 3), ("[%rd10+12], %r1", 3), ("[%rd10+16], %r4", 3), ("[%rd10+20], %r3", 3)] {
            assert_eq!(SIGNAL_PTX.matches(&format!("st.relaxed.sys.global.u32 {field}")).count(), count, "{field}");
        }
        assert_eq!(SIGNAL_PTX.matches("st.relaxed.sys.global.u64 [%rd10+24], %rd9;").count(), 3);
        assert_eq!(SIGNAL_PTX.matches(&format!("st.release.sys.global.u32 [%rd10], {};", plan::RECORD_WRITTEN)).count(), 3);
        assert_eq!(SIGNAL_PTX.matches(&format!("mul.wide.u32 %rd10, %r5, {};", plan::RECORD_BYTES)).count(), 3);
        // The op codes: put 1, wait 2, barrier 3.
        for op in 1..=3 {
            assert_eq!(SIGNAL_PTX.matches(&format!("st.relaxed.sys.global.u32 [%rd10+4], {op};")).count(), 1, "op {op}");
        }
    }
}
