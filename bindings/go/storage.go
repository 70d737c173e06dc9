package storagesharing

/*
#include <stdlib.h>
#include <storage_sharing.h>
*/
import "C"

import (
	"runtime"
	"sync"
	"unsafe"
)

// Storage is one strong reference to a storage (ss_storage): a byte buffer
// that can move into shared memory and be opened by other processes. The
// bytes go with the last reference (Close, or the finalizer of a forgotten
// one). Its methods may be called from several goroutines; Close waits for
// calls in progress.
type Storage struct {
	mu sync.RWMutex
	h  *C.ss_storage // nil once closed
}

func wrapStorage(h *C.ss_storage) *Storage {
	s := &Storage{h: h}
	runtime.SetFinalizer(s, (*Storage).finalize)
	return s
}

// finalize is the safety net for a Storage nobody closed.
func (s *Storage) finalize() {
	if s.h != nil {
		C.ss_storage_free(s.h)
		s.h = nil
	}
}

func newStorage(op string, f func(out **C.ss_storage) C.ss_status) (*Storage, error) {
	var h *C.ss_storage
	if err := call(op, func() C.ss_status { return f(&h) }); err != nil {
		return nil, err
	}
	return wrapStorage(h), nil
}

func checkLen(op string, n int) error {
	if n < 0 {
		return goError(op, ErrInvalidArgument, "size %d is negative", n)
	}
	return nil
}

// NewStorage makes a storage of n zero bytes on the heap (resizable until
// it is shared). n may be 0.
func NewStorage(n int) (*Storage, error) {
	const op = "ss_storage_new"
	if err := checkLen(op, n); err != nil {
		return nil, err
	}
	return newStorage(op, func(out **C.ss_storage) C.ss_status { return C.ss_storage_new(C.size_t(n), out) })
}

// NewStorageUsingFD makes an fd-backed shared storage of n zero bytes (ATen flags 86).
func NewStorageUsingFD(n int) (*Storage, error) {
	const op = "ss_storage_new_using_fd"
	if err := checkLen(op, n); err != nil {
		return nil, err
	}
	return newStorage(op, func(out **C.ss_storage) C.ss_status { return C.ss_storage_new_using_fd(C.size_t(n), out) })
}

// NewStorageUsingFilename makes a managed shared storage of n zero bytes (ATen flags 6).
func NewStorageUsingFilename(n int) (*Storage, error) {
	const op = "ss_storage_new_using_filename"
	if err := checkLen(op, n); err != nil {
		return nil, err
	}
	return newStorage(op, func(out **C.ss_storage) C.ss_status {
		return C.ss_storage_new_using_filename(C.size_t(n), out)
	})
}

// OpenSharedFD opens a storage shared by fd: maps n bytes of a duplicate
// of fd, so the caller still closes fd.
func OpenSharedFD(fd int, n int) (*Storage, error) {
	const op = "ss_storage_new_shared_fd"
	if err := checkLen(op, n); err != nil {
		return nil, err
	}
	return newStorage(op, func(out **C.ss_storage) C.ss_status {
		return C.ss_storage_new_shared_fd(C.int(fd), C.size_t(n), out)
	})
}

// SharedFilename is what another process needs to open a storage shared
// by name: the manager's socket path, the segment and its size.
type SharedFilename struct {
	Manager string
	Name    string
	NBytes  int
}

// OpenSharedFilename opens a storage shared by name (Manager "" is this
// process's own manager). Under torch.multiprocessing's protocol the
// receiver then calls SharedDecref to cancel the sender's reference in flight.
func OpenSharedFilename(shared SharedFilename) (*Storage, error) {
	const op = "ss_storage_new_shared_filename"
	if err := checkLen(op, shared.NBytes); err != nil {
		return nil, err
	}
	manager, err := cString(op, "manager", shared.Manager)
	if err != nil {
		return nil, err
	}
	defer freeCString(manager)
	name, err := cString(op, "name", shared.Name)
	if err != nil {
		return nil, err
	}
	defer freeCString(name)
	return newStorage(op, func(out **C.ss_storage) C.ss_status {
		return C.ss_storage_new_shared_filename(manager, name, C.size_t(shared.NBytes), out)
	})
}

// with runs f on the open handle under the read lock, or fails with ErrClosed.
func (s *Storage) with(op string, f func(h *C.ss_storage) error) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.h == nil {
		return goError(op, ErrClosed, "the storage was closed")
	}
	err := f(s.h)
	runtime.KeepAlive(s) // no finalizer while C uses the handle
	return err
}

// Ref gives a second strong reference to the same bytes (close both).
func (s *Storage) Ref() (*Storage, error) {
	var r *Storage
	err := s.with("ss_storage_ref", func(h *C.ss_storage) error {
		var err error
		r, err = newStorage("ss_storage_ref", func(out **C.ss_storage) C.ss_status { return C.ss_storage_ref(h, out) })
		return err
	})
	return r, err
}

// Weak gives a weak reference, which does not keep the bytes alive.
func (s *Storage) Weak() (*Weak, error) {
	var w *Weak
	err := s.with("ss_storage_weak_ref", func(h *C.ss_storage) error {
		var raw *C.ss_weak
		if err := call("ss_storage_weak_ref", func() C.ss_status { return C.ss_storage_weak_ref(h, &raw) }); err != nil {
			return err
		}
		w = &Weak{h: raw}
		runtime.SetFinalizer(w, (*Weak).Close)
		return nil
	})
	return w, err
}

// Bytes is the storage's memory itself (nil when empty or closed). It is
// valid until Close of the last reference, Resize, or ShareFD /
// ShareFilename moving a heap storage into shared memory; take it again
// after those. Keep the *Storage reachable while the slice is used.
func (s *Storage) Bytes() []byte {
	var b []byte
	_ = s.with("ss_storage_data", func(h *C.ss_storage) error {
		if p := C.ss_storage_data(h); p != nil {
			b = unsafe.Slice((*byte)(p), int(C.ss_storage_nbytes(h)))
		}
		return nil
	})
	return b
}

// Len is the size in bytes (0 after Close).
func (s *Storage) Len() int {
	n := 0
	_ = s.with("ss_storage_nbytes", func(h *C.ss_storage) error { n = int(C.ss_storage_nbytes(h)); return nil })
	return n
}

// IsShared tells whether the bytes are in shared memory.
func (s *Storage) IsShared() bool {
	r := false
	_ = s.with("ss_storage_is_shared", func(h *C.ss_storage) error { r = bool(C.ss_storage_is_shared(h)); return nil })
	return r
}

// Resize resizes a heap storage (prefix kept, the rest zero); a shared one
// gives ErrUnsupported.
func (s *Storage) Resize(n int) error {
	const op = "ss_storage_resize"
	if err := checkLen(op, n); err != nil {
		return err
	}
	return s.with(op, func(h *C.ss_storage) error {
		return call(op, func() C.ss_status { return C.ss_storage_resize(h, C.size_t(n)) })
	})
}

// ShareFD moves the storage into a nameless fd-backed segment (once) and
// returns its descriptor and size. The descriptor stays the storage's:
// send it (SendFDs) or dup it, never close it.
func (s *Storage) ShareFD() (fd int, nbytes int, err error) {
	const op = "ss_storage_share_fd"
	var cfd C.int
	var n C.size_t
	err = s.with(op, func(h *C.ss_storage) error {
		return call(op, func() C.ss_status { return C.ss_storage_share_fd(h, &cfd, &n) })
	})
	if err != nil {
		return -1, 0, err
	}
	return int(cfd), int(n), nil
}

// SharedFD is the descriptor of an fd-backed storage (ErrNotFound otherwise).
func (s *Storage) SharedFD() (int, error) {
	const op = "ss_storage_get_shared_fd"
	cfd := C.int(-1)
	err := s.with(op, func(h *C.ss_storage) error {
		return call(op, func() C.ss_status { return C.ss_storage_get_shared_fd(h, &cfd) })
	})
	return int(cfd), err
}

// ShareFilename moves the storage into a managed refcounted segment (once)
// and returns what OpenSharedFilename takes in another process. Call
// SharedIncref before sending it: the reference in flight.
func (s *Storage) ShareFilename() (SharedFilename, error) {
	const op = "ss_storage_share_filename"
	var manager [108]C.char
	var name [64]C.char
	var n C.size_t
	err := s.with(op, func(h *C.ss_storage) error {
		return call(op, func() C.ss_status {
			return C.ss_storage_share_filename(h, &manager[0], C.size_t(len(manager)), &name[0], C.size_t(len(name)), &n)
		})
	})
	if err != nil {
		return SharedFilename{}, err
	}
	return SharedFilename{Manager: C.GoString(&manager[0]), Name: C.GoString(&name[0]), NBytes: int(n)}, nil
}

// SharedIncref adds one to a storage shared by name's header count.
func (s *Storage) SharedIncref() error {
	const op = "ss_storage_shared_incref"
	return s.with(op, func(h *C.ss_storage) error {
		return call(op, func() C.ss_status { return C.ss_storage_shared_incref(h) })
	})
}

// SharedDecref subtracts one from the header count (the name is never
// removed here).
func (s *Storage) SharedDecref() error {
	const op = "ss_storage_shared_decref"
	return s.with(op, func(h *C.ss_storage) error {
		return call(op, func() C.ss_status { return C.ss_storage_shared_decref(h) })
	})
}

// SharedRefcount reads the header count of a storage shared by name.
func (s *Storage) SharedRefcount() (int32, error) {
	const op = "ss_storage_shared_refcount"
	var n C.int32_t
	err := s.with(op, func(h *C.ss_storage) error {
		return call(op, func() C.ss_status { return C.ss_storage_shared_refcount(h, &n) })
	})
	return int32(n), err
}

// Close drops this strong reference. Slices from Bytes must not be used
// afterwards unless another reference keeps the bytes. Closing twice
// returns nil.
func (s *Storage) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.h != nil {
		C.ss_storage_free(s.h)
		s.h = nil
		runtime.SetFinalizer(s, nil)
	}
	return nil
}

// Weak is a weak reference to a storage (ss_weak).
type Weak struct {
	mu sync.RWMutex
	h  *C.ss_weak
}

// Upgrade gives a new strong reference while the storage lives, and
// ErrNotFound once every strong reference is gone.
func (w *Weak) Upgrade() (*Storage, error) {
	const op = "ss_weak_upgrade"
	w.mu.RLock()
	defer w.mu.RUnlock()
	if w.h == nil {
		return nil, goError(op, ErrClosed, "the weak reference was closed")
	}
	s, err := newStorage(op, func(out **C.ss_storage) C.ss_status { return C.ss_weak_upgrade(w.h, out) })
	runtime.KeepAlive(w)
	return s, err
}

// Expired tells whether no strong reference is left (true after Close).
func (w *Weak) Expired() bool {
	w.mu.RLock()
	defer w.mu.RUnlock()
	r := bool(C.ss_weak_expired(w.h))
	runtime.KeepAlive(w)
	return r
}

// Close frees the weak reference; twice returns nil.
func (w *Weak) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.h != nil {
		C.ss_weak_free(w.h)
		w.h = nil
		runtime.SetFinalizer(w, nil)
	}
	return nil
}
