package storagesharing

import (
	"encoding"
	"errors"
	"strings"
	"testing"
)

var _ encoding.TextMarshaler = CudaIPCHandle{}
var _ encoding.TextUnmarshaler = (*CudaIPCHandle)(nil)

func TestCudaHandleText(t *testing.T) {
	h := CudaIPCHandle{Device: 1, SizeBytes: 4096, OffsetBytes: 512, RefCounterHandle: "/torch_1_2_3",
		RefCounterOffset: 7, EventSyncRequired: true}
	for i := 0; i < 66; i++ {
		h.MemHandle = append(h.MemHandle, byte(i))
	}
	h.EventHandle[63] = 0xAB
	text, err := h.MarshalText()
	if err != nil {
		t.Fatal(err)
	}
	var back CudaIPCHandle
	if err := back.UnmarshalText(text); err != nil {
		t.Fatal(err)
	}
	if back.Device != 1 || string(back.MemHandle) != string(h.MemHandle) || back.SizeBytes != 4096 ||
		back.OffsetBytes != 512 || back.RefCounterHandle != h.RefCounterHandle || back.RefCounterOffset != 7 ||
		back.EventHandle != h.EventHandle || !back.EventSyncRequired {
		t.Fatalf("round trip through %q gave %+v", text, back)
	}
	if err := back.UnmarshalText([]byte("not a tuple")); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("bad text: %v", err)
	}
	h.MemHandle = make([]byte, 67)
	if _, err := h.MarshalText(); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("67-byte memory handle: %v", err)
	}
	h.MemHandle, h.RefCounterHandle = nil, "/"+strings.Repeat("x", 63)
	if _, err := h.MarshalText(); !errors.Is(err, ErrNameTooLong) {
		t.Fatalf("64-byte counter name: %v", err)
	}
}

// The counter release a consumer does for a tuple it drops unopened,
// against a PyTorch-layout counter file: needs no GPU.
func TestCudaReleaseIPCCounter(t *testing.T) {
	name := newName(t)
	m, err := OpenRefcounted(name, SharedMem|Exclusive, 10000*8)
	if err != nil {
		t.Fatal(err)
	}
	slot5 := m.Bytes()[5*8 : 6*8]
	slot5[0] = 1 // little-endian int64 1
	if err := CudaReleaseIPCCounter(name, 5); err != nil || slot5[0] != 0 {
		t.Fatalf("release: %v, slot byte %d", err, slot5[0])
	}
	if err := CudaReleaseIPCCounter(name, 5); !errors.Is(err, ErrBadRefcount) {
		t.Fatalf("release below 0: %v", err)
	}
	if err := CudaReleaseIPCCounter(name, 10000); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("slot out of range: %v", err)
	}
	m.Close()
	err = CudaReleaseIPCCounter(name, 0)
	if !errors.Is(err, ErrPeerGone) || !strings.Contains(err.Error(), name) {
		t.Fatalf("release with the file gone: %v", err)
	}
}

func TestCudaUnavailable(t *testing.T) {
	if ok, _ := CudaAvailable(); ok {
		t.Skip("CUDA is available here; TestCudaRoundTrip covers it")
	}
	ok, reason := CudaAvailable()
	if ok || !strings.HasPrefix(reason, "CUDA is not available: ") {
		t.Fatalf("CudaAvailable: %v %q", ok, reason)
	}
	t.Log(reason)
	if _, _, err := CudaDriverInfo(); !errors.Is(err, ErrCudaUnavailable) {
		t.Fatalf("driver info: %v", err)
	}
	if _, _, err := CudaShare(0x1000, 4, 0, 0, nil); !errors.Is(err, ErrCudaUnavailable) {
		t.Fatalf("share: %v", err)
	}
	if _, err := CudaOpen(CudaIPCHandle{}, 0); !errors.Is(err, ErrCudaUnavailable) {
		t.Fatalf("open: %v", err)
	}
	if _, err := CudaMalloc(0, 64); !errors.Is(err, ErrCudaUnavailable) {
		t.Fatalf("malloc: %v", err)
	}
	if _, _, err := CudaPointerBase(0x1000, 0); !errors.Is(err, ErrCudaUnavailable) {
		t.Fatalf("pointer base: %v", err)
	}
	if n, err := CudaIPCCollect(); err != nil || n != 0 || CudaLimboSize() != 0 {
		t.Fatalf("collect: %d %v, limbo %d", n, err, CudaLimboSize())
	}
}

// With a GPU: a second process opens the tuple; the producer sees the
// counter go to 0 and its deleter run once the send is closed.
func TestCudaRoundTrip(t *testing.T) {
	if ok, reason := CudaAvailable(); !ok {
		t.Skip(reason)
	}
	const n = 1 << 20
	ptr, err := CudaMalloc(0, n)
	if err != nil {
		t.Fatal(err)
	}
	defer CudaFree(0, ptr)
	if base, size, err := CudaPointerBase(ptr, 0); err != nil || base != ptr || size < n {
		t.Fatalf("pointer base %x size %d: %v", base, size, err)
	}
	var deleted []DevicePtr
	h, sent, err := CudaShare(ptr, n, 0, 0, func(p DevicePtr) { deleted = append(deleted, p) })
	if err != nil {
		t.Fatal(err)
	}
	if c, err := sent.Counter(); err != nil || c != 1 {
		t.Fatalf("counter %d before the consumer released: %v", c, err)
	}
	text, err := h.MarshalText()
	if err != nil {
		t.Fatal(err)
	}
	_, wait := startHelper(t, "cuda-open:"+string(text))
	wait()
	if c, err := sent.Counter(); err != nil || c != 0 {
		t.Fatalf("counter %d after the consumer released: %v", c, err)
	}
	if limbo, err := sent.Close(); err != nil || limbo {
		t.Fatalf("close: limbo %v, %v", limbo, err)
	}
	if len(deleted) != 1 || deleted[0] != ptr {
		t.Fatalf("deleter calls %v, wanted one with %x", deleted, ptr)
	}
}

// cudaHelper is the consumer process of TestCudaRoundTrip.
func cudaHelper(text string) error {
	var h CudaIPCHandle
	if err := h.UnmarshalText([]byte(text)); err != nil {
		return err
	}
	r, err := CudaOpen(h, 0)
	if err != nil {
		return err
	}
	if r.Len() != 1<<20 || r.Data() == 0 {
		return errors.New("the received storage has the wrong size or no data")
	}
	if err := r.Close(); err != nil {
		return err
	}
	if r.Len() != 0 {
		return errors.New("a closed storage still has a size")
	}
	return nil
}
