package storagesharing

/*
#include <stdlib.h>
#include <storage_sharing.h>
*/
import "C"

import (
	"runtime"
	"sync"
	"time"
	"unsafe"
)

// Store is one reference to a key-value store (ss_store, c10d's "Store"):
// the rendezvous medium of symmetric memory. The store closes with its last
// reference (Close, or the finalizer of a forgotten one). Its methods may be
// called from several goroutines at once: each gets the answer to its own
// call, one goroutine's calls take effect in the order it made them (a Get
// after a Set of the same key sees that value or a later one), and a Get
// blocked waiting for a key does not hold up a Set from another goroutine.
// Close waits for calls in progress. Timeouts: 0 waits forever. A key is
// any bytes but NUL (UTF-8 or not); a key with a NUL byte is refused with
// ErrInvalidArgument.
type Store struct {
	mu sync.RWMutex
	h  *C.ss_store // nil once closed
}

func wrapStore(h *C.ss_store) *Store {
	s := &Store{h: h}
	runtime.SetFinalizer(s, (*Store).finalize)
	return s
}

func (s *Store) finalize() {
	if s.h != nil {
		C.ss_store_free(s.h)
		s.h = nil
	}
}

// Close drops this reference; closing twice does nothing.
func (s *Store) Close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.finalize()
	runtime.SetFinalizer(s, nil)
}

// with runs f on the live handle, or fails with ErrClosed.
func (s *Store) with(op string, f func(h *C.ss_store) C.ss_status) error {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.h == nil {
		return goError(op, ErrClosed, "the store was closed")
	}
	err := call(op, func() C.ss_status { return f(s.h) })
	runtime.KeepAlive(s)
	return err
}

// timeoutMs converts a Go timeout: 0 is forever, anything shorter than a
// millisecond rounds up to one, a negative one is refused.
func timeoutMs(op string, d time.Duration) (C.int64_t, error) {
	if d < 0 {
		return 0, goError(op, ErrInvalidArgument, "timeout %v is negative (0 waits forever)", d)
	}
	ms := d.Milliseconds()
	if d > 0 && ms == 0 {
		ms = 1
	}
	return C.int64_t(ms), nil
}

// OpenFileStore opens the store in folder path (created if missing), shared
// by the processes of one host that open the same path. Use a fresh folder
// per job: keys of an earlier job stay.
func OpenFileStore(path string) (*Store, error) {
	return openFileStore("ss_store_file_open", path, func(p *C.char, h **C.ss_store) C.ss_status {
		return C.ss_store_file_open(p, h)
	})
}

// OpenFileStoreWithLockTimeout is OpenFileStore where a write waits for the
// folder's lock at most lockTimeout (0: as long as the holder keeps it;
// OpenFileStore waits 300 s), then fails with ErrTimeout.
func OpenFileStoreWithLockTimeout(path string, lockTimeout time.Duration) (*Store, error) {
	const op = "ss_store_file_open_with_lock_timeout"
	ms, err := timeoutMs(op, lockTimeout)
	if err != nil {
		return nil, err
	}
	return openFileStore(op, path, func(p *C.char, h **C.ss_store) C.ss_status {
		return C.ss_store_file_open_with_lock_timeout(p, ms, h)
	})
}

// openFileStore runs one of the C file-store openers on path.
func openFileStore(op, path string, open func(p *C.char, h **C.ss_store) C.ss_status) (*Store, error) {
	p, err := cString(op, "path", path)
	if err != nil {
		return nil, err
	}
	defer freeCString(p)
	var h *C.ss_store
	if err := call(op, func() C.ss_status { return open(p, &h) }); err != nil {
		return nil, err
	}
	return wrapStore(h), nil
}

// OpenTCPStore joins (or with isMaster serves) a PyTorch c10d TCPStore at
// host:port, as torch.distributed.TCPStore(host, port, worldSize, isMaster,
// timeout) does. Port 0 with isMaster picks a free port (TCPPort). With
// worldSize > 0 the master returns once that many ranks joined. timeout
// bounds connecting, the join and every reply; 0 waits forever.
func OpenTCPStore(host string, port int, isMaster bool, worldSize int, timeout time.Duration) (*Store, error) {
	const op = "ss_store_tcp_open"
	ms, err := timeoutMs(op, timeout)
	if err != nil {
		return nil, err
	}
	if port < 0 || port > 65535 || worldSize < 0 || worldSize > 1<<30 {
		return nil, goError(op, ErrInvalidArgument, "port %d or world size %d out of range", port, worldSize)
	}
	hs, err := cString(op, "host", host)
	if err != nil {
		return nil, err
	}
	defer freeCString(hs)
	var h *C.ss_store
	if err := call(op, func() C.ss_status {
		return C.ss_store_tcp_open(hs, C.int(port), C.bool(isMaster), C.int(worldSize), ms, &h)
	}); err != nil {
		return nil, err
	}
	return wrapStore(h), nil
}

// OpenTorchFileStore opens (creating if missing) the file at path in
// PyTorch's own FileStore format, as torch.distributed.FileStore(path,
// worldSize): PyTorch ranks and ours share its keys both ways. The last of
// worldSize stores to close removes the file (-1: never); timeout (0:
// forever) bounds each wait for the file's lock.
func OpenTorchFileStore(path string, worldSize int, timeout time.Duration) (*Store, error) {
	const op = "ss_store_torch_file_open"
	ms, err := timeoutMs(op, timeout)
	if err != nil {
		return nil, err
	}
	if worldSize < -1 || worldSize > 1<<30 {
		return nil, goError(op, ErrInvalidArgument, "world size %d out of range (-1 or 0..2^30)", worldSize)
	}
	p, err := cString(op, "path", path)
	if err != nil {
		return nil, err
	}
	defer freeCString(p)
	var h *C.ss_store
	if err := call(op, func() C.ss_status { return C.ss_store_torch_file_open(p, C.int(worldSize), ms, &h) }); err != nil {
		return nil, err
	}
	return wrapStore(h), nil
}

// Ref returns a second reference to the same store (close both).
func (s *Store) Ref() (*Store, error) {
	var h *C.ss_store
	if err := s.with("ss_store_ref", func(sh *C.ss_store) C.ss_status { return C.ss_store_ref(sh, &h) }); err != nil {
		return nil, err
	}
	return wrapStore(h), nil
}

// TCPPort is the port of a TCPStore (the one its server picked for port 0).
func (s *Store) TCPPort() (int, error) {
	var port C.int
	err := s.with("ss_store_tcp_port", func(h *C.ss_store) C.ss_status { return C.ss_store_tcp_port(h, &port) })
	return int(port), err
}

// Set sets key to value.
func (s *Store) Set(key string, value []byte) error {
	const op = "ss_store_set"
	k, err := cString(op, "key", key)
	if err != nil {
		return err
	}
	defer freeCString(k)
	var p unsafe.Pointer
	if len(value) > 0 {
		p = unsafe.Pointer(&value[0])
	}
	return s.with(op, func(h *C.ss_store) C.ss_status { return C.ss_store_set(h, k, p, C.size_t(len(value))) })
}

// Get returns the value of key, waiting until it is set (ErrTimeout, whose
// message names the key, when timeout passes first; 0 waits forever).
func (s *Store) Get(key string, timeout time.Duration) ([]byte, error) {
	const op = "ss_store_get"
	ms, err := timeoutMs(op, timeout)
	if err != nil {
		return nil, err
	}
	k, err := cString(op, "key", key)
	if err != nil {
		return nil, err
	}
	defer freeCString(k)
	return s.readValue(op, 256, func(h *C.ss_store, buf unsafe.Pointer, size C.size_t, n *C.size_t) C.ss_status {
		return C.ss_store_get(h, k, ms, buf, size, n)
	})
}

// readValue runs call with a buffer of size bytes (at least 1), and again
// with a larger one while the library answers ErrBufferTooSmall with a
// longer length; it returns the bytes written.
func (s *Store) readValue(op string, size int, call func(h *C.ss_store, buf unsafe.Pointer, size C.size_t, n *C.size_t) C.ss_status) ([]byte, error) {
	buf := make([]byte, size)
	for {
		var n C.size_t
		err := s.with(op, func(h *C.ss_store) C.ss_status {
			return call(h, unsafe.Pointer(&buf[0]), C.size_t(len(buf)), &n)
		})
		if e, ok := err.(*Error); ok && e.Status == ErrBufferTooSmall && int(n) > len(buf) {
			buf = make([]byte, int(n)) // the value is longer: ask again
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:int(n)], nil
	}
}

// Add adds delta to the integer under key (a missing key counts as 0) and
// returns the new value. It wraps in two's complement past either end of
// int64 (math.MaxInt64 + 1 is math.MinInt64), as PyTorch's TCPStore does.
func (s *Store) Add(key string, delta int64) (int64, error) {
	const op = "ss_store_add"
	k, err := cString(op, "key", key)
	if err != nil {
		return 0, err
	}
	defer freeCString(k)
	var v C.int64_t
	err = s.with(op, func(h *C.ss_store) C.ss_status { return C.ss_store_add(h, k, C.int64_t(delta), &v) })
	return int64(v), err
}

// Wait waits until every key is set (ErrTimeout, naming the keys still
// missing, when timeout passes first; 0 waits forever).
func (s *Store) Wait(keys []string, timeout time.Duration) error {
	const op = "ss_store_wait"
	ms, err := timeoutMs(op, timeout)
	if err != nil {
		return err
	}
	arr, free, err := cKeyArray(op, keys)
	if err != nil {
		return err
	}
	defer free()
	return s.with(op, func(h *C.ss_store) C.ss_status { return C.ss_store_wait(h, arr, C.size_t(len(keys)), ms) })
}

// cKeyArray copies keys into a C array of C strings (the library reads it
// after the call starts, so it must not live in Go memory); nil when keys
// is empty. free releases it.
func cKeyArray(op string, keys []string) (**C.char, func(), error) {
	if len(keys) == 0 {
		return nil, func() {}, nil
	}
	arr := (*[1 << 28]*C.char)(C.calloc(C.size_t(len(keys)), C.size_t(unsafe.Sizeof((*C.char)(nil)))))[:len(keys):len(keys)]
	free := func() {
		for _, p := range arr {
			if p != nil {
				freeCString(p)
			}
		}
		C.free(unsafe.Pointer(&arr[0]))
	}
	for i, key := range keys {
		p, err := cString(op, "key", key)
		if err != nil {
			free()
			return nil, nil, err
		}
		arr[i] = p
	}
	return &arr[0], free, nil
}

// Check reports whether every key is set now (no waiting).
func (s *Store) Check(keys []string) (bool, error) {
	const op = "ss_store_check"
	arr, free, err := cKeyArray(op, keys)
	if err != nil {
		return false, err
	}
	defer free()
	var all C.bool
	err = s.with(op, func(h *C.ss_store) C.ss_status { return C.ss_store_check(h, arr, C.size_t(len(keys)), &all) })
	return bool(all), err
}

// CompareSet is c10d's compare-and-set: desired after a swap, else the
// current value (expected itself when the key is missing).
func (s *Store) CompareSet(key string, expected, desired []byte) ([]byte, error) {
	const op = "ss_store_compare_set"
	k, err := cString(op, "key", key)
	if err != nil {
		return nil, err
	}
	defer freeCString(k)
	// The byte slices are passed for the length of the call only.
	e, d := C.CBytes(expected), C.CBytes(desired)
	defer C.free(e)
	defer C.free(d)
	size := len(expected)
	if len(desired) > size {
		size = len(desired)
	}
	// A retry after a longer current value does not swap a second time.
	return s.readValue(op, size+1, func(h *C.ss_store, buf unsafe.Pointer, bufLen C.size_t, n *C.size_t) C.ss_status {
		return C.ss_store_compare_set(h, k, e, C.size_t(len(expected)), d, C.size_t(len(desired)), buf, bufLen, n)
	})
}

// DeleteKey deletes key and reports whether it was set.
func (s *Store) DeleteKey(key string) (bool, error) {
	const op = "ss_store_delete_key"
	k, err := cString(op, "key", key)
	if err != nil {
		return false, err
	}
	defer freeCString(k)
	var existed C.bool
	err = s.with(op, func(h *C.ss_store) C.ss_status { return C.ss_store_delete_key(h, k, &existed) })
	return bool(existed), err
}

// NumKeys returns how many keys are set (a TCPStore counts init/ too).
func (s *Store) NumKeys() (int64, error) {
	const op = "ss_store_num_keys"
	var n C.int64_t
	err := s.with(op, func(h *C.ss_store) C.ss_status { return C.ss_store_num_keys(h, &n) })
	return int64(n), err
}
