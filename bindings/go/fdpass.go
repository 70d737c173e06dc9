package storagesharing

/*
#include <storage_sharing.h>
*/
import "C"

import "unsafe"

// maxSendFDs is the C API's limit on descriptors per message.
const maxSendFDs = 253

// SendFDs sends payload (at least one byte) and the descriptors fds (they
// stay open here) over the connected Unix socket sock.
func SendFDs(sock int, payload []byte, fds []int) error {
	const op = "ss_fds_send"
	if len(payload) == 0 {
		return goError(op, ErrInvalidArgument, "the payload is empty: a message needs at least one byte")
	}
	if len(fds) > maxSendFDs {
		return goError(op, ErrInvalidArgument, "%d descriptors, at most %d per message", len(fds), maxSendFDs)
	}
	cfds := make([]C.int, len(fds))
	for i, fd := range fds {
		cfds[i] = C.int(fd)
	}
	var fdp *C.int
	if len(cfds) > 0 {
		fdp = &cfds[0]
	}
	// Neither slice holds Go pointers, so C may read them during the call.
	return call(op, func() C.ss_status {
		return C.ss_fds_send(C.int(sock), unsafe.Pointer(&payload[0]), C.size_t(len(payload)), fdp, C.size_t(len(cfds)))
	})
}

// RecvFDs receives one message of at most maxLen bytes (an empty payload
// means the peer closed) and at most maxFDs descriptors, which the caller
// owns and closes (they are close-on-exec). More descriptors than maxFDs
// give ErrBufferTooSmall; a process at its open-file limit gets
// ErrTooManyFiles; on failure no descriptor is left open.
func RecvFDs(sock int, maxLen, maxFDs int) (payload []byte, fds []int, err error) {
	const op = "ss_fds_recv"
	if maxLen <= 0 || maxFDs < 0 {
		return nil, nil, goError(op, ErrInvalidArgument, "room for %d bytes and %d descriptors: need at least 1 byte", maxLen, maxFDs)
	}
	buf := make([]byte, maxLen)
	cfds := make([]C.int, maxFDs)
	var fdp *C.int
	if maxFDs > 0 {
		fdp = &cfds[0]
	}
	var n, nfds C.size_t
	err = call(op, func() C.ss_status {
		return C.ss_fds_recv(C.int(sock), unsafe.Pointer(&buf[0]), C.size_t(len(buf)), &n, fdp, C.size_t(len(cfds)), &nfds)
	})
	if err != nil {
		return nil, nil, err
	}
	fds = make([]int, int(nfds))
	for i := range fds {
		fds[i] = int(cfds[i])
	}
	return buf[:int(n)], fds, nil
}

// SetManagerBinary uses the daemon binary at path when a manager must be
// started (else SS_SHM_MANAGER, ss_shm_manager beside the library, PATH).
func SetManagerBinary(path string) error {
	const op = "ss_shm_manager_set_binary"
	cpath, err := cString(op, "path", path)
	if err != nil {
		return err
	}
	defer freeCString(cpath)
	return call(op, func() C.ss_status { return C.ss_shm_manager_set_binary(cpath) })
}

// SpawnManager starts a new manager daemon and returns its socket path,
// usable as SharedFilename.Manager.
func SpawnManager() (string, error) {
	var buf [108]C.char
	if err := call("ss_shm_manager_spawn", func() C.ss_status {
		return C.ss_shm_manager_spawn(&buf[0], C.size_t(len(buf)))
	}); err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}
