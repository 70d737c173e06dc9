package storagesharing

// A file of its own: cgo allows only declarations in the preamble of a
// file with //export.

/*
#include <stdint.h>
*/
import "C"

import (
	"runtime/cgo"
	"unsafe"
)

// ssGoCudaDeleter is the ss_cuda_deleter given to ss_cuda_share: ctx is the
// cgo.Handle of the Go deleter, called once and then released.
//
//export ssGoCudaDeleter
func ssGoCudaDeleter(ctx unsafe.Pointer, devicePtr unsafe.Pointer) {
	h := cgo.Handle(uintptr(ctx))
	f := h.Value().(func(DevicePtr))
	h.Delete()
	f(DevicePtr(uintptr(devicePtr)))
}
