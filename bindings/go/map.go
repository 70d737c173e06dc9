// Package storagesharing binds libstorage_sharing, the storage-sharing layer
// of a tensor framework: shared-memory segments with ATen's names, flags and
// layouts, which C, C++, Julia and PyTorch processes open too.
//
// Handles are freed by Close; a finalizer frees one that was forgotten, but
// only at the garbage collector's pace, so call Close. Every error is an
// *Error whose Status works with errors.Is.
package storagesharing

/*
#cgo pkg-config: storage_sharing
#include <stdlib.h>
#include <storage_sharing.h>
*/
import "C"

import (
	"runtime"
	"sync"
	"unsafe"
)

// Flag selects how a segment is opened: ATen's MapAllocator flags.
type Flag int

// The flags, with ATen's values.
const (
	Shared    Flag = C.SS_MAPPED_SHARED    // open(2) a regular file
	SharedMem Flag = C.SS_MAPPED_SHAREDMEM // shm_open(3) a POSIX segment; names start with '/'
	Exclusive Flag = C.SS_MAPPED_EXCLUSIVE // create, fail if it exists
	NoCreate  Flag = C.SS_MAPPED_NOCREATE  // must exist
	KeepFD    Flag = C.SS_MAPPED_KEEPFD    // keep the descriptor (Map.FD)
	FromFD    Flag = C.SS_MAPPED_FROMFD    // map a descriptor given to OpenFD
	Unlink    Flag = C.SS_MAPPED_UNLINK    // remove the name right after mapping
)

// RefcountHeaderSize is the bytes of a refcounted segment's header, before its data.
const RefcountHeaderSize = C.SS_REFCOUNT_HEADER_SIZE

// Map is a mapped file or shared-memory segment (ss_map). Its methods may
// be called from several goroutines; Close waits for calls in progress.
type Map struct {
	mu sync.RWMutex
	h  *C.ss_map // nil once closed
}

func wrapMap(h *C.ss_map) *Map {
	m := &Map{h: h}
	runtime.SetFinalizer(m, (*Map).finalize)
	return m
}

// finalize is the safety net for a Map nobody closed.
func (m *Map) finalize() {
	if m.h != nil {
		C.ss_map_free(m.h)
		m.h = nil
	}
}

func checkSize(op string, size int) error {
	if size <= 0 {
		return goError(op, ErrInvalidArgument, "size %d: a mapping needs at least one byte", size)
	}
	return nil
}

// Open opens name with flags and maps size bytes: ATen's MapAllocator(name,
// flags, size). Close it when done.
func Open(name string, flags Flag, size int) (*Map, error) {
	return openNamed("ss_map_open", name, flags, size, func(n *C.char, out **C.ss_map) C.ss_status {
		return C.ss_map_open(n, C.int(flags), C.size_t(size), out)
	})
}

// OpenRefcounted creates (SharedMem|Exclusive: count 1) or opens
// (SharedMem|NoCreate: count + 1) a refcounted segment of size data bytes:
// ATen's RefcountedMapAllocator. The last holder to close removes the name.
func OpenRefcounted(name string, flags Flag, size int) (*Map, error) {
	return openNamed("ss_map_open_refcounted", name, flags, size, func(n *C.char, out **C.ss_map) C.ss_status {
		return C.ss_map_open_refcounted(n, C.int(flags), C.size_t(size), out)
	})
}

func openNamed(op, name string, flags Flag, size int, open func(*C.char, **C.ss_map) C.ss_status) (*Map, error) {
	if err := checkSize(op, size); err != nil {
		return nil, err
	}
	// A NUL inside would cut the name short in C: refused, not truncated.
	cname, err := cString(op, "name", name)
	if err != nil {
		return nil, err
	}
	defer freeCString(cname)
	var h *C.ss_map
	if err := call(op, func() C.ss_status { return open(cname, &h) }); err != nil {
		return nil, err
	}
	return wrapMap(h), nil
}

// OpenFD maps size bytes of the descriptor fd; flags must hold FromFD. On
// success the Map owns fd (kept with KeepFD, closed at once otherwise); on
// failure the caller still owns it.
func OpenFD(fd int, flags Flag, size int) (*Map, error) {
	const op = "ss_map_open_fd"
	if err := checkSize(op, size); err != nil {
		return nil, err
	}
	var h *C.ss_map
	err := call(op, func() C.ss_status { return C.ss_map_open_fd(nil, C.int(fd), C.int(flags), C.size_t(size), &h) })
	if err != nil {
		return nil, err
	}
	return wrapMap(h), nil
}

// NewFDStorage makes an anonymous segment of size zero bytes whose name is
// already removed; pass Map.FD to another process to share it.
func NewFDStorage(size int) (*Map, error) {
	const op = "ss_map_new_shm_fd"
	if err := checkSize(op, size); err != nil {
		return nil, err
	}
	var h *C.ss_map
	if err := call(op, func() C.ss_status { return C.ss_map_new_shm_fd(C.size_t(size), &h) }); err != nil {
		return nil, err
	}
	return wrapMap(h), nil
}

// ShareMemory copies b into a new fd-backed segment: PyTorch's share_memory_().
func ShareMemory(b []byte) (*Map, error) {
	const op = "ss_map_new_copy"
	if len(b) == 0 {
		return nil, goError(op, ErrInvalidArgument, "nothing to share: the slice is empty")
	}
	var h *C.ss_map
	// b holds no Go pointers, so passing it to C is allowed; the library
	// only reads it during the call.
	err := call(op, func() C.ss_status { return C.ss_map_new_copy(unsafe.Pointer(&b[0]), C.size_t(len(b)), &h) })
	if err != nil {
		return nil, err
	}
	return wrapMap(h), nil
}

// NewSegmentName gives a fresh process-wide segment name,
// "/torch_<pid>_<rand>_<n>".
func NewSegmentName() (string, error) {
	var buf [64]C.char
	if err := call("ss_shm_name_new", func() C.ss_status {
		return C.ss_shm_name_new(&buf[0], C.size_t(len(buf)))
	}); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

// with runs f on the open handle under the read lock, or fails with ErrClosed.
func (m *Map) with(op string, f func(h *C.ss_map) error) error {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if m.h == nil {
		return goError(op, ErrClosed, "the map was closed")
	}
	err := f(m.h)
	runtime.KeepAlive(m) // no finalizer while C uses the handle
	return err
}

// Bytes is the mapped data (after the header for refcounted maps). It is
// valid until Close, and the Map must stay reachable while it is used (a
// finalized Map unmaps it): keep the *Map, or call runtime.KeepAlive(m)
// after the last use. Nil after Close.
func (m *Map) Bytes() []byte {
	var b []byte
	_ = m.with("ss_map_data", func(h *C.ss_map) error {
		p := C.ss_map_data(h)
		if p != nil {
			b = unsafe.Slice((*byte)(p), int(C.ss_map_size(h)))
		}
		return nil
	})
	return b
}

// Len is the number of data bytes (0 after Close).
func (m *Map) Len() int {
	n := 0
	_ = m.with("ss_map_size", func(h *C.ss_map) error { n = int(C.ss_map_size(h)); return nil })
	return n
}

// FD is the descriptor kept with KeepFD, else -1. The Map owns it.
func (m *Map) FD() int {
	fd := -1
	_ = m.with("ss_map_fd", func(h *C.ss_map) error { fd = int(C.ss_map_fd(h)); return nil })
	return fd
}

// Filename is the name the map was opened with.
func (m *Map) Filename() string {
	var s string
	_ = m.with("ss_map_filename", func(h *C.ss_map) error { s = C.GoString(C.ss_map_filename(h)); return nil })
	return s
}

// Flags are the flags in effect.
func (m *Map) Flags() Flag {
	var f Flag
	_ = m.with("ss_map_flags", func(h *C.ss_map) error { f = Flag(C.ss_map_flags(h)); return nil })
	return f
}

// IsRefcounted tells whether the map came from OpenRefcounted.
func (m *Map) IsRefcounted() bool {
	var r bool
	_ = m.with("ss_map_is_refcounted", func(h *C.ss_map) error { r = bool(C.ss_map_is_refcounted(h)); return nil })
	return r
}

// Incref adds one to a refcounted segment's shared count.
func (m *Map) Incref() error {
	return m.with("ss_map_incref", func(h *C.ss_map) error {
		return call("ss_map_incref", func() C.ss_status { return C.ss_map_incref(h) })
	})
}

// Decref subtracts one from the shared count and tells whether it reached 0
// (the name is removed by Close, not here).
func (m *Map) Decref() (bool, error) {
	var zero C.bool
	err := m.with("ss_map_decref", func(h *C.ss_map) error {
		return call("ss_map_decref", func() C.ss_status { return C.ss_map_decref(h, &zero) })
	})
	return bool(zero), err
}

// Refcount reads the shared count of a refcounted segment.
func (m *Map) Refcount() (int32, error) {
	var n C.int32_t
	err := m.with("ss_map_refcount", func(h *C.ss_map) error {
		return call("ss_map_refcount", func() C.ss_status { return C.ss_map_refcount(h, &n) })
	})
	return int32(n), err
}

// Close unmaps, closes a kept descriptor, removes the name where ATen would
// and frees the handle. Slices from Bytes must not be used afterwards.
// Closing twice returns nil.
func (m *Map) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.h == nil {
		return nil
	}
	h := m.h
	err := call("ss_map_close", func() C.ss_status { return C.ss_map_close(h) })
	C.ss_map_free(h)
	m.h = nil
	runtime.SetFinalizer(m, nil)
	return err
}
