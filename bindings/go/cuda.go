package storagesharing

/*
#include <stdint.h>
#include <stdlib.h>
#include <storage_sharing.h>

// Defined in cuda_deleter.go (exported from Go).
extern void ssGoCudaDeleter(void *ctx, void *device_ptr);

// Device addresses, streams and deleter contexts travel as integers on the
// Go side: they are not Go pointers, and Go must not treat them as such.
static ss_status ss_go_cuda_share(uintptr_t ptr, size_t nbytes, int32_t device, uintptr_t stream,
                                  uintptr_t deleter_handle, ss_cuda_ipc_handle *out, ss_cuda_sent **sent) {
	return ss_cuda_share((const void *)ptr, nbytes, device, (void *)stream,
	                     deleter_handle ? ssGoCudaDeleter : NULL, (void *)deleter_handle, out, sent);
}
static ss_status ss_go_cuda_open(const ss_cuda_ipc_handle *h, uintptr_t stream, ss_cuda_received **out) {
	return ss_cuda_received_open(h, (void *)stream, out);
}
static uintptr_t ss_go_cuda_received_data(const ss_cuda_received *r) {
	return (uintptr_t)ss_cuda_received_data(r);
}
static ss_status ss_go_cuda_malloc(int32_t device, size_t nbytes, uintptr_t *out) {
	void *p = NULL;
	ss_status st = ss_cuda_alloc(device, nbytes, &p);
	*out = (uintptr_t)p;
	return st;
}
static ss_status ss_go_cuda_free(int32_t device, uintptr_t ptr) {
	return ss_cuda_free(device, (void *)ptr);
}
static ss_status ss_go_cuda_pointer_base(uintptr_t ptr, int32_t device, uintptr_t *base, size_t *size) {
	void *b = NULL;
	ss_status st = ss_cuda_pointer_base((const void *)ptr, device, &b, size);
	*base = (uintptr_t)b;
	return st;
}
*/
import "C"

import (
	"runtime"
	"runtime/cgo"
	"sync"
	"unsafe"
)

// DevicePtr is a CUDA device address (never dereferenced by Go).
type DevicePtr uintptr

// Stream is a cudaStream_t; 0 is the default stream.
type Stream uintptr

// CudaAvailable tells whether CUDA can be used here; when it cannot, reason
// says why (the driver is missing, too old, or no device is visible).
func CudaAvailable() (ok bool, reason string) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if C.ss_cuda_available() {
		return true, ""
	}
	return false, C.GoString(C.ss_last_error_message())
}

// CudaDriverInfo gives the driver's CUDA version (1000*major + 10*minor)
// and the number of visible devices; ErrCudaUnavailable otherwise.
func CudaDriverInfo() (version, devices int, err error) {
	var v, n C.int32_t
	err = call("ss_cuda_driver_info", func() C.ss_status { return C.ss_cuda_driver_info(&v, &n) })
	return int(v), int(n), err
}

// CudaIPCHandle is the tuple of PyTorch's storage._share_cuda_(), in its
// order. Send it as text (MarshalText) or field by field.
type CudaIPCHandle struct {
	Device            int32
	MemHandle         []byte // 66 bytes (version 2, 'c', cudaIpcMemHandle_t), 64 legacy, or none
	SizeBytes         uint64
	OffsetBytes       uint64
	RefCounterHandle  string // the producer's ref-counter file
	RefCounterOffset  uint64
	EventHandle       [C.SS_CUDA_IPC_HANDLE_SIZE]byte
	EventSyncRequired bool
}

func cudaHandleFromC(c *C.ss_cuda_ipc_handle) CudaIPCHandle {
	h := CudaIPCHandle{
		Device:            int32(c.device),
		MemHandle:         C.GoBytes(unsafe.Pointer(&c.mem_handle[0]), C.int(c.mem_handle_len)),
		SizeBytes:         uint64(c.size_bytes),
		OffsetBytes:       uint64(c.offset_bytes),
		RefCounterHandle:  C.GoString(&c.ref_counter_handle[0]),
		RefCounterOffset:  uint64(c.ref_counter_offset),
		EventSyncRequired: bool(c.event_sync_required),
	}
	for i := range h.EventHandle {
		h.EventHandle[i] = byte(c.event_handle[i])
	}
	return h
}

func (h *CudaIPCHandle) toC(op string) (C.ss_cuda_ipc_handle, error) {
	var c C.ss_cuda_ipc_handle
	if len(h.MemHandle) > len(c.mem_handle) {
		return c, goError(op, ErrInvalidArgument, "memory handle of %d bytes, at most %d", len(h.MemHandle), len(c.mem_handle))
	}
	if len(h.RefCounterHandle) >= len(c.ref_counter_handle) {
		return c, goError(op, ErrNameTooLong, "ref-counter name %q has %d bytes, at most %d",
			h.RefCounterHandle, len(h.RefCounterHandle), len(c.ref_counter_handle)-1)
	}
	c.device = C.int32_t(h.Device)
	for i, b := range h.MemHandle {
		c.mem_handle[i] = C.uint8_t(b)
	}
	c.mem_handle_len = C.size_t(len(h.MemHandle))
	c.size_bytes = C.uint64_t(h.SizeBytes)
	c.offset_bytes = C.uint64_t(h.OffsetBytes)
	for i := 0; i < len(h.RefCounterHandle); i++ {
		c.ref_counter_handle[i] = C.char(h.RefCounterHandle[i])
	}
	c.ref_counter_offset = C.uint64_t(h.RefCounterOffset)
	for i, b := range h.EventHandle {
		c.event_handle[i] = C.uint8_t(b)
	}
	c.event_sync_required = C.bool(h.EventSyncRequired)
	return c, nil
}

// MarshalText writes the tuple as one line (ss_cuda_ipc_handle_to_text).
func (h CudaIPCHandle) MarshalText() ([]byte, error) {
	const op = "ss_cuda_ipc_handle_to_text"
	c, err := h.toC(op)
	if err != nil {
		return nil, err
	}
	var buf [C.SS_CUDA_HANDLE_TEXT_MAX]C.char
	if err := call(op, func() C.ss_status {
		return C.ss_cuda_ipc_handle_to_text(&c, &buf[0], C.size_t(len(buf)))
	}); err != nil {
		return nil, err
	}
	return []byte(C.GoString(&buf[0])), nil
}

// UnmarshalText parses MarshalText's form (also PyTorch-side tools' text).
func (h *CudaIPCHandle) UnmarshalText(text []byte) error {
	const op = "ss_cuda_ipc_handle_from_text"
	ctext, err := cString(op, "text", string(text))
	if err != nil {
		return err
	}
	defer freeCString(ctext)
	var c C.ss_cuda_ipc_handle
	if err := call(op, func() C.ss_status { return C.ss_cuda_ipc_handle_from_text(ctext, &c) }); err != nil {
		return err
	}
	*h = cudaHandleFromC(&c)
	return nil
}

// CudaSent is the producer's record of one send (ss_cuda_sent).
type CudaSent struct {
	mu sync.RWMutex
	h  *C.ss_cuda_sent
}

// CudaShare shares nbytes of device memory at ptr (inside a cudaMalloc
// allocation of device) with another process; work queued on stream
// before the call is visible to the consumer. Send the returned tuple;
// Close the CudaSent when the producer is done. Once the consumer has
// released the memory too, deleter(ptr) runs (nil: nothing runs), on the
// thread that frees or collects.
func CudaShare(ptr DevicePtr, nbytes int, device int32, stream Stream, deleter func(DevicePtr)) (CudaIPCHandle, *CudaSent, error) {
	const op = "ss_cuda_share"
	if nbytes < 0 {
		return CudaIPCHandle{}, nil, goError(op, ErrInvalidArgument, "size %d is negative", nbytes)
	}
	var dh cgo.Handle
	if deleter != nil {
		dh = cgo.NewHandle(deleter)
	}
	var c C.ss_cuda_ipc_handle
	var raw *C.ss_cuda_sent
	err := call(op, func() C.ss_status {
		return C.ss_go_cuda_share(C.uintptr_t(ptr), C.size_t(nbytes), C.int32_t(device), C.uintptr_t(stream),
			C.uintptr_t(dh), &c, &raw)
	})
	if err != nil {
		if dh != 0 {
			dh.Delete()
		}
		return CudaIPCHandle{}, nil, err
	}
	var sent *CudaSent
	if raw != nil {
		sent = &CudaSent{h: raw}
		runtime.SetFinalizer(sent, func(s *CudaSent) { _, _ = s.Close() })
	} else if dh != 0 {
		dh.Delete() // a storage without data: no memory, no deleter call
	}
	return cudaHandleFromC(&c), sent, nil
}

// Counter is 1 while the consumer holds the memory, 0 once it released it.
func (s *CudaSent) Counter() (int64, error) {
	const op = "ss_cuda_sent_counter"
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.h == nil {
		return 0, goError(op, ErrClosed, "the send was closed")
	}
	var n C.int64_t
	err := call(op, func() C.ss_status { return C.ss_cuda_sent_counter(s.h, &n) })
	runtime.KeepAlive(s)
	return int64(n), err
}

// Close is the producer's release: the memory is given back now, or waits
// in limbo (inLimbo true) until a collection finds the consumer done.
// Closing twice returns false, nil.
func (s *CudaSent) Close() (inLimbo bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.h == nil {
		return false, nil
	}
	h := s.h
	s.h = nil
	runtime.SetFinalizer(s, nil)
	var limbo C.bool
	err = call("ss_cuda_sent_free", func() C.ss_status { return C.ss_cuda_sent_free(h, &limbo) })
	return bool(limbo), err
}

// CudaReceived is a storage received from another process (ss_cuda_received).
type CudaReceived struct {
	mu sync.RWMutex
	h  *C.ss_cuda_received
}

// CudaOpen maps a tuple from another process (ours or PyTorch's) and makes
// stream wait for the producer's event. ErrPeerGone when the producer has
// exited, ErrBadRefcount when the tuple was already released.
func CudaOpen(h CudaIPCHandle, stream Stream) (*CudaReceived, error) {
	const op = "ss_cuda_received_open"
	c, err := h.toC(op)
	if err != nil {
		return nil, err
	}
	var raw *C.ss_cuda_received
	if err := call(op, func() C.ss_status { return C.ss_go_cuda_open(&c, C.uintptr_t(stream), &raw) }); err != nil {
		return nil, err
	}
	r := &CudaReceived{h: raw}
	runtime.SetFinalizer(r, func(r *CudaReceived) { _ = r.Close() })
	return r, nil
}

// Data is the device address of the first byte (0 when empty or closed).
func (r *CudaReceived) Data() DevicePtr {
	r.mu.RLock()
	defer r.mu.RUnlock()
	p := DevicePtr(C.ss_go_cuda_received_data(r.h))
	runtime.KeepAlive(r)
	return p
}

// Len is the received storage's size in bytes (0 when closed).
func (r *CudaReceived) Len() int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	n := int(C.ss_cuda_received_size(r.h))
	runtime.KeepAlive(r)
	return n
}

// Close is the consumer's release: waits for the stream, unmaps when last
// here, decrements the producer's counter (ErrPeerGone if it is gone).
// Closing twice returns nil.
func (r *CudaReceived) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.h == nil {
		return nil
	}
	h := r.h
	r.h = nil
	runtime.SetFinalizer(r, nil)
	return call("ss_cuda_received_free", func() C.ss_status { return C.ss_cuda_received_free(h) })
}

// CudaReleaseIPCCounter decrements slot of the ref-counter file name, for
// a consumer that drops a tuple without opening it. Needs no GPU.
func CudaReleaseIPCCounter(name string, slot uint64) error {
	const op = "ss_cuda_ipc_counter_release"
	cname, err := cString(op, "counter name", name)
	if err != nil {
		return err
	}
	defer freeCString(cname)
	return call(op, func() C.ss_status {
		return C.ss_cuda_ipc_counter_release(cname, C.uint64_t(slot))
	})
}

// CudaIPCCollect gives back limbo blocks no consumer uses any more and
// returns how many (torch.cuda.ipc_collect()).
func CudaIPCCollect() (int, error) {
	var n C.size_t
	err := call("ss_cuda_ipc_collect", func() C.ss_status { return C.ss_cuda_ipc_collect(&n) })
	return int(n), err
}

// CudaLimboSize is the number of blocks this producer freed that consumers
// still use.
func CudaLimboSize() int { return int(C.ss_cuda_limbo_size()) }

// CudaIPCTeardown ends this process's part in CUDA IPC: warns if consumers
// still hold freed blocks and removes this producer's counter files from
// /dev/shm. The C library runs it from atexit, but os.Exit (and a Go
// program's return from main) skips C atexit handlers: a Go producer calls
// it before exiting.
func CudaIPCTeardown() { C.ss_cuda_ipc_teardown() }

// CudaMalloc allocates nbytes on device, shareable with CudaShare.
func CudaMalloc(device int32, nbytes int) (DevicePtr, error) {
	const op = "ss_cuda_alloc"
	if nbytes <= 0 {
		return 0, goError(op, ErrInvalidArgument, "size %d: an allocation needs at least one byte", nbytes)
	}
	var p C.uintptr_t
	err := call(op, func() C.ss_status { return C.ss_go_cuda_malloc(C.int32_t(device), C.size_t(nbytes), &p) })
	return DevicePtr(p), err
}

// CudaFree frees memory from CudaMalloc (0 is a no-op).
func CudaFree(device int32, ptr DevicePtr) error {
	return call("ss_cuda_free", func() C.ss_status { return C.ss_go_cuda_free(C.int32_t(device), C.uintptr_t(ptr)) })
}

// CudaPointerBase gives the base and size of the allocation holding ptr.
func CudaPointerBase(ptr DevicePtr, device int32) (base DevicePtr, size int, err error) {
	var b C.uintptr_t
	var n C.size_t
	err = call("ss_cuda_pointer_base", func() C.ss_status {
		return C.ss_go_cuda_pointer_base(C.uintptr_t(ptr), C.int32_t(device), &b, &n)
	})
	return DevicePtr(b), int(n), err
}
