package storagesharing

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The second process of the sharing tests is this test binary again, run
// with SS_GO_HELPER set; TestHelperProcess does its part and exits.
const helperEnv = "SS_GO_HELPER"

const sharedSize = 1 << 20

func pattern(i int) byte { return byte(i*31 + 7) }

func dupFD(fd int) (int, error) {
	// dup leaves close-on-exec off, which the fd-passing test relies on.
	return syscall.Dup(fd)
}

func runHelper(t *testing.T, mode string, extra ...*os.File) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnv+"="+mode)
	cmd.ExtraFiles = extra
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("helper %q: %v\n%s", mode, err, out)
	}
}

func TestHelperProcess(t *testing.T) {
	mode := os.Getenv(helperEnv)
	if mode == "" {
		t.Skip("only runs as the second process of the sharing tests")
	}
	if err := helper(mode); err != nil {
		fmt.Fprintln(os.Stderr, "helper:", err)
		os.Exit(3)
	}
	os.Exit(0)
}

func helper(mode string) error {
	var m *Map
	var err error
	switch kind, arg, _ := strings.Cut(mode, ":"); kind {
	case "name":
		m, err = OpenRefcounted(arg, SharedMem|NoCreate, sharedSize)
	case "fd":
		// The parent put the segment's descriptor at fd 3.
		m, err = OpenFD(3, SharedMem|NoCreate|FromFD, sharedSize)
	default:
		return storageHelper(mode)
	}
	if err != nil {
		return err
	}
	defer m.Close()
	b := m.Bytes()
	for i := 0; i < sharedSize/2; i++ {
		if b[i] != pattern(i) {
			return fmt.Errorf("byte %d is %d, wanted %d", i, b[i], pattern(i))
		}
	}
	for i := sharedSize / 2; i < sharedSize; i++ {
		b[i] = ^pattern(i)
	}
	return nil
}

func checkAnswer(t *testing.T, m *Map) {
	t.Helper()
	b := m.Bytes()
	for i := sharedSize / 2; i < sharedSize; i++ {
		if b[i] != ^pattern(i) {
			t.Fatalf("byte %d is %d after the helper wrote %d", i, b[i], ^pattern(i))
		}
	}
}

func TestTwoProcessesShareByName(t *testing.T) {
	name := newName(t)
	m, err := OpenRefcounted(name, SharedMem|Exclusive, sharedSize)
	if err != nil {
		t.Fatal(err)
	}
	b := m.Bytes()
	for i := 0; i < sharedSize/2; i++ {
		b[i] = pattern(i)
	}
	runHelper(t, "name:"+name)
	checkAnswer(t, m)
	if n, err := m.Refcount(); err != nil || n != 1 {
		t.Fatalf("refcount %d after the helper closed: %v", n, err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if segmentExists(t, name) {
		t.Fatalf("%s left in /dev/shm", name)
	}
}

func TestTwoProcessesShareByFD(t *testing.T) {
	src := make([]byte, sharedSize)
	for i := 0; i < sharedSize/2; i++ {
		src[i] = pattern(i)
	}
	m, err := ShareMemory(src)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	fd, err := dupFD(m.FD())
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "shared segment")
	defer f.Close()
	runHelper(t, "fd", f)
	checkAnswer(t, m)
}

// A Map nobody closed is freed by its finalizer: forced collections make
// the plain SHAREDMEM segments' names disappear, as Close would.
func TestFinalizerFreesForgottenMaps(t *testing.T) {
	names := make([]string, 8)
	func() {
		for i := range names {
			names[i] = newName(t)
			m, err := Open(names[i], SharedMem|Exclusive, 4096)
			if err != nil {
				t.Fatal(err)
			}
			m.Bytes()[0] = 1
		}
	}()
	waitFinalized(t, names, "forgotten maps still exist")
}

// waitFinalized runs GC until none of the segment names exists: finalizers
// run on their own goroutine after a collection, so give them a bounded
// number of rounds (20 s).
func waitFinalized(t *testing.T, names []string, what string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		runtime.GC()
		left := 0
		for _, n := range names {
			if segmentExists(t, n) {
				left++
			}
		}
		if left == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d %s after repeated GC", left, len(names), what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Readers and Close at once: readers see the data or ErrClosed, never a
// freed handle.
func TestConcurrentUseAndClose(t *testing.T) {
	name := newName(t)
	m, err := OpenRefcounted(name, SharedMem|Exclusive, 4096)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < 2000; i++ {
				n, err := m.Refcount()
				if errors.Is(err, ErrClosed) {
					return
				}
				if err != nil || n != 1 {
					errs <- fmt.Errorf("refcount %d: %v", n, err)
					return
				}
			}
		}()
	}
	runtime.Gosched()
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if segmentExists(t, name) {
		t.Fatalf("%s left in /dev/shm", name)
	}
}

func TestStatusText(t *testing.T) {
	if ErrNoSpace.Error() != "no space" || Status(9999).Error() != "unknown status" {
		t.Fatalf("status texts: %q %q", ErrNoSpace.Error(), Status(9999).Error())
	}
	e := &Error{Op: "ss_x", Status: ErrTimeout, Message: "m"}
	if e.Error() != "ss_x: m ("+ErrTimeout.Error()+")" {
		t.Fatalf("error text %q", e.Error())
	}
}
