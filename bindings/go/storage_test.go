package storagesharing

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

func fillPattern(b []byte) {
	for i := range b {
		b[i] = pattern(i)
	}
}

func TestStorageRefsWeakAndResize(t *testing.T) {
	s, err := NewStorage(1000)
	if err != nil {
		t.Fatal(err)
	}
	if s.Len() != 1000 || s.IsShared() || !bytes.Equal(s.Bytes(), make([]byte, 1000)) {
		t.Fatalf("new storage: len %d shared %v", s.Len(), s.IsShared())
	}
	r, err := s.Ref()
	if err != nil {
		t.Fatal(err)
	}
	w, err := s.Weak()
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	s.Bytes()[3] = 9
	if r.Bytes()[3] != 9 || w.Expired() {
		t.Fatal("a second reference does not see the same bytes")
	}
	if err := s.Resize(10); err != nil || r.Len() != 10 {
		t.Fatalf("resize: %v, len %d", err, r.Len())
	}
	s.Close()
	s.Close()
	if s.Bytes() != nil || s.Len() != 0 {
		t.Fatal("a closed storage still shows bytes")
	}
	if _, err := s.Ref(); !errors.Is(err, ErrClosed) {
		t.Fatalf("Ref after Close: %v", err)
	}
	u, err := w.Upgrade()
	if err != nil || u.Bytes()[3] != 9 {
		t.Fatalf("upgrade while r lives: %v", err)
	}
	u.Close()
	r.Close()
	if !w.Expired() {
		t.Fatal("weak reference alive after the last strong one closed")
	}
	if _, err := w.Upgrade(); !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "ss_weak_upgrade") {
		t.Fatalf("upgrade of an expired reference: %v", err)
	}
}

func TestStorageErrors(t *testing.T) {
	heap, err := NewStorage(64)
	if err != nil {
		t.Fatal(err)
	}
	defer heap.Close()
	if err := heap.SharedIncref(); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("incref of a heap storage: %v", err)
	}
	if _, err := heap.SharedFD(); !errors.Is(err, ErrNotFound) {
		t.Fatalf("SharedFD of a heap storage: %v", err)
	}
	empty, _ := NewStorage(0)
	defer empty.Close()
	if _, _, err := empty.ShareFD(); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("sharing 0 bytes: %v", err)
	}
	if _, err := OpenSharedFilename(SharedFilename{Name: "/torch_1\x002", NBytes: 10}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a name with a NUL byte: %v", err)
	}
	_, err = OpenSharedFilename(SharedFilename{Manager: "/nonexistent/manager.sock", Name: "/torch_1_2_3", NBytes: 10})
	if !errors.Is(err, ErrNotFound) || !strings.Contains(err.Error(), "/nonexistent/manager.sock") {
		t.Fatalf("unreachable manager: %v", err)
	}
	if _, err := NewStorage(-1); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("negative size: %v", err)
	}
	fdb, err := NewStorageUsingFD(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer fdb.Close()
	if err := fdb.Resize(1); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("resize of a shared storage: %v", err)
	}
	fd, err := fdb.SharedFD()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := OpenSharedFD(fd, 1<<20); !errors.Is(err, ErrSizeMismatch) {
		t.Fatalf("opening more bytes than the segment has: %v", err)
	}
	if err := SendFDs(fd, nil, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("empty payload: %v", err)
	}
	if err := SendFDs(fd, []byte("x"), make([]int, 254)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("254 descriptors: %v", err)
	}
}

// Two descriptors to a receiver with room for one: ErrBufferTooSmall, and
// neither is left open here.
func TestRecvFDsTooManyLeavesNothingOpen(t *testing.T) {
	sv, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Close(sv[0])
	defer syscall.Close(sv[1])
	if err := SendFDs(sv[0], []byte("x"), []int{sv[0], sv[1]}); err != nil {
		t.Fatal(err)
	}
	probe, _ := syscall.Dup(0)
	syscall.Close(probe) // the lowest free number: a leaked descriptor would take it
	if _, _, err := RecvFDs(sv[1], 8, 1); !errors.Is(err, ErrBufferTooSmall) {
		t.Fatalf("two descriptors for room for one: %v", err)
	}
	again, _ := syscall.Dup(0)
	syscall.Close(again)
	if again != probe {
		t.Fatalf("a received descriptor was left open (next free %d, was %d)", again, probe)
	}
	syscall.Close(sv[0])
	if msg, fds, err := RecvFDs(sv[1], 8, 1); err != nil || len(msg) != 0 || len(fds) != 0 {
		t.Fatalf("after the peer closed: %q %v %v", msg, fds, err)
	}
}

// startHelper runs this test binary as the second process with a socket
// at its fd 3; the returned function waits for it and fails the test if
// it failed.
func startHelper(t *testing.T, mode string) (sock int, wait func()) {
	t.Helper()
	sv, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	theirs := os.NewFile(uintptr(sv[1]), "helper socket")
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnv+"="+mode)
	cmd.ExtraFiles = []*os.File{theirs}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	theirs.Close()
	return sv[0], func() {
		t.Helper()
		err := cmd.Wait()
		syscall.Close(sv[0])
		if err != nil {
			t.Fatalf("helper %q: %v\n%s", mode, err, out.String())
		}
	}
}

func ack(sock int) error { return SendFDs(sock, []byte("k"), nil) }

func waitAck(sock int) error {
	msg, _, err := RecvFDs(sock, 4, 0)
	if err == nil && string(msg) != "k" {
		err = fmt.Errorf("got %q instead of the acknowledgement", msg)
	}
	return err
}

func checkFirstHalf(b []byte) error {
	if len(b) != sharedSize {
		return fmt.Errorf("%d bytes, wanted %d", len(b), sharedSize)
	}
	for i := 0; i < sharedSize/2; i++ {
		if b[i] != pattern(i) {
			return fmt.Errorf("byte %d is %d, wanted %d", i, b[i], pattern(i))
		}
	}
	return nil
}

func writeSecondHalf(b []byte) {
	for i := sharedSize / 2; i < sharedSize; i++ {
		b[i] = ^pattern(i)
	}
}

func secondHalfWritten(b []byte) error {
	for i := sharedSize / 2; i < sharedSize; i++ {
		if b[i] != ^pattern(i) {
			return fmt.Errorf("byte %d is %d after the peer wrote %d", i, b[i], ^pattern(i))
		}
	}
	return nil
}

// storageHelper is the second process's part of the Storage tests; the
// socket to the test is fd 3.
func storageHelper(mode string) error {
	const sock = 3
	switch mode {
	case "storage-fd-recv": // receives (size, fd), checks, answers in the second half
		msg, fds, err := RecvFDs(sock, 32, 1)
		if err != nil {
			return err
		}
		if len(fds) != 1 {
			return fmt.Errorf("%d descriptors, wanted 1", len(fds))
		}
		n, _ := strconv.Atoi(string(msg))
		s, err := OpenSharedFD(fds[0], n)
		syscall.Close(fds[0]) // the storage mapped a duplicate
		if err != nil {
			return err
		}
		defer s.Close()
		if err := checkFirstHalf(s.Bytes()); err != nil {
			return err
		}
		writeSecondHalf(s.Bytes())
		return ack(sock)
	case "storage-fd-send": // makes the storage and sends its fd
		s, err := NewStorageUsingFD(sharedSize)
		if err != nil {
			return err
		}
		defer s.Close()
		fillPattern(s.Bytes()[:sharedSize/2])
		fd, err := s.SharedFD()
		if err != nil {
			return err
		}
		if err := SendFDs(sock, []byte(strconv.Itoa(sharedSize)), []int{fd}); err != nil {
			return err
		}
		if err := waitAck(sock); err != nil {
			return err
		}
		return secondHalfWritten(s.Bytes())
	case "storage-name-send": // shares by name with a reference in flight
		s, err := NewStorage(sharedSize)
		if err != nil {
			return err
		}
		defer s.Close()
		fillPattern(s.Bytes()[:sharedSize/2])
		shared, err := s.ShareFilename()
		if err != nil {
			return err
		}
		if err := s.SharedIncref(); err != nil {
			return err
		}
		msg := fmt.Sprintf("%s\n%s\n%d", shared.Manager, shared.Name, shared.NBytes)
		if err := SendFDs(sock, []byte(msg), nil); err != nil {
			return err
		}
		if err := waitAck(sock); err != nil {
			return err
		}
		if n, err := s.SharedRefcount(); err != nil || n != 2 {
			return fmt.Errorf("refcount %d with the parent holding it: %v", n, err)
		}
		return secondHalfWritten(s.Bytes())
	}
	if strings.HasPrefix(mode, "storage-name-open:") {
		arg := strings.TrimPrefix(mode, "storage-name-open:")
		var shared SharedFilename
		parts := strings.Split(arg, "\n")
		if len(parts) != 3 {
			return fmt.Errorf("bad mode %q", mode)
		}
		shared.Manager, shared.Name = parts[0], parts[1]
		shared.NBytes, _ = strconv.Atoi(parts[2])
		s, err := OpenSharedFilename(shared)
		if err != nil {
			return err
		}
		defer s.Close()
		if err := s.SharedDecref(); err != nil {
			return err
		}
		if n, err := s.SharedRefcount(); err != nil || n != 2 {
			return fmt.Errorf("refcount %d after cancelling the sender's: %v", n, err)
		}
		if err := checkFirstHalf(s.Bytes()); err != nil {
			return err
		}
		writeSecondHalf(s.Bytes())
		return nil
	}
	if strings.HasPrefix(mode, "arena-") {
		return arenaHelper(mode)
	}
	if strings.HasPrefix(mode, "cuda-open:") {
		return cudaHelper(strings.TrimPrefix(mode, "cuda-open:"))
	}
	return fmt.Errorf("unknown mode %q", mode)
}

func TestStorageShareFDToChild(t *testing.T) {
	s, err := NewStorage(sharedSize)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	fillPattern(s.Bytes()[:sharedSize/2])
	fd, n, err := s.ShareFD()
	if err != nil || n != sharedSize || !s.IsShared() {
		t.Fatalf("ShareFD: fd %d n %d shared %v: %v", fd, n, s.IsShared(), err)
	}
	sock, wait := startHelper(t, "storage-fd-recv")
	if err := SendFDs(sock, []byte(strconv.Itoa(n)), []int{fd}); err != nil {
		t.Fatal(err)
	}
	if err := waitAck(sock); err != nil {
		t.Fatal(err)
	}
	wait()
	if err := secondHalfWritten(s.Bytes()); err != nil {
		t.Fatal(err)
	}
	var st syscall.Stat_t
	if err := syscall.Fstat(fd, &st); err != nil {
		t.Fatalf("the storage's fd was closed by sending it: %v", err)
	}
}

func TestStorageShareFDFromChild(t *testing.T) {
	sock, wait := startHelper(t, "storage-fd-send")
	msg, fds, err := RecvFDs(sock, 32, 1)
	if err != nil || len(fds) != 1 {
		t.Fatalf("receive: %v, %d fds", err, len(fds))
	}
	n, _ := strconv.Atoi(string(msg))
	s, err := OpenSharedFD(fds[0], n)
	syscall.Close(fds[0])
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := checkFirstHalf(s.Bytes()); err != nil {
		t.Fatal(err)
	}
	writeSecondHalf(s.Bytes())
	if err := ack(sock); err != nil {
		t.Fatal(err)
	}
	wait()
}

func TestStorageShareFilenameToChild(t *testing.T) {
	s, err := NewStorage(sharedSize)
	if err != nil {
		t.Fatal(err)
	}
	fillPattern(s.Bytes()[:sharedSize/2])
	shared, err := s.ShareFilename()
	if err != nil || shared.NBytes != sharedSize || !strings.HasPrefix(shared.Name, "/torch_") {
		t.Fatalf("ShareFilename: %+v, %v", shared, err)
	}
	if !segmentExists(t, shared.Name) {
		t.Fatalf("%s is not in /dev/shm", shared.Name)
	}
	if err := s.SharedIncref(); err != nil { // in flight
		t.Fatal(err)
	}
	_, wait := startHelper(t, fmt.Sprintf("storage-name-open:%s\n%s\n%d", shared.Manager, shared.Name, shared.NBytes))
	wait()
	if err := secondHalfWritten(s.Bytes()); err != nil {
		t.Fatal(err)
	}
	closeLastHolder(t, s, shared.Name)
}

func TestStorageShareFilenameFromChild(t *testing.T) {
	sock, wait := startHelper(t, "storage-name-send")
	msg, _, err := RecvFDs(sock, 256, 0)
	if err != nil {
		t.Fatal(err)
	}
	parts := strings.Split(string(msg), "\n")
	if len(parts) != 3 {
		t.Fatalf("message %q", msg)
	}
	n, _ := strconv.Atoi(parts[2])
	shared := SharedFilename{Manager: parts[0], Name: parts[1], NBytes: n}
	s, err := OpenSharedFilename(shared)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.SharedDecref(); err != nil {
		t.Fatal(err)
	}
	if err := checkFirstHalf(s.Bytes()); err != nil {
		t.Fatal(err)
	}
	writeSecondHalf(s.Bytes())
	if err := ack(sock); err != nil {
		t.Fatal(err)
	}
	wait()
	closeLastHolder(t, s, shared.Name)
}

func TestSpawnManager(t *testing.T) {
	path, err := SpawnManager()
	if err != nil || !strings.HasSuffix(path, "manager.sock") {
		t.Fatalf("SpawnManager: %q, %v", path, err)
	}
	s, err := NewStorageUsingFilename(100)
	if err != nil {
		t.Fatal(err)
	}
	shared, err := s.ShareFilename()
	if err != nil {
		t.Fatal(err)
	}
	shared.Manager = path
	r, err := OpenSharedFilename(shared)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := r.SharedRefcount(); err != nil || n != 2 {
		t.Fatalf("refcount %d: %v", n, err)
	}
	r.Close()
	s.Close()
	if segmentExists(t, shared.Name) {
		t.Fatalf("%s left in /dev/shm", shared.Name)
	}
	if err := SetManagerBinary(""); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("an empty manager path: %v", err)
	}
	if err := SetManagerBinary("/bin/x\x00y"); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a path with a NUL byte: %v", err)
	}
}

// A Storage nobody closed is freed by its finalizer: the segments of
// forgotten storages shared by name disappear under forced collections.
func TestFinalizerFreesForgottenStorages(t *testing.T) {
	names := make([]string, 4)
	func() {
		for i := range names {
			s, err := NewStorageUsingFilename(4096)
			if err != nil {
				t.Fatal(err)
			}
			shared, err := s.ShareFilename()
			if err != nil {
				t.Fatal(err)
			}
			names[i] = shared.Name
		}
	}()
	waitFinalized(t, names, "forgotten storages still have segments")
}

// closeLastHolder checks that s is the last holder of the segment name
// (count 1 after the child closed), closes it, and checks the name is gone.
func closeLastHolder(t *testing.T, s *Storage, name string) {
	t.Helper()
	if n, err := s.SharedRefcount(); err != nil || n != 1 {
		t.Fatalf("refcount %d after the child closed: %v", n, err)
	}
	s.Close()
	if segmentExists(t, name) {
		t.Fatalf("%s left in /dev/shm", name)
	}
}
