package worker

import (
	"testing"
	"time"
)

// TestPrimeAfter: the next sandbox is primed wait (afterAnswer in the
// worker) after a create, unless the created sandbox's first exec runs
// then: once that exec has ended (not another sandbox's), at the latest
// by (primeBy) after the create, or when the next create starts or ends;
// once each time.
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
	// Windows wide enough for a loaded host: an exec starts well
	// within wait of its create here.
	const wait, by = 200 * time.Millisecond, time.Second
	p := primeAfter{wait: wait, by: by}

	// Its first exec runs at wait: primed when it ends.
	p.created("a", prime("a"))
	p.execStarted("a")
	none(wait * 3)
	t0 := time.Now()
	p.execEnded("a")
	if d := got("a", t0); d > by/2 {
		t.Errorf("primed %v after the exec ended", d)
	}
	p.execStarted("a") // its second exec
	p.execEnded("a")
	none(by)

	// No exec, or another sandbox's: primed at wait.
	for _, other := range []string{"", "x"} {
		t0 = time.Now()
		p.created("b", prime("b"))
		if other != "" {
			p.execStarted(other)
		}
		if d := got("b", t0); d < wait || d > by {
			t.Errorf("primed %v after the create, want %v (an exec of %q)", d, wait, other)
		}
		p.execEnded(other)
	}

	// An exec ended before wait: primed at wait.
	t0 = time.Now()
	p.created("c", prime("c"))
	p.execStarted("c")
	p.execEnded("c")
	if d := got("c", t0); d < wait || d > by {
		t.Errorf("primed %v after the create, want %v", d, wait)
	}

	// A first exec that runs on: primed at by.
	t0 = time.Now()
	p.created("d", prime("d"))
	p.execStarted("d")
	if d := got("d", t0); d < by {
		t.Errorf("primed %v after the create, before %v", d, by)
	}
	p.execEnded("d")
	none(by)

	// The next create starts while the priming waits: primed at once.
	p.created("e", prime("e"))
	p.execStarted("e")
	none(wait * 3)
	t0 = time.Now()
	p.creating()
	if d := got("e", t0); d > by/2 {
		t.Errorf("primed %v after the next create started", d)
	}
	p.execEnded("e")
	p.creating() // none waits
	none(wait * 2)

	// A create that ends while a priming waits primes that one at once.
	p.created("f", prime("f"))
	p.execStarted("f")
	t0 = time.Now()
	p.created("g", prime("g"))
	if d := got("f", t0); d > by/2 {
		t.Errorf("f primed %v after the next create", d)
	}
	p.execEnded("f") // not the exec awaited now
	if d := got("g", t0); d < wait || d > by {
		t.Errorf("g primed %v after its create, want %v", d, wait)
	}
	none(wait * 2)
}
