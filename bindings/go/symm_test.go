package storagesharing

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
	"unsafe"
)

// Rank 1 of the symmetric-memory test is this test binary again, run with
// SS_GO_SYMM_RANK set to the store folder.
const symmEnv = "SS_GO_SYMM_RANK"

const symmSize = 4096

// symmRank is one rank's part: rendezvous, write own buffer, barrier, read
// the peer's, then rank 0 signals rank 1 after writing into its buffer.
func symmRank(dir string, rank int) error {
	store, err := OpenFileStore(dir)
	if err != nil {
		return err
	}
	err = SymmSetGroupInfo("go", rank, 2, store)
	store.Close() // the group keeps its own reference
	if err != nil {
		return err
	}
	b, err := SymmAlloc(DeviceCPU, 0, symmSize, "go")
	if err != nil {
		return err
	}
	defer b.Free()
	m, err := b.Rendezvous("", 20*time.Second)
	if err != nil {
		return err
	}
	if m.Rank() != rank || m.WorldSize() != 2 || m.BufferSize() != symmSize {
		return fmt.Errorf("rank %d: object says rank %d of %d, %d bytes", rank, m.Rank(), m.WorldSize(), m.BufferSize())
	}
	own := b.Bytes()
	for i := range own {
		own[i] = byte(i*7 + rank)
	}
	if err := m.Barrier(0, 20*time.Second); err != nil {
		return err
	}
	peer := 1 - rank
	theirs, err := m.Buffer(peer)
	if err != nil {
		return err
	}
	for i := range theirs {
		if theirs[i] != byte(i*7+peer) {
			return fmt.Errorf("rank %d: byte %d of rank %d is %d", rank, i, peer, theirs[i])
		}
	}
	if err := m.Barrier(0, 20*time.Second); err != nil {
		return err
	}
	if rank == 0 {
		dst, err := m.GetBuffer(1, 8, 100)
		if err != nil {
			return err
		}
		copy(dst, "hello-go")
		return m.PutSignal(1, 3, 20*time.Second)
	}
	if err := m.WaitSignal(0, 3, 20*time.Second); err != nil {
		return err
	}
	if got := string(own[100:108]); got != "hello-go" {
		return fmt.Errorf("rank 1 got %q", got)
	}
	pad, err := m.SignalPad(1)
	if err != nil {
		return err
	}
	for i, v := range pad {
		if v != 0 {
			return fmt.Errorf("slot %d of the pad is %d after the wait", i, v)
		}
	}
	return nil
}

func TestSymmHelperRank(t *testing.T) {
	dir := os.Getenv(symmEnv)
	if dir == "" {
		t.Skip("only runs as rank 1 of TestSymmTwoRanks")
	}
	if err := symmRank(dir, 1); err != nil {
		fmt.Fprintln(os.Stderr, "rank 1:", err)
		os.Exit(3)
	}
	os.Exit(0)
}

func TestSymmTwoRanks(t *testing.T) {
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^TestSymmHelperRank$", "-test.count=1")
	cmd.Env = append(os.Environ(), symmEnv+"="+dir)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	err := symmRank(dir, 0)
	werr := cmd.Wait()
	if err != nil {
		t.Fatalf("rank 0: %v", err)
	}
	if werr != nil {
		t.Fatalf("rank 1: %v\n%s", werr, out.String())
	}
}

func TestSymmErrors(t *testing.T) {
	if cb, err := SymmAlloc(DeviceCUDA, 0, 64, ""); err == nil {
		cb.Free() // a CUDA device is there
	} else if !errors.Is(err, ErrCudaUnavailable) || !strings.Contains(err.Error(), "CUDA is not available: ") {
		t.Fatalf("CUDA alloc without a device: %v", err)
	}
	if _, _, err := SymmGetGroupInfo("no-such-group"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("unknown group: %v", err)
	}
	dir := t.TempDir()
	if err := SymmSetGroupInfoFile("go-solo", 0, 1, dir); err != nil {
		t.Fatal(err)
	}
	if err := SymmSetGroupInfoFile("go-solo", 0, 1, dir); !errors.Is(err, ErrAlreadyExists) {
		t.Fatalf("second set_group_info: %v", err)
	}
	if err := SymmSetGroupInfo("go-nil", 0, 1, nil); !errors.Is(err, ErrNullPointer) {
		t.Fatalf("nil store: %v", err)
	}
	closed, err := OpenFileStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	if err := SymmSetGroupInfo("go-closed", 0, 1, closed); !errors.Is(err, ErrClosed) {
		t.Fatalf("closed store: %v", err)
	}
	if n, err := SymmGetSignalPadSize(); err != nil || n != 9216 {
		t.Fatalf("signal pad size %d, %v", n, err)
	}
	if err := SymmSetSignalPadSize(6); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("pad size 6: %v", err)
	}
	b, err := SymmAlloc(DeviceCPU, 0, 100, "go-solo")
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	if err := SymmSetSignalPadSize(64); !errors.Is(err, ErrBusy) {
		t.Fatalf("pad size after an allocation: %v", err)
	}
	if n, err := b.AllocSize(); err != nil || n != 100 {
		t.Fatalf("alloc size %d, %v", n, err)
	}
	m, err := b.Rendezvous("", 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Buffer(1); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("rank 1 of 1: %v", err)
	}
	// A CPU block's pointer arrays are host arrays of WorldSize entries.
	if arr, err := m.BufferPtrsDev(); err != nil || *(*unsafe.Pointer)(arr) != b.Ptr() {
		t.Fatalf("buffer pointer array: %v", err)
	}
	if arr, err := m.SignalPadPtrsDev(); err != nil || uintptr(*(*unsafe.Pointer)(arr))+12288 != uintptr(b.Ptr()) {
		t.Fatalf("signal pad pointer array: %v", err)
	}
	if m.HasMulticast() {
		t.Fatal("a CPU block has no multicast")
	}
	if _, err := m.MulticastPtr(); !errors.Is(err, ErrUnsupported) || !strings.Contains(err.Error(), "no multicast") {
		t.Fatalf("multicast pointer: %v", err)
	}
	if _, err := m.GetBuffer(0, 101, 0); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "exceeds the allocated size (100 bytes)") {
		t.Fatalf("get_buffer past the end: %v", err)
	}
	if err := m.WaitSignal(0, 1, 50*time.Millisecond); !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), "on channel 1") {
		t.Fatalf("wait with no signal: %v", err)
	}
	if err := m.Barrier(1<<20, time.Second); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("channel past the pad: %v", err)
	}
}
