package storagesharing

import (
	"os"
	"testing"
)

// TestMain ends CUDA IPC before the test binary exits: os.Exit skips C
// atexit handlers, so without this a producer's counter file would stay
// in /dev/shm after TestCudaRoundTrip.
func TestMain(m *testing.M) {
	code := m.Run()
	CudaIPCTeardown()
	os.Exit(code)
}
