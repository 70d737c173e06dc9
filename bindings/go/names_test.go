package storagesharing

import (
	"errors"
	"testing"
)

// A name with a NUL inside is refused, never cut short at
// the NUL (which would open or create the segment named by the prefix).
func TestOpenRefusesEmbeddedNUL(t *testing.T) {
	prefix := newName(t)
	opens := map[string]func(string, Flag, int) (*Map, error){"Open": Open, "OpenRefcounted": OpenRefcounted}
	for what, open := range opens {
		if m, err := open(prefix+"\x00b", SharedMem|Exclusive, 10); !errors.Is(err, ErrInvalidArgument) {
			if m != nil {
				m.Close()
			}
			t.Fatalf("%s with a NUL in the name: got %v, want ErrInvalidArgument", what, err)
		}
		if segmentExists(t, prefix) {
			t.Fatalf("%s created %s, the name cut at the NUL", what, prefix)
		}
	}
	existing, err := Open(prefix, SharedMem|Exclusive, 10)
	if err != nil {
		t.Fatal(err)
	}
	defer existing.Close()
	if m, err := Open(prefix+"\x00other", SharedMem|NoCreate, 10); !errors.Is(err, ErrInvalidArgument) {
		if m != nil {
			m.Close()
		}
		t.Fatalf("Open of %q opened the prefix: %v", prefix+"\\x00other", err)
	}
}
