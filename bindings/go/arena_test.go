package storagesharing

import (
	"errors"
	"fmt"
	"testing"
)

func arenaFill(b []byte, seed byte) {
	for i := range b {
		b[i] = byte(i)*31 + seed
	}
}

func arenaCheck(b []byte, n int, seed byte) error {
	if len(b) < n {
		return fmt.Errorf("view of %d bytes, wanted at least %d", len(b), n)
	}
	for i := 0; i < n; i++ {
		if b[i] != byte(i)*31+seed {
			return fmt.Errorf("byte %d is %d, wanted %d", i, b[i], byte(i)*31+seed)
		}
	}
	return nil
}

// arenaHelper is the consumer: it receives five blocks, checks them,
// holds the last until told, then releases it.
func arenaHelper(mode string) error {
	const sock = 3
	var views []*ArenaView
	for i := 0; i < 5; i++ {
		v, err := ArenaRecv(sock)
		if err != nil {
			return err
		}
		if err := arenaCheck(v.Bytes(), 3000, byte(i)); err != nil {
			return err
		}
		views = append(views, v)
	}
	for _, v := range views[:4] {
		v.Close()
	}
	if err := ack(sock); err != nil {
		return err
	}
	if err := waitAck(sock); err != nil {
		return err
	}
	views[4].Close()
	return ack(sock)
}

func TestArenaSendToChildHeldBlocksNotReused(t *testing.T) {
	for _, byName := range []bool{false, true} {
		opts := DefaultArenaOptions()
		opts.ByName = byName
		opts.SegmentSize = 4 << 20
		a, err := OpenArena(&opts)
		if err != nil {
			t.Fatal(err)
		}
		sock, wait := startHelper(t, "arena-consumer")
		var blocks [][]byte
		for i := 0; i < 5; i++ {
			b, err := a.Alloc(3000, 64)
			if err != nil {
				t.Fatal(err)
			}
			arenaFill(b, byte(i))
			if err := a.Send(sock, b); err != nil {
				t.Fatal(err)
			}
			blocks = append(blocks, b)
		}
		if err := waitAck(sock); err != nil {
			t.Fatal(err)
		}
		for _, b := range blocks {
			if err := a.Free(b); err != nil {
				t.Fatal(err)
			}
		}
		// Four were released before the free: reused at once; one is held.
		if st, err := a.Stats(); err != nil || st.DeferredBlocks != 1 {
			t.Fatalf("stats %+v (want 1 deferred block): %v", st, err)
		}
		// The fifth is held: five new blocks never land on it.
		for i := 0; i < 5; i++ {
			b, err := a.Alloc(3000, 64)
			if err != nil {
				t.Fatal(err)
			}
			if &b[0] == &blocks[4][0] {
				t.Fatal("a held block was reused")
			}
		}
		if err := ack(sock); err != nil {
			t.Fatal(err)
		}
		if err := waitAck(sock); err != nil {
			t.Fatal(err)
		}
		wait()
		if _, rec, err := a.Collect(); err != nil || rec != 1 {
			t.Fatalf("collect recycled %d after the release: %v", rec, err)
		}
		a.Close()
	}
}

func TestArenaErrorsAndHandleBytes(t *testing.T) {
	a, err := OpenArena(nil)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := a.Alloc(100, 8)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.Alloc(0, 8); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("alloc 0: %v", err)
	}
	h, err := a.Share(b)
	if err != nil {
		t.Fatal(err)
	}
	h2, err := ArenaHandleFromBytes(h.Bytes())
	if err != nil || h2 != h {
		t.Fatalf("handle bytes roundtrip: %v", err)
	}
	if _, err := OpenRemote(h); !errors.Is(err, ErrNotFound) {
		t.Fatalf("by fd without the segment imported: %v", err)
	}
	if _, err := ArenaHandleFromBytes([]byte{1, 2}); !errors.Is(err, ErrSizeMismatch) {
		t.Fatal(err)
	}
	if err := a.Unshare(h); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(b); err != nil {
		t.Fatal(err)
	}
	if err := a.Free(b); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("double free: %v", err)
	}
	if err := a.Free(make([]byte, 10)); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("foreign pointer: %v", err)
	}
	s, err := a.NewStorage(2 << 20)
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	st, err := a.Stats()
	if err != nil || st.LiveBlocks != 0 {
		t.Fatalf("stats %+v: %v", st, err)
	}
}
