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

// Hash modes, content store formats and dtype codes (c10::ScalarType's
// values), with the C header's values.
const (
	HashFast   = int(C.SS_HASH_FAST)   // XXH3-128 tree, 32 hex characters
	HashStable = int(C.SS_HASH_STABLE) // SHA-1, PyTorch's stable hash

	ContentFormatNative = int(C.SS_CONTENT_FORMAT_NATIVE)
	ContentFormatTorch  = int(C.SS_CONTENT_FORMAT_TORCH)

	DtypeUint8    = int(C.SS_DTYPE_UINT8)
	DtypeInt8     = int(C.SS_DTYPE_INT8)
	DtypeInt16    = int(C.SS_DTYPE_INT16)
	DtypeInt32    = int(C.SS_DTYPE_INT32)
	DtypeInt64    = int(C.SS_DTYPE_INT64)
	DtypeFloat16  = int(C.SS_DTYPE_FLOAT16)
	DtypeFloat32  = int(C.SS_DTYPE_FLOAT32)
	DtypeFloat64  = int(C.SS_DTYPE_FLOAT64)
	DtypeBool     = int(C.SS_DTYPE_BOOL)
	DtypeBfloat16 = int(C.SS_DTYPE_BFLOAT16)
)

// bytesPtr is the C view of b (NULL for an empty slice).
func bytesPtr(b []byte) unsafe.Pointer {
	if len(b) == 0 {
		return nil
	}
	return unsafe.Pointer(&b[0])
}

// HashBytes is the hex digest of data: HashFast or HashStable.
func HashBytes(data []byte, mode int) (string, error) {
	var buf [C.SS_HASH_HEX_MAX]C.char
	err := call("ss_content_hash_bytes", func() C.ss_status {
		return C.ss_content_hash_bytes(bytesPtr(data), C.size_t(len(data)), C.int(mode), &buf[0], C.size_t(len(buf)))
	})
	runtime.KeepAlive(data)
	if err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

// ContentWriter writes a content store (ss_content_writer). Its methods may
// be called from several goroutines; Close waits for calls in progress.
type ContentWriter struct {
	mu sync.RWMutex
	h  *C.ss_content_writer
}

// OpenContentWriter opens (creating if needed) the store in folder path, in
// ContentFormatNative or ContentFormatTorch; an existing store is added to.
func OpenContentWriter(path string, format int) (*ContentWriter, error) {
	const op = "ss_content_writer_open"
	cpath, err := cString(op, "path", path)
	if err != nil {
		return nil, err
	}
	defer freeCString(cpath)
	var h *C.ss_content_writer
	if err := call(op, func() C.ss_status { return C.ss_content_writer_open(cpath, C.int(format), &h) }); err != nil {
		return nil, err
	}
	w := &ContentWriter{h: h}
	runtime.SetFinalizer(w, (*ContentWriter).Close)
	return w, nil
}

func (w *ContentWriter) live(op string) (*C.ss_content_writer, error) {
	if w.h == nil {
		return nil, goError(op, ErrClosed, "the content writer was closed")
	}
	return w.h, nil
}

// WriteStorage stores data once per distinct content and returns its hash.
func (w *ContentWriter) WriteStorage(data []byte) (string, error) {
	const op = "ss_content_writer_write_storage"
	w.mu.RLock()
	defer w.mu.RUnlock()
	h, err := w.live(op)
	if err != nil {
		return "", err
	}
	var buf [C.SS_HASH_HEX_MAX]C.char
	err = call(op, func() C.ss_status {
		return C.ss_content_writer_write_storage(h, bytesPtr(data), C.size_t(len(data)), &buf[0], C.size_t(len(buf)))
	})
	runtime.KeepAlive(data)
	if err != nil {
		return "", err
	}
	return C.GoString(&buf[0]), nil
}

// WriteTensor stores data as the storage and an entry name viewing it as
// dtype with offset, shape and stride in elements (PyTorch's order).
func (w *ContentWriter) WriteTensor(name string, data []byte, dtype int, offset int64, shape, stride []int64) error {
	const op = "ss_content_writer_write_tensor"
	if len(shape) != len(stride) {
		return goError(op, ErrInvalidArgument, "shape has %d dimensions but stride has %d", len(shape), len(stride))
	}
	cname, err := cString(op, "name", name)
	if err != nil {
		return err
	}
	defer freeCString(cname)
	w.mu.RLock()
	defer w.mu.RUnlock()
	h, err := w.live(op)
	if err != nil {
		return err
	}
	var sh, st *C.int64_t
	if len(shape) > 0 {
		sh, st = (*C.int64_t)(unsafe.Pointer(&shape[0])), (*C.int64_t)(unsafe.Pointer(&stride[0]))
	}
	err = call(op, func() C.ss_status {
		return C.ss_content_writer_write_tensor(h, cname, bytesPtr(data), C.size_t(len(data)), C.int(dtype), C.int64_t(offset),
			C.size_t(len(shape)), sh, st)
	})
	runtime.KeepAlive(data)
	runtime.KeepAlive(shape)
	runtime.KeepAlive(stride)
	return err
}

// SetDurable sets whether files are fsynced around their rename (default
// true; off is faster, and a killed process still leaves no partial file,
// but a power loss may).
func (w *ContentWriter) SetDurable(on bool) error {
	const op = "ss_content_writer_set_durable"
	w.mu.RLock()
	defer w.mu.RUnlock()
	h, err := w.live(op)
	if err != nil {
		return err
	}
	return call(op, func() C.ss_status { return C.ss_content_writer_set_durable(h, C.bool(on)) })
}

// Counts gives the storages written, the storages deduplicated and the
// tensor entries written so far.
func (w *ContentWriter) Counts() (written, deduplicated, tensors uint64, err error) {
	const op = "ss_content_writer_counts"
	w.mu.RLock()
	defer w.mu.RUnlock()
	h, err := w.live(op)
	if err != nil {
		return 0, 0, 0, err
	}
	var a, b, c C.uint64_t
	err = call(op, func() C.ss_status { return C.ss_content_writer_counts(h, &a, &b, &c) })
	return uint64(a), uint64(b), uint64(c), err
}

// Close releases the writer (what it wrote is already durable). Idempotent.
func (w *ContentWriter) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.h != nil {
		C.ss_content_writer_free(w.h)
		w.h = nil
	}
	return nil
}

// ContentReader reads a content store (ss_content_reader), ours or
// PyTorch's. Its methods may be called from several goroutines.
type ContentReader struct {
	mu sync.RWMutex
	h  *C.ss_content_reader
}

// OpenContentReader opens the store in folder path (format detected).
func OpenContentReader(path string) (*ContentReader, error) {
	const op = "ss_content_reader_open"
	cpath, err := cString(op, "path", path)
	if err != nil {
		return nil, err
	}
	defer freeCString(cpath)
	var h *C.ss_content_reader
	if err := call(op, func() C.ss_status { return C.ss_content_reader_open(cpath, &h) }); err != nil {
		return nil, err
	}
	r := &ContentReader{h: h}
	runtime.SetFinalizer(r, (*ContentReader).Close)
	return r, nil
}

func (r *ContentReader) live(op string) (*C.ss_content_reader, error) {
	if r.h == nil {
		return nil, goError(op, ErrClosed, "the content reader was closed")
	}
	return r.h, nil
}

// Format is ContentFormatNative or ContentFormatTorch (-1 once closed).
func (r *ContentReader) Format() int {
	r.mu.RLock()
	defer r.mu.RUnlock()
	return int(C.ss_content_reader_format(r.h))
}

// SetVerify makes the reader hash each storage against its name before
// handing it out.
func (r *ContentReader) SetVerify(on bool) error {
	const op = "ss_content_reader_set_verify"
	r.mu.RLock()
	defer r.mu.RUnlock()
	h, err := r.live(op)
	if err != nil {
		return err
	}
	return call(op, func() C.ss_status { return C.ss_content_reader_set_verify(h, C.bool(on)) })
}

// ContentTensor is a tensor read from a store; its bytes are the storage's
// read-only mapping (writing to them faults). Close releases it.
type ContentTensor struct {
	h *C.ss_content_tensor
}

// ReadTensor reads entry name with its storage mapped (no copy).
func (r *ContentReader) ReadTensor(name string) (*ContentTensor, error) {
	const op = "ss_content_reader_read_tensor"
	cname, err := cString(op, "name", name)
	if err != nil {
		return nil, err
	}
	defer freeCString(cname)
	r.mu.RLock()
	defer r.mu.RUnlock()
	h, err := r.live(op)
	if err != nil {
		return nil, err
	}
	var t *C.ss_content_tensor
	if err := call(op, func() C.ss_status { return C.ss_content_reader_read_tensor(h, cname, &t) }); err != nil {
		return nil, err
	}
	ct := &ContentTensor{h: t}
	runtime.SetFinalizer(ct, (*ContentTensor).Close)
	return ct, nil
}

// Dtype is the c10::ScalarType code.
func (t *ContentTensor) Dtype() int { return int(C.ss_content_tensor_dtype(t.h)) }

// Offset is the storage offset in elements.
func (t *ContentTensor) Offset() int64 { return int64(C.ss_content_tensor_offset(t.h)) }

func int64s(p *C.int64_t, n int) []int64 {
	out := make([]int64, n)
	if n > 0 {
		copy(out, unsafe.Slice((*int64)(unsafe.Pointer(p)), n))
	}
	return out
}

// Shape is the sizes (PyTorch's order).
func (t *ContentTensor) Shape() []int64 {
	return int64s(C.ss_content_tensor_shape(t.h), int(C.ss_content_tensor_ndim(t.h)))
}

// Stride is the strides in elements.
func (t *ContentTensor) Stride() []int64 {
	return int64s(C.ss_content_tensor_stride(t.h), int(C.ss_content_tensor_ndim(t.h)))
}

// StorageHash names the tensor's storage.
func (t *ContentTensor) StorageHash() string {
	return C.GoString(C.ss_content_tensor_storage_hash(t.h))
}

// Bytes is the whole storage, read-only, valid until Close.
func (t *ContentTensor) Bytes() []byte {
	n := int(C.ss_content_tensor_nbytes(t.h))
	if n == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(C.ss_content_tensor_data(t.h)), n)
}

// Close releases the tensor. Idempotent.
func (t *ContentTensor) Close() error {
	if t.h != nil {
		C.ss_content_tensor_free(t.h)
		t.h = nil
	}
	return nil
}

// ContentStorage is a storage read from a store, mapped read-only.
type ContentStorage struct {
	h *C.ss_content_storage
}

// ReadStorage maps the storage named hash.
func (r *ContentReader) ReadStorage(hash string) (*ContentStorage, error) {
	const op = "ss_content_reader_read_storage"
	chash, err := cString(op, "hash", hash)
	if err != nil {
		return nil, err
	}
	defer freeCString(chash)
	r.mu.RLock()
	defer r.mu.RUnlock()
	h, err := r.live(op)
	if err != nil {
		return nil, err
	}
	var s *C.ss_content_storage
	if err := call(op, func() C.ss_status { return C.ss_content_reader_read_storage(h, chash, &s) }); err != nil {
		return nil, err
	}
	cs := &ContentStorage{h: s}
	runtime.SetFinalizer(cs, (*ContentStorage).Close)
	return cs, nil
}

// Bytes is the storage, read-only, valid until Close.
func (s *ContentStorage) Bytes() []byte {
	n := int(C.ss_content_storage_nbytes(s.h))
	if n == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(C.ss_content_storage_data(s.h)), n)
}

// Close releases the storage. Idempotent.
func (s *ContentStorage) Close() error {
	if s.h != nil {
		C.ss_content_storage_free(s.h)
		s.h = nil
	}
	return nil
}

// takeList copies an ss_content_list into Go strings and frees it.
func takeList(l *C.ss_content_list) []string {
	defer C.ss_content_list_free(l)
	n := int(C.ss_content_list_len(l))
	out := make([]string, n)
	for i := range out {
		out[i] = C.GoString(C.ss_content_list_get(l, C.size_t(i)))
	}
	return out
}

func (r *ContentReader) list(op string, f func(h *C.ss_content_reader, out **C.ss_content_list) C.ss_status) ([]string, error) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	h, err := r.live(op)
	if err != nil {
		return nil, err
	}
	var l *C.ss_content_list
	if err := call(op, func() C.ss_status { return f(h, &l) }); err != nil {
		return nil, err
	}
	return takeList(l), nil
}

// ListTensors gives every tensor name, sorted.
func (r *ContentReader) ListTensors() ([]string, error) {
	return r.list("ss_content_reader_list_tensors", func(h *C.ss_content_reader, out **C.ss_content_list) C.ss_status {
		return C.ss_content_reader_list_tensors(h, out)
	})
}

// ListStorages gives every storage hash, sorted.
func (r *ContentReader) ListStorages() ([]string, error) {
	return r.list("ss_content_reader_list_storages", func(h *C.ss_content_reader, out **C.ss_content_list) C.ss_status {
		return C.ss_content_reader_list_storages(h, out)
	})
}

// Verify checks the whole store: the number of objects checked and one
// "object: why" line per corrupt object.
func (r *ContentReader) Verify() (uint64, []string, error) {
	var checked C.uint64_t
	problems, err := r.list("ss_content_reader_verify", func(h *C.ss_content_reader, out **C.ss_content_list) C.ss_status {
		return C.ss_content_reader_verify(h, &checked, out)
	})
	return uint64(checked), problems, err
}

// Close releases the reader; tensors and storages read stay valid. Idempotent.
func (r *ContentReader) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.h != nil {
		C.ss_content_reader_free(r.h)
		r.h = nil
	}
	return nil
}
