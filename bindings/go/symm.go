package storagesharing

/*
#include <stdlib.h>
#include <storage_sharing.h>
*/
import "C"

import (
	"time"
	"unsafe"
)

// Device types of symmetric blocks, with the C header's values.
const (
	DeviceCPU  = int(C.SS_DEVICE_CPU)
	DeviceCUDA = int(C.SS_DEVICE_CUDA)
)

// timeoutMS turns a Go timeout into the C API's milliseconds (0 waits
// forever); a negative one is an error.
func timeoutMS(op string, d time.Duration) (C.int64_t, error) {
	if d < 0 {
		return 0, goError(op, ErrInvalidArgument, "timeout %v is negative", d)
	}
	ms := d.Milliseconds()
	if d > 0 && ms == 0 {
		ms = 1 // below a millisecond would mean "forever"
	}
	return C.int64_t(ms), nil
}

// optGroup copies a group name for C; "" means none (NULL).
func optGroup(op, group string) (*C.char, error) {
	if group == "" {
		return nil, nil
	}
	return cString(op, "group", group)
}

// SymmSetGroupInfoFile registers group: this process is rank of worldSize,
// and the ranks meet through the file store in folder storeDir (shared by
// the processes of one host; use a fresh folder per job). A second call for
// the same group name fails with ErrAlreadyExists, as in PyTorch.
func SymmSetGroupInfoFile(group string, rank, worldSize int, storeDir string) error {
	const op = "ss_symm_set_group_info"
	g, err := cString(op, "group", group)
	if err != nil {
		return err
	}
	defer freeCString(g)
	d, err := cString("ss_store_file_open", "path", storeDir)
	if err != nil {
		return err
	}
	defer freeCString(d)
	var store *C.ss_store
	if err := call("ss_store_file_open", func() C.ss_status { return C.ss_store_file_open(d, &store) }); err != nil {
		return err
	}
	// The group keeps its own reference to the store.
	defer C.ss_store_free(store)
	return call(op, func() C.ss_status { return C.ss_symm_set_group_info(g, C.int(rank), C.int(worldSize), store) })
}

// SymmSetGroupInfo registers group: this process is rank of worldSize, and
// the ranks meet through store (a file store, a TCPStore, ...). The group
// keeps its own reference to the store, so the caller may Close it at any
// time. A second call for the same group name fails with ErrAlreadyExists,
// as in PyTorch; a nil store with ErrNullPointer.
func SymmSetGroupInfo(group string, rank, worldSize int, store *Store) error {
	const op = "ss_symm_set_group_info"
	if store == nil {
		return goError(op, ErrNullPointer, "store is nil")
	}
	g, err := cString(op, "group", group)
	if err != nil {
		return err
	}
	defer freeCString(g)
	return store.with(op, func(h *C.ss_store) C.ss_status {
		return C.ss_symm_set_group_info(g, C.int(rank), C.int(worldSize), h)
	})
}

// SymmGetGroupInfo is this process's rank and the world size of group.
func SymmGetGroupInfo(group string) (rank, worldSize int, err error) {
	const op = "ss_symm_get_group_info"
	g, err := cString(op, "group", group)
	if err != nil {
		return 0, 0, err
	}
	defer freeCString(g)
	var r, ws C.int
	err = call(op, func() C.ss_status { return C.ss_symm_get_group_info(g, &r, &ws) })
	return int(r), int(ws), err
}

// SymmSetBackend chooses the allocation backend by name ("CPU"); after the
// first allocation it fails with ErrBusy ("Backend can not be changed after use.").
func SymmSetBackend(name string) error {
	const op = "ss_symm_set_backend"
	n, err := cString(op, "name", name)
	if err != nil {
		return err
	}
	defer freeCString(n)
	return call(op, func() C.ss_status { return C.ss_symm_set_backend(n) })
}

// SymmGetSignalPadSize is the signal pad size, in bytes, of the blocks
// allocated from now on (default 9216).
func SymmGetSignalPadSize() (int, error) {
	var n C.size_t
	err := call("ss_symm_get_signal_pad_size", func() C.ss_status { return C.ss_symm_get_signal_pad_size(&n) })
	return int(n), err
}

// SymmSetSignalPadSize sets the signal pad size of the blocks to come: a
// positive multiple of 4 (else ErrInvalidArgument), before the process's
// first allocation (else ErrBusy). Every rank sets the same size.
func SymmSetSignalPadSize(size int) error {
	const op = "ss_symm_set_signal_pad_size"
	if size < 0 {
		return goError(op, ErrInvalidArgument, "size %d is negative", size)
	}
	return call(op, func() C.ss_status { return C.ss_symm_set_signal_pad_size(C.size_t(size)) })
}

// SymmBlock is one rank's symmetric block. Free it with Free; a block is
// not freed by the garbage collector, as every rank's peers map it.
type SymmBlock struct {
	ptr  unsafe.Pointer
	size int
}

// SymmAlloc allocates a block whose buffer holds size bytes on the device
// (DeviceCPU, device 0; DeviceCUDA, the device ordinal: ErrCudaUnavailable
// where there is no driver or device).
// group ("" for none) is the default group of its rendezvous.
func SymmAlloc(deviceType, deviceIdx, size int, group string) (*SymmBlock, error) {
	return symmAllocWith("ss_symm_alloc", size, group, func(g *C.char, p *unsafe.Pointer) C.ss_status {
		return C.ss_symm_alloc(C.int(deviceType), C.int32_t(deviceIdx), C.size_t(size), g, p)
	})
}

// SymmAllocPersistent is SymmAlloc for the persistent block allocID: once
// the previous use was freed, the same block comes back (ErrBusy while it
// is not freed, ErrSizeMismatch for another size).
func SymmAllocPersistent(deviceType, deviceIdx, size int, group string, allocID uint64) (*SymmBlock, error) {
	return symmAllocWith("ss_symm_alloc_persistent", size, group, func(g *C.char, p *unsafe.Pointer) C.ss_status {
		return C.ss_symm_alloc_persistent(C.int(deviceType), C.int32_t(deviceIdx), C.size_t(size), g, C.uint64_t(allocID), p)
	})
}

// symmAllocWith checks size and group, then runs one of the two C
// allocation calls with the group as a C string (NULL for none).
func symmAllocWith(op string, size int, group string, alloc func(g *C.char, p *unsafe.Pointer) C.ss_status) (*SymmBlock, error) {
	if err := checkLen(op, size); err != nil {
		return nil, err
	}
	g, err := optGroup(op, group)
	if err != nil {
		return nil, err
	}
	defer freeCString(g)
	var p unsafe.Pointer
	if err := call(op, func() C.ss_status { return alloc(g, &p) }); err != nil {
		return nil, err
	}
	return &SymmBlock{ptr: p, size: size}, nil
}

// Ptr is the buffer's address.
func (b *SymmBlock) Ptr() unsafe.Pointer { return b.ptr }

// Bytes is the buffer of a CPU block (valid until Free).
func (b *SymmBlock) Bytes() []byte { return unsafe.Slice((*byte)(b.ptr), b.size) }

// AllocSize is the size asked for at allocation, as the library knows it.
func (b *SymmBlock) AllocSize() (int, error) {
	var n C.size_t
	err := call("ss_symm_get_alloc_size", func() C.ss_status { return C.ss_symm_get_alloc_size(b.ptr, &n) })
	return int(n), err
}

// Free frees the block and its SymmMem objects (a persistent block is kept
// for its next SymmAllocPersistent).
func (b *SymmBlock) Free() error {
	return call("ss_symm_free", func() C.ss_status { return C.ss_symm_free(b.ptr) })
}

// SymmMem is a rendezvoused block: every rank's buffer and signal pad.
// Valid until the block is freed.
type SymmMem struct {
	h *C.ss_symm_mem
}

// Rendezvous meets the other ranks of group ("" for the allocation's
// group); every rank calls it with a block of the same size. timeout 0
// waits forever; ranks that do not come give ErrTimeout naming them.
func (b *SymmBlock) Rendezvous(group string, timeout time.Duration) (*SymmMem, error) {
	const op = "ss_symm_mem_rendezvous"
	ms, err := timeoutMS(op, timeout)
	if err != nil {
		return nil, err
	}
	g, err := optGroup(op, group)
	if err != nil {
		return nil, err
	}
	defer freeCString(g)
	var h *C.ss_symm_mem
	if err := call(op, func() C.ss_status { return C.ss_symm_mem_rendezvous(b.ptr, g, ms, &h) }); err != nil {
		return nil, err
	}
	return &SymmMem{h: h}, nil
}

// Rank is this process's rank in the group.
func (m *SymmMem) Rank() int { return int(C.ss_symm_mem_rank(m.h)) }

// WorldSize is the number of ranks.
func (m *SymmMem) WorldSize() int { return int(C.ss_symm_mem_world_size(m.h)) }

// BufferSize is the usable bytes of each rank's buffer.
func (m *SymmMem) BufferSize() int { return int(C.ss_symm_mem_buffer_size(m.h)) }

// SignalPadSize is the bytes of each rank's signal pad.
func (m *SymmMem) SignalPadSize() int { return int(C.ss_symm_mem_signal_pad_size(m.h)) }

// Buffer is rank's whole buffer as mapped in this process.
func (m *SymmMem) Buffer(rank int) ([]byte, error) {
	var p unsafe.Pointer
	if err := call("ss_symm_mem_buffer_ptr", func() C.ss_status { return C.ss_symm_mem_buffer_ptr(m.h, C.int(rank), &p) }); err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), m.BufferSize()), nil
}

// GetBuffer is nbytes at offset of rank's buffer, with PyTorch's checks
// (ErrInvalidArgument for a bad rank or a range past the buffer).
func (m *SymmMem) GetBuffer(rank, nbytes, offset int) ([]byte, error) {
	const op = "ss_symm_mem_get_buffer"
	if nbytes < 0 || offset < 0 {
		return nil, goError(op, ErrInvalidArgument, "nbytes %d and offset %d must not be negative", nbytes, offset)
	}
	var p unsafe.Pointer
	err := call(op, func() C.ss_status {
		return C.ss_symm_mem_get_buffer(m.h, C.int(rank), C.size_t(nbytes), C.size_t(offset), &p)
	})
	if err != nil {
		return nil, err
	}
	return unsafe.Slice((*byte)(p), nbytes), nil
}

// SignalPad is rank's signal pad (uint32 slots, world_size*channel + src).
func (m *SymmMem) SignalPad(rank int) ([]uint32, error) {
	var p unsafe.Pointer
	if err := call("ss_symm_mem_signal_pad_ptr", func() C.ss_status { return C.ss_symm_mem_signal_pad_ptr(m.h, C.int(rank), &p) }); err != nil {
		return nil, err
	}
	return unsafe.Slice((*uint32)(p), m.SignalPadSize()/4), nil
}

// BufferPtrsDev is a device-readable array of WorldSize buffer addresses
// (PyTorch's get_buffer_ptrs_dev): device memory for a CUDA block, host
// memory for a CPU block. Owned by m.
func (m *SymmMem) BufferPtrsDev() (unsafe.Pointer, error) {
	var p unsafe.Pointer
	err := call("ss_symm_mem_buffer_ptrs_dev", func() C.ss_status { return C.ss_symm_mem_buffer_ptrs_dev(m.h, &p) })
	return p, err
}

// SignalPadPtrsDev is the same array for the signal pads.
func (m *SymmMem) SignalPadPtrsDev() (unsafe.Pointer, error) {
	var p unsafe.Pointer
	err := call("ss_symm_mem_signal_pad_ptrs_dev", func() C.ss_status { return C.ss_symm_mem_signal_pad_ptrs_dev(m.h, &p) })
	return p, err
}

// HasMulticast tells whether the block has a multicast address.
func (m *SymmMem) HasMulticast() bool { return bool(C.ss_symm_mem_has_multicast(m.h)) }

// MulticastPtr is the block's multicast address; ErrUnsupported, with the
// reason, where there is none.
func (m *SymmMem) MulticastPtr() (unsafe.Pointer, error) {
	var p unsafe.Pointer
	err := call("ss_symm_mem_multicast_ptr", func() C.ss_status { return C.ss_symm_mem_multicast_ptr(m.h, &p) })
	return p, err
}

// Barrier signals every other rank on channel, then waits for each.
func (m *SymmMem) Barrier(channel int, timeout time.Duration) error {
	const op = "ss_symm_mem_barrier"
	ms, err := timeoutMS(op, timeout)
	if err != nil {
		return err
	}
	return call(op, func() C.ss_status { return C.ss_symm_mem_barrier(m.h, C.int(channel), ms, nil) })
}

// PutSignal signals rank dst on channel.
func (m *SymmMem) PutSignal(dst, channel int, timeout time.Duration) error {
	const op = "ss_symm_mem_put_signal"
	ms, err := timeoutMS(op, timeout)
	if err != nil {
		return err
	}
	return call(op, func() C.ss_status { return C.ss_symm_mem_put_signal(m.h, C.int(dst), C.int(channel), ms, nil) })
}

// WaitSignal waits for and consumes the signal of rank src on channel.
func (m *SymmMem) WaitSignal(src, channel int, timeout time.Duration) error {
	const op = "ss_symm_mem_wait_signal"
	ms, err := timeoutMS(op, timeout)
	if err != nil {
		return err
	}
	return call(op, func() C.ss_status { return C.ss_symm_mem_wait_signal(m.h, C.int(src), C.int(channel), ms, nil) })
}
