package storagesharing

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"strings"
	"testing"
)

func segmentExists(t *testing.T, name string) bool {
	t.Helper()
	_, err := os.Stat("/dev/shm" + name)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("stat /dev/shm%s: %v", name, err)
	}
	return err == nil
}

func newName(t *testing.T) string {
	t.Helper()
	name, err := NewSegmentName()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(name, "/torch_") {
		t.Fatalf("segment name %q does not have ATen's form", name)
	}
	return name
}

func TestVersionMatchesHeader(t *testing.T) {
	if Version() == "" || !strings.Contains(Version(), ".") {
		t.Fatalf("version %q", Version())
	}
}

func TestOpenWriteReopenClose(t *testing.T) {
	name := newName(t)
	a, err := Open(name, SharedMem|Exclusive, 8192)
	if err != nil {
		t.Fatal(err)
	}
	if a.Len() != 8192 || a.FD() != -1 || a.Filename() != name || a.Flags() != SharedMem|Exclusive || a.IsRefcounted() {
		t.Fatalf("accessors: len %d fd %d name %q flags %d", a.Len(), a.FD(), a.Filename(), a.Flags())
	}
	copy(a.Bytes()[100:], "hello")
	b, err := Open(name, SharedMem|NoCreate|KeepFD, 8192)
	if err != nil {
		t.Fatal(err)
	}
	if b.FD() < 0 || string(b.Bytes()[100:105]) != "hello" {
		t.Fatalf("second map: fd %d, bytes %q", b.FD(), b.Bytes()[100:105])
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if err := a.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if a.Bytes() != nil || a.Len() != 0 {
		t.Fatal("a closed map still shows data")
	}
	if segmentExists(t, name) {
		t.Fatalf("%s still exists after the creator closed it (ATen unlinks there)", name)
	}
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestErrorsCarryStatusAndMessage(t *testing.T) {
	name := newName(t)
	_, err := Open(name, SharedMem|NoCreate, 10)
	var e *Error
	if !errors.As(err, &e) || e.Op != "ss_map_open" || !strings.Contains(e.Message, name) {
		t.Fatalf("missing segment: %v", err)
	}
	if !errors.Is(err, ErrNotFound) || !errors.Is(err, fs.ErrNotExist) || errors.Is(err, ErrIO) {
		t.Fatalf("errors.Is does not see NOT_FOUND in %v", err)
	}
	if _, err := Open(name, SharedMem, 0); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("size 0: %v", err)
	}
	if _, err := Open("no_slash", SharedMem, 10); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "'/'") {
		t.Fatalf("name without '/': %v", err)
	}
	m, err := Open(name, SharedMem|Exclusive, 100)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if _, err := Open(name, SharedMem|Exclusive, 100); !errors.Is(err, ErrAlreadyExists) || !errors.Is(err, fs.ErrExist) {
		t.Fatalf("exclusive twice: %v", err)
	}
	if _, err := Open(name, SharedMem|NoCreate, 200); !errors.Is(err, ErrSizeMismatch) {
		t.Fatalf("larger than the segment: %v", err)
	}
	if err := m.Incref(); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("incref of a plain map: %v", err)
	}
	if _, err := ShareMemory(nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("ShareMemory(nil): %v", err)
	}
	if _, err := OpenFD(-1, SharedMem|FromFD, 10); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("OpenFD(-1): %v", err)
	}
	m.Close()
	if _, err := m.Refcount(); !errors.Is(err, ErrClosed) || !errors.Is(err, fs.ErrClosed) {
		t.Fatalf("refcount after close: %v", err)
	}
}

func TestRefcounted(t *testing.T) {
	name := newName(t)
	m, err := OpenRefcounted(name, SharedMem|Exclusive, 1000)
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat("/dev/shm" + name)
	if err != nil || st.Size() != 1000+RefcountHeaderSize {
		t.Fatalf("segment file: %v, size %v", err, st)
	}
	n, err := m.Refcount()
	if err != nil || n != 1 || !m.IsRefcounted() {
		t.Fatalf("refcount %d, %v", n, err)
	}
	if err := m.Incref(); err != nil {
		t.Fatal(err)
	}
	if zero, err := m.Decref(); err != nil || zero {
		t.Fatalf("decref 2 -> 1: zero %v, %v", zero, err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if segmentExists(t, name) {
		t.Fatalf("%s survives its last holder", name)
	}
}

func TestShareMemoryAndOpenFD(t *testing.T) {
	src := bytes.Repeat([]byte("0123456789abcdef"), 40000)
	m, err := ShareMemory(src)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if !bytes.Equal(m.Bytes(), src) || m.FD() < 0 {
		t.Fatal("shared copy differs from the source")
	}
	fd, err := dupFD(m.FD())
	if err != nil {
		t.Fatal(err)
	}
	r, err := OpenFD(fd, SharedMem|NoCreate|KeepFD|FromFD, len(src))
	if err != nil {
		t.Fatal(err)
	}
	r.Bytes()[0] = 'X'
	if m.Bytes()[0] != 'X' {
		t.Fatal("a write through the fd map is not seen by the original")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	z, err := NewFDStorage(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer z.Close()
	if !bytes.Equal(z.Bytes(), make([]byte, 4096)) {
		t.Fatal("NewFDStorage is not zeroed")
	}
}
