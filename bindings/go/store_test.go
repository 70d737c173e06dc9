package storagesharing

import (
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestTorchFileStoreRemovedByItsLastUser(t *testing.T) {
	path := t.TempDir() + "/torch_store"
	a, err := OpenTorchFileStore(path, 2, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	b, err := OpenTorchFileStore(path, 2, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Set("k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	if got, err := b.Get("k", time.Second); err != nil || string(got) != "v" {
		t.Fatalf("get through the second store: %v, %q", err, got)
	}
	a.Close()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("one user left, the file must stay: %v", err)
	}
	b.Close()
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("the last of 2 users closed, the file must be gone: %v", err)
	}
	if _, err := OpenTorchFileStore(path, -2, time.Second); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("world size -2: %v", err)
	}
}

func TestFileStoreShared(t *testing.T) {
	dir := t.TempDir() + "/store"
	a, err := OpenFileStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := OpenFileStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	big := []byte(strings.Repeat("0123456789", 100))
	if err := a.Set("grp/0/0", big); err != nil {
		t.Fatal(err)
	}
	got, err := b.Get("grp/0/0", time.Second)
	if err != nil || string(got) != string(big) {
		t.Fatalf("get through a second store: %v, %d bytes", err, len(got))
	}
	for i := 0; i < 3; i++ {
		if _, err := a.Add("n", 2); err != nil {
			t.Fatal(err)
		}
	}
	if v, err := b.Add("n", 0); err != nil || v != 6 {
		t.Fatalf("add: %v %v", v, err)
	}
	err = b.Wait([]string{"grp/0/0", "grp/0/1"}, 30*time.Millisecond)
	if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), `"grp/0/1"`) || strings.Contains(err.Error(), `"grp/0/0"`) {
		t.Fatalf("wait timeout: %v", err)
	}
	if all, err := b.Check([]string{"grp/0/0", "n"}); err != nil || !all {
		t.Fatalf("check of set keys: %v %v", all, err)
	}
	if all, err := b.Check([]string{"grp/0/0", "grp/0/1"}); err != nil || all {
		t.Fatalf("check with a missing key: %v %v", all, err)
	}
	long := strings.Repeat("L", 500)
	if v, err := a.CompareSet("cas", nil, []byte(long)); err != nil || string(v) != long {
		t.Fatalf("compare_set creating: %q %v", v, err)
	}
	// The current value is longer than both arguments: the wrapper asks again.
	if v, err := b.CompareSet("cas", []byte("x"), []byte("y")); err != nil || string(v) != long {
		t.Fatalf("compare_set with a wrong expected value: %d bytes, %v", len(v), err)
	}
	if n, err := b.NumKeys(); err != nil || n != 3 {
		t.Fatalf("num_keys: %v %v", n, err)
	}
	if existed, err := b.DeleteKey("cas"); err != nil || !existed {
		t.Fatalf("delete: %v %v", existed, err)
	}
	if existed, err := a.DeleteKey("cas"); err != nil || existed {
		t.Fatalf("delete again: %v %v", existed, err)
	}
	if _, err := b.Get("x", -time.Second); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("negative timeout: %v", err)
	}
	if _, err := a.TCPPort(); !errors.Is(err, ErrUnsupported) {
		t.Fatalf("file store port: %v", err)
	}
	if err := a.Set("bad\x00key", nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("NUL in key: %v", err)
	}
	f := dir + "/plain-file"
	if err := os.WriteFile(f, []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := OpenFileStore(f); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a regular file as store: %v", err)
	}
	a.Close()
	a.Close()
	if err := a.Set("k", nil); !errors.Is(err, ErrClosed) {
		t.Fatalf("set after close: %v", err)
	}
}

// A stuck holder of the folder's lock (this test, through its own open
// file): writes give up after the lock timeout, and succeed once it goes.
func TestFileStoreLockTimeout(t *testing.T) {
	dir := t.TempDir()
	if _, err := OpenFileStoreWithLockTimeout(dir, -time.Second); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("negative lock timeout: %v", err)
	}
	s, err := OpenFileStoreWithLockTimeout(dir, 200*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	lock, err := os.Open(dir + "/.lock")
	if err != nil {
		t.Fatal(err)
	}
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		t.Fatal(err)
	}
	if err := s.Set("k", []byte("v")); !errors.Is(err, ErrTimeout) {
		t.Fatalf("set while the lock is held: %v", err)
	}
	lock.Close()
	if err := s.Set("k", []byte("v")); err != nil {
		t.Fatalf("set once the lock is free: %v", err)
	}
}

func TestTCPStoreMasterAndClient(t *testing.T) {
	m, err := OpenTCPStore("127.0.0.1", 0, true, 0, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	port, err := m.TCPPort()
	if err != nil || port <= 0 {
		t.Fatalf("port %d: %v", port, err)
	}
	c, err := OpenTCPStore("127.0.0.1", port, false, 0, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	go func() {
		time.Sleep(30 * time.Millisecond)
		_ = c.Set("late", []byte("here"))
	}()
	// A get blocked in one goroutine does not hold up the other's set.
	got, err := m.Get("late", 0)
	if err != nil || string(got) != "here" {
		t.Fatalf("get: %q %v", got, err)
	}
	if err := m.Wait([]string{"late"}, time.Second); err != nil {
		t.Fatal(err)
	}
	_, err = c.Get("never", 50*time.Millisecond)
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	if !errors.Is(err, ErrTimeout) || !strings.Contains(err.Error(), `"never"`) || !strings.Contains(err.Error(), addr) {
		t.Fatalf("timeout: %v", err)
	}
	// The port is taken: a second master is ErrBusy, naming it.
	if _, err := OpenTCPStore("127.0.0.1", port, true, 0, time.Second); !errors.Is(err, ErrBusy) || !strings.Contains(err.Error(), addr) {
		t.Fatalf("second master: %v", err)
	}
	// Nobody listens: the client gives up after its timeout.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	free := l.Addr().(*net.TCPAddr).Port
	l.Close()
	if _, err := OpenTCPStore("127.0.0.1", free, false, 0, 100*time.Millisecond); !errors.Is(err, ErrTimeout) {
		t.Fatalf("no server: %v", err)
	}
}
