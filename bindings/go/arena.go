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

// ArenaOptions sets up an Arena; start from DefaultArenaOptions.
type ArenaOptions struct {
	SegmentSize    int  // bytes of data per segment of small blocks
	ByName         bool // named /dev/shm segments instead of memfds sent by fd
	MaxHolds       int  // shares in flight or held at once, per segment
	LargeThreshold int  // blocks above this get a segment of their own
}

// DefaultArenaOptions gives the library's defaults (64 MiB segments by fd,
// 4096 holds per segment, blocks above 1 MiB in their own segment).
func DefaultArenaOptions() ArenaOptions {
	var o C.ss_arena_options
	C.ss_arena_options_default(&o)
	return ArenaOptions{
		SegmentSize:    int(o.segment_size),
		ByName:         o.strategy == C.SS_ARENA_BY_NAME,
		MaxHolds:       int(o.max_holds),
		LargeThreshold: int(o.large_threshold),
	}
}

// Arena is a producer's shareable CPU arena (ss_arena): blocks born in
// shared memory, shared in O(1). Its methods may be called from several
// goroutines; Close waits for calls in progress.
type Arena struct {
	mu sync.RWMutex
	h  *C.ss_arena // nil once closed
}

// ArenaHandle is a shared block (ss_arena_handle): plain bytes to send to
// the process that opens it (once) with OpenRemote.
type ArenaHandle struct{ c C.ss_arena_handle }

// ArenaHandleSize is the number of bytes of ArenaHandle.Bytes.
const ArenaHandleSize = int(C.sizeof_ss_arena_handle)

// Bytes is the handle as the C struct's bytes.
func (h *ArenaHandle) Bytes() []byte { return C.GoBytes(unsafe.Pointer(&h.c), C.int(ArenaHandleSize)) }

// ArenaHandleFromBytes reads a handle written by Bytes (or by a C peer).
func ArenaHandleFromBytes(b []byte) (ArenaHandle, error) {
	var h ArenaHandle
	if len(b) != ArenaHandleSize {
		return h, goError("ArenaHandleFromBytes", ErrSizeMismatch, "an arena handle is %d bytes, got %d", ArenaHandleSize, len(b))
	}
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&h.c)), ArenaHandleSize), b)
	return h, nil
}

// SegmentID is the segment the block lives in (for SegmentFD).
func (h *ArenaHandle) SegmentID() uint64 { return uint64(h.c.segment_id) }

// Size is the block's size in bytes.
func (h *ArenaHandle) Size() int { return int(h.c.size) }

// OpenArena makes an arena with opts (nil: the defaults).
func OpenArena(opts *ArenaOptions) (*Arena, error) {
	const op = "ss_arena_open"
	var co *C.ss_arena_options
	if opts != nil {
		strategy := C.uint32_t(C.SS_ARENA_BY_FD)
		if opts.ByName {
			strategy = C.SS_ARENA_BY_NAME
		}
		for _, v := range []int{opts.SegmentSize, opts.MaxHolds, opts.LargeThreshold} {
			if v < 0 || v > 1<<40 {
				return nil, goError(op, ErrInvalidArgument, "option %d out of range", v)
			}
		}
		co = &C.ss_arena_options{struct_size: C.sizeof_ss_arena_options, segment_size: C.size_t(opts.SegmentSize), strategy: strategy,
			max_holds: C.uint32_t(opts.MaxHolds), large_threshold: C.size_t(opts.LargeThreshold)}
	}
	var h *C.ss_arena
	if err := call(op, func() C.ss_status { return C.ss_arena_open(co, &h) }); err != nil {
		return nil, err
	}
	a := &Arena{h: h}
	runtime.SetFinalizer(a, (*Arena).Close)
	return a, nil
}

// Close releases the arena handle; blocks stay valid until freed.
func (a *Arena) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.h != nil {
		C.ss_arena_close(a.h)
		a.h = nil
	}
	return nil
}

func (a *Arena) with(op string, f func(h *C.ss_arena) C.ss_status) error {
	a.mu.RLock()
	defer a.mu.RUnlock()
	if a.h == nil {
		return goError(op, ErrClosed, "the arena was closed")
	}
	return call(op, func() C.ss_status { return f(a.h) })
}

func blockPtr(op string, b []byte) (unsafe.Pointer, error) {
	if len(b) == 0 {
		return nil, goError(op, ErrInvalidArgument, "empty block")
	}
	return unsafe.Pointer(&b[0]), nil
}

// Alloc gives a block of size bytes aligned to align (a power of two, at
// most 4096) in shared memory, as a slice over it.
func (a *Arena) Alloc(size, align int) ([]byte, error) {
	const op = "ss_arena_alloc"
	if size < 0 || align < 0 {
		return nil, goError(op, ErrInvalidArgument, "size %d / align %d is negative", size, align)
	}
	var p unsafe.Pointer
	if err := a.with(op, func(h *C.ss_arena) C.ss_status { return C.ss_arena_alloc(h, C.size_t(size), C.size_t(align), &p) }); err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), size), nil
}

// Free frees a block from Alloc (b must start where Alloc's slice did).
func (a *Arena) Free(b []byte) error {
	const op = "ss_arena_dealloc"
	p, err := blockPtr(op, b)
	if err != nil {
		return err
	}
	return a.with(op, func(h *C.ss_arena) C.ss_status { return C.ss_arena_dealloc(h, p) })
}

// Share takes one hold on the block and returns its handle (no copy).
func (a *Arena) Share(b []byte) (ArenaHandle, error) {
	const op = "ss_arena_share"
	var out ArenaHandle
	p, err := blockPtr(op, b)
	if err != nil {
		return out, err
	}
	err = a.with(op, func(h *C.ss_arena) C.ss_status { return C.ss_arena_share(h, p, &out.c) })
	return out, err
}

// Unshare cancels a share whose handle will never be opened.
func (a *Arena) Unshare(hd ArenaHandle) error {
	return a.with("ss_arena_unshare", func(h *C.ss_arena) C.ss_status { return C.ss_arena_unshare(h, &hd.c) })
}

// SegmentFD is the descriptor of a by-fd segment, owned by the arena.
func (a *Arena) SegmentFD(segmentID uint64) (int, error) {
	var fd C.int
	err := a.with("ss_arena_segment_fd", func(h *C.ss_arena) C.ss_status { return C.ss_arena_segment_fd(h, C.uint64_t(segmentID), &fd) })
	return int(fd), err
}

// Collect reclaims the holds of dead consumers; it returns how many holds
// it released and how many freed blocks became reusable.
func (a *Arena) Collect() (reclaimed, recycled int, err error) {
	var r, c C.size_t
	err = a.with("ss_arena_collect", func(h *C.ss_arena) C.ss_status { return C.ss_arena_collect(h, &r, &c) })
	return int(r), int(c), err
}

// ArenaStats counts an arena's segments and blocks.
type ArenaStats struct{ Segments, LiveBlocks, DeferredBlocks, SegmentBytes int }

// Stats gives the arena's counts.
func (a *Arena) Stats() (ArenaStats, error) {
	var s C.ss_arena_stats
	err := a.with("ss_arena_stats_get", func(h *C.ss_arena) C.ss_status { return C.ss_arena_stats_get(h, &s) })
	return ArenaStats{int(s.segments), int(s.live_blocks), int(s.deferred_blocks), int(s.segment_bytes)}, err
}

// Send shares the block and sends it over the Unix socket sock, with the
// segment's descriptor the first time that segment goes to this peer.
func (a *Arena) Send(sock int, b []byte) error {
	const op = "ss_arena_send"
	p, err := blockPtr(op, b)
	if err != nil {
		return err
	}
	return a.with(op, func(h *C.ss_arena) C.ss_status { return C.ss_arena_send(h, C.int(sock), p) })
}

// NewStorage makes a storage of n bytes in a new block of the arena.
func (a *Arena) NewStorage(n int) (*Storage, error) {
	const op = "ss_storage_new_in_arena"
	if err := checkLen(op, n); err != nil {
		return nil, err
	}
	var s *C.ss_storage
	if err := a.with(op, func(h *C.ss_arena) C.ss_status { return C.ss_storage_new_in_arena(h, C.size_t(n), &s) }); err != nil {
		return nil, err
	}
	return wrapStorage(s), nil
}

// ArenaView is a consumer's view of a shared block (ss_arena_view); it
// keeps the block from being reused until Close.
type ArenaView struct {
	mu sync.Mutex
	h  *C.ss_arena_view
}

func wrapView(h *C.ss_arena_view) *ArenaView {
	v := &ArenaView{h: h}
	runtime.SetFinalizer(v, (*ArenaView).Close)
	return v
}

// ImportSegmentFD maps the segment of a by-fd handle from fd (taken over
// on success).
func ImportSegmentFD(hd ArenaHandle, fd int) error {
	return call("ss_arena_import_segment_fd", func() C.ss_status { return C.ss_arena_import_segment_fd(&hd.c, C.int(fd)) })
}

// OpenRemote opens a block shared by another process (once per handle).
func OpenRemote(hd ArenaHandle) (*ArenaView, error) {
	var v *C.ss_arena_view
	if err := call("ss_arena_view_open", func() C.ss_status { return C.ss_arena_view_open(&hd.c, &v) }); err != nil {
		return nil, err
	}
	return wrapView(v), nil
}

// ArenaRecv receives a block sent with Arena.Send and opens it.
func ArenaRecv(sock int) (*ArenaView, error) {
	var v *C.ss_arena_view
	if err := call("ss_arena_recv", func() C.ss_status { return C.ss_arena_recv(C.int(sock), &v) }); err != nil {
		return nil, err
	}
	return wrapView(v), nil
}

// Bytes is the viewed block (valid until Close); nil once closed.
func (v *ArenaView) Bytes() []byte {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.h == nil {
		return nil
	}
	return unsafe.Slice((*byte)(C.ss_arena_view_data(v.h)), int(C.ss_arena_view_size(v.h)))
}

// Close releases the view's hold.
func (v *ArenaView) Close() error {
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.h != nil {
		C.ss_arena_view_free(v.h)
		v.h = nil
	}
	return nil
}
