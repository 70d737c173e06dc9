package storagesharing

/*
#include <stdlib.h>
#include <storage_sharing.h>
*/
import "C"

import (
	"fmt"
	"io/fs"
	"runtime"
	"strings"
	"unsafe"
)

// Status is the C API's ss_status: what kind of failure a call had. A
// Status is an error, so errors.Is(err, storagesharing.ErrNotFound) works on
// every error this package returns.
type Status int

// The status codes, with the C header's values.
const (
	ErrInvalidArgument Status = C.SS_ERR_INVALID_ARGUMENT
	ErrNullPointer     Status = C.SS_ERR_NULL_POINTER
	ErrNotFound        Status = C.SS_ERR_NOT_FOUND
	ErrAlreadyExists   Status = C.SS_ERR_ALREADY_EXISTS
	ErrNoSpace         Status = C.SS_ERR_NO_SPACE
	ErrPermission      Status = C.SS_ERR_PERMISSION
	ErrSizeMismatch    Status = C.SS_ERR_SIZE_MISMATCH
	ErrIO              Status = C.SS_ERR_IO
	ErrUnsupported     Status = C.SS_ERR_UNSUPPORTED
	ErrCudaUnavailable Status = C.SS_ERR_CUDA_UNAVAILABLE
	ErrCuda            Status = C.SS_ERR_CUDA
	ErrTimeout         Status = C.SS_ERR_TIMEOUT
	ErrProtocol        Status = C.SS_ERR_PROTOCOL
	ErrPanic           Status = C.SS_ERR_PANIC
	ErrNameTooLong     Status = C.SS_ERR_NAME_TOO_LONG
	ErrBadRefcount     Status = C.SS_ERR_BAD_REFCOUNT
	ErrTooManyFiles    Status = C.SS_ERR_TOO_MANY_FILES
	ErrClosed          Status = C.SS_ERR_CLOSED
	ErrBufferTooSmall  Status = C.SS_ERR_BUFFER_TOO_SMALL
	ErrPeerGone        Status = C.SS_ERR_PEER_GONE
	ErrBusy            Status = C.SS_ERR_BUSY
	ErrCorrupt         Status = C.SS_ERR_CORRUPT
)

// Error returns the fixed text of the status ("not found", ...).
func (s Status) Error() string { return C.GoString(C.ss_status_str(C.int(s))) }

// Error is a failed call: the C function, its status and the library's
// message (the name, size and OS error involved).
type Error struct {
	Op      string // the C function, e.g. "ss_map_open"
	Status  Status
	Message string
}

func (e *Error) Error() string { return fmt.Sprintf("%s: %s (%s)", e.Op, e.Message, e.Status.Error()) }

// Unwrap gives the Status, for errors.Is(err, ErrNotFound).
func (e *Error) Unwrap() error { return e.Status }

// Is also matches the io/fs errors a Go program already checks for.
func (e *Error) Is(target error) bool {
	switch target {
	case fs.ErrNotExist:
		return e.Status == ErrNotFound
	case fs.ErrExist:
		return e.Status == ErrAlreadyExists
	case fs.ErrPermission:
		return e.Status == ErrPermission
	case fs.ErrClosed:
		return e.Status == ErrClosed
	}
	return false
}

// call runs one C call and, when it fails, reads the message on the same OS
// thread: the library keeps it per thread, and a goroutine may otherwise
// move to another thread between the two cgo calls.
func call(op string, f func() C.ss_status) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if st := f(); st != C.SS_OK {
		return &Error{Op: op, Status: Status(st), Message: C.GoString(C.ss_last_error_message())}
	}
	return nil
}

// goError is a failure found on the Go side, before reaching C.
func goError(op string, s Status, format string, args ...any) error {
	return &Error{Op: op, Status: s, Message: fmt.Sprintf(format, args...)}
}

// cString copies s for C (free it with C.free); a NUL byte inside would
// silently cut the string short in C, so it is refused.
func cString(op, what, s string) (*C.char, error) {
	if i := strings.IndexByte(s, 0); i >= 0 {
		return nil, goError(op, ErrInvalidArgument, "%s %q has a NUL byte at %d", what, s, i)
	}
	return C.CString(s), nil
}

func freeCString(p *C.char) { C.free(unsafe.Pointer(p)) }

// Version is the library's version, "MAJOR.MINOR.PATCH".
func Version() string { return C.GoString(C.ss_version()) }
