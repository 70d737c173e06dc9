package storagesharing

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"os"
	"path/filepath"
	"testing"
)

func TestContentStoreRoundTripAndDedup(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "store")
	data := make([]byte, 12*4)
	for i := 0; i < 12; i++ {
		binary.LittleEndian.PutUint32(data[4*i:], math.Float32bits(float32(i)*0.25))
	}
	w, err := OpenContentWriter(dir, ContentFormatNative)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.SetDurable(false); err != nil {
		t.Fatal(err)
	}
	if err := w.WriteTensor("m/a", data, DtypeFloat32, 0, []int64{3, 4}, []int64{4, 1}); err != nil {
		t.Fatal(err)
	}
	if err := w.WriteTensor("m/a_t", data, DtypeFloat32, 1, []int64{4, 2}, []int64{1, 4}); err != nil {
		t.Fatal(err)
	}
	if err := w.WriteTensor("scalar", data[:4], DtypeInt32, 0, nil, nil); err != nil {
		t.Fatal(err)
	}
	hash, err := w.WriteStorage(data)
	if err != nil {
		t.Fatal(err)
	}
	written, dedup, tensors, err := w.Counts()
	if err != nil || written != 2 || dedup != 2 || tensors != 3 {
		t.Fatalf("counts %d %d %d %v", written, dedup, tensors, err)
	}
	if err := w.WriteTensor("../x", data, DtypeFloat32, 0, []int64{1}, []int64{1}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a name with .. gave %v", err)
	}
	if err := w.WriteTensor("big", data, DtypeFloat32, 0, []int64{13}, []int64{1}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("a view past the storage gave %v", err)
	}
	w.Close()
	if _, err := w.WriteStorage(data); !errors.Is(err, ErrClosed) {
		t.Fatalf("write after close gave %v", err)
	}

	r, err := OpenContentReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if r.Format() != ContentFormatNative {
		t.Fatalf("format %d", r.Format())
	}
	if err := r.SetVerify(true); err != nil {
		t.Fatal(err)
	}
	tt, err := r.ReadTensor("m/a_t")
	if err != nil {
		t.Fatal(err)
	}
	defer tt.Close()
	if tt.Dtype() != DtypeFloat32 || tt.Offset() != 1 || tt.StorageHash() != hash {
		t.Fatalf("dtype %d offset %d hash %s", tt.Dtype(), tt.Offset(), tt.StorageHash())
	}
	if s, st := tt.Shape(), tt.Stride(); len(s) != 2 || s[0] != 4 || s[1] != 2 || st[0] != 1 || st[1] != 4 {
		t.Fatalf("shape %v stride %v", s, st)
	}
	if !bytes.Equal(tt.Bytes(), data) {
		t.Fatal("storage bytes differ")
	}
	sc, err := r.ReadTensor("scalar")
	if err != nil {
		t.Fatal(err)
	}
	if len(sc.Shape()) != 0 || len(sc.Bytes()) != 4 {
		t.Fatalf("0-d tensor: shape %v, %d bytes", sc.Shape(), len(sc.Bytes()))
	}
	sc.Close()
	s, err := r.ReadStorage(hash)
	if err != nil {
		t.Fatal(err)
	}
	if &s.Bytes()[0] != &tt.Bytes()[0] {
		t.Fatal("the same storage read twice is two mappings")
	}
	s.Close()
	names, err := r.ListTensors()
	if err != nil || len(names) != 3 || names[0] != "m/a" {
		t.Fatalf("tensors %v %v", names, err)
	}
	storages, err := r.ListStorages()
	if err != nil || len(storages) != 2 {
		t.Fatalf("storages %v %v", storages, err)
	}
	checked, problems, err := r.Verify()
	if err != nil || checked != 5 || len(problems) != 0 {
		t.Fatalf("verify: %d checked, problems %v, %v", checked, problems, err)
	}
	if _, err := r.ReadTensor("missing"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing tensor gave %v", err)
	}
	if _, err := r.ReadStorage("../tensors/m/a"); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("bad hash gave %v", err)
	}

	// A damaged storage is found by Verify.
	path := filepath.Join(dir, "storages", hash)
	raw, _ := os.ReadFile(path)
	raw[0] ^= 1
	if err := os.WriteFile(path, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	r2, err := OpenContentReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer r2.Close()
	if _, problems, _ := r2.Verify(); len(problems) != 1 {
		t.Fatalf("verify of a damaged store: %v", problems)
	}
}

func TestHashBytes(t *testing.T) {
	h, err := HashBytes([]byte("abc"), HashStable)
	if err != nil || h != "a9993e364706816aba3e25717850c26c9cd0d89d" {
		t.Fatalf("sha1: %s %v", h, err)
	}
	if h, err := HashBytes(nil, HashFast); err != nil || h != "99aa06d3014798d86001c324468d497f" {
		t.Fatalf("fast of empty: %s %v", h, err)
	}
	if _, err := HashBytes([]byte("x"), 9); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("bad mode gave %v", err)
	}
}
