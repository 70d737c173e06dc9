package main

import (
	"fmt"
	"log"

	ss "storage-sharing.local/bindings/go"
)

func main() {
	name, err := ss.NewSegmentName()
	if err != nil {
		log.Fatal(err)
	}
	m, err := ss.OpenRefcounted(name, ss.SharedMem|ss.Exclusive, 4096)
	if err != nil {
		log.Fatal(err)
	}
	defer m.Close()
	copy(m.Bytes(), "hello")
	// Others open it with ss.SharedMem|ss.NoCreate while m is open.
	fmt.Printf("%s: %d bytes, removed at exit\n", m.Filename(), m.Len())
}
