package warm

import (
	"context"
	"testing"
	"time"
)

// waited is how long q.Wait took.
func waited(t *testing.T, q *Quiet) time.Duration {
	t.Helper()
	t0 := time.Now()
	if err := q.Wait(context.Background()); err != nil {
		t.Fatal(err)
	}
	return time.Since(t0)
}

func TestQuiet(t *testing.T) {
	const after, most = 40 * time.Millisecond, 400 * time.Millisecond
	q := NewQuiet(after, most)
	if d := waited(t, q); d > after/2 {
		t.Errorf("a Quiet that never served a request held a wait %v", d)
	}

	// A request in flight holds a wait until it ends, and After more.
	go func(leave func()) {
		time.Sleep(100 * time.Millisecond)
		leave()
		leave() // a second call changes nothing
	}(q.Enter())
	if d := waited(t, q); d < 100*time.Millisecond+after || d >= most {
		t.Errorf("wait with a request of 100 ms in flight: %v, want 100 ms + %v, under %v", d, after, most)
	}
	// Right after a request ended, the rest of After.
	leave := q.Enter()
	leave()
	if d := waited(t, q); d < after*3/4 || d >= most {
		t.Errorf("wait right after a request: %v, want about %v", d, after)
	}

	// Never quiet: Most at the longest.
	leave = q.Enter()
	if d := waited(t, q); d < most || d > most+200*time.Millisecond {
		t.Errorf("wait while a request stays in flight: %v, want %v", d, most)
	}
	// Its context ends it sooner.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := q.Wait(ctx); err == nil {
		t.Error("a wait whose context ended said nothing")
	}
	leave()

	var none *Quiet // holds nothing back
	none.Enter()()
	if d := waited(t, none); d > after/2 {
		t.Errorf("a nil Quiet held a wait %v", d)
	}
}

// A pool with a Quiet makes nothing while a request is in flight, and
// refills once it ends.
func TestPoolWaitsForQuiet(t *testing.T) {
	it := &items{dead: map[int64]bool{}}
	q := NewQuiet(10*time.Millisecond, time.Hour)
	leave := q.Enter()
	p := New(Config[int64]{Size: 2, Make: it.make, Usable: it.usable, Discard: it.discard, RefillOnTake: true, Quiet: q})
	defer p.Close()
	time.Sleep(100 * time.Millisecond)
	if s := p.Stats(); s.Ready != 0 {
		t.Fatalf("made %d while a request was in flight", s.Ready)
	}
	leave()
	waitFor(t, "2 ready once quiet", func() bool { return p.Stats().Ready == 2 })

	leave = q.Enter()
	if _, ok := p.Take(); !ok {
		t.Fatal("take: none")
	}
	time.Sleep(100 * time.Millisecond)
	if s := p.Stats(); s.Ready != 1 {
		t.Fatalf("ready %d while a request was in flight, want 1 (none made)", s.Ready)
	}
	leave()
	waitFor(t, "refilled once quiet", func() bool { return p.Stats().Ready == 2 })

	// Close does not wait for quiet.
	leave = q.Enter()
	defer leave()
	p.Take()
	done := make(chan struct{})
	go func() { p.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close waited for a quiet host")
	}
}
