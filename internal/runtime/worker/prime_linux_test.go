package worker

import (
	"testing"
	"time"
)

// TestPrimeAfter: the next sandbox is primed afterAnswer after a create,
// unless the created sandbox's first exec runs then: once that exec has
// ended (not another sandbox's), at the latest primeBy after the create,
// or when the next create starts; once each time.
func TestPrimeAfter(t *testing.T) {
	primed := make(chan string, 4)
	prime := func(what string) func() { return func() { primed <- what } }
	none := func(d time.Duration) {
		t.Helper()
		select {
		case p := <-primed:
			t.Fatalf("primed %s", p)
		case <-time.After(d):
		}
	}
	// got waits for what, and says how long after t0 it came.
	got := func(what string, t0 time.Time) time.Duration {
		t.Helper()
		select {
		case p := <-primed:
			if p != what {
				t.Fatalf("primed %s, want %s", p, what)
			}
			return time.Since(t0)
		case <-time.After(5 * time.Second):
			t.Fatalf("%s never primed", what)
		}
		return 0
	}
	var p primeAfter

	// Its first exec runs at afterAnswer: primed when it ends.
	p.created("a", prime("a"))
	p.execStarted("a")
	none(afterAnswer * 3)
	t0 := time.Now()
	p.execEnded("a")
	if d := got("a", t0); d > primeBy/2 {
		t.Errorf("primed %v after the exec ended", d)
	}
	p.execStarted("a") // its second exec
	p.execEnded("a")
	none(primeBy * 2)

	// No exec, or another sandbox's: primed at afterAnswer.
	for _, other := range []string{"", "x"} {
		t0 = time.Now()
		p.created("b", prime("b"))
		if other != "" {
			p.execStarted(other)
		}
		if d := got("b", t0); d < afterAnswer || d > primeBy {
			t.Errorf("primed %v after the create, want %v (an exec of %q)", d, afterAnswer, other)
		}
		p.execEnded(other)
	}

	// An exec ended before afterAnswer: primed at afterAnswer.
	t0 = time.Now()
	p.created("c", prime("c"))
	p.execStarted("c")
	p.execEnded("c")
	if d := got("c", t0); d < afterAnswer || d > primeBy {
		t.Errorf("primed %v after the create, want %v", d, afterAnswer)
	}

	// A first exec that runs on: primed at primeBy.
	t0 = time.Now()
	p.created("d", prime("d"))
	p.execStarted("d")
	if d := got("d", t0); d < primeBy {
		t.Errorf("primed %v after the create, before %v", d, primeBy)
	}
	p.execEnded("d")
	none(primeBy)

	// The next create starts while the priming waits: primed at once.
	p.created("e", prime("e"))
	p.execStarted("e")
	none(afterAnswer * 3)
	t0 = time.Now()
	p.creating()
	if d := got("e", t0); d > primeBy/2 {
		t.Errorf("primed %v after the next create started", d)
	}
	p.execEnded("e")
	p.creating() // none waits
	none(primeBy * 2)
}
