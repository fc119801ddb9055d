package worker

import (
	"testing"
	"time"
)

// TestPrimeAfter: the next sandbox is primed once the created one's first
// exec has ended (not another's), once only, and at the latest primeBy
// after the create.
func TestPrimeAfter(t *testing.T) {
	primed := make(chan string, 4)
	prime := func(what string) func() { return func() { primed <- what } }
	none := func() {
		t.Helper()
		select {
		case p := <-primed:
			t.Fatalf("primed %s", p)
		case <-time.After(primeBy / 4):
		}
	}
	var p primeAfter

	p.created("a", prime("a"))
	p.execEnded("b") // another sandbox's exec
	none()
	p.execEnded("a")
	if got := <-primed; got != "a" {
		t.Fatalf("primed %s, want a", got)
	}
	p.execEnded("a") // its second exec
	time.Sleep(primeBy * 2)
	none()

	// No exec comes: primed at primeBy.
	t0 := time.Now()
	p.created("c", prime("c"))
	select {
	case got := <-primed:
		if got != "c" || time.Since(t0) < primeBy {
			t.Fatalf("primed %s after %v, want c after %v", got, time.Since(t0), primeBy)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("never primed without an exec")
	}
	p.execEnded("c")
	none()

	// A create while one is awaited awaits its own.
	p.created("d", prime("d"))
	p.created("e", prime("e"))
	p.execEnded("d")
	p.execEnded("e")
	if got := <-primed; got != "e" {
		t.Fatalf("primed %s, want e", got)
	}
	time.Sleep(primeBy * 2)
	none()
}
