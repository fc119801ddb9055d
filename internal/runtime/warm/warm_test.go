package warm

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// items is a maker of numbered items that records what was discarded.
type items struct {
	next      atomic.Int64
	mu        sync.Mutex
	discarded []int64
	dead      map[int64]bool
}

func (it *items) make(context.Context) (int64, error) { return it.next.Add(1), nil }

func (it *items) usable(n int64) bool {
	it.mu.Lock()
	defer it.mu.Unlock()
	return !it.dead[n]
}

func (it *items) discard(n int64) {
	it.mu.Lock()
	defer it.mu.Unlock()
	it.discarded = append(it.discarded, n)
}

func (it *items) gone() []int64 {
	it.mu.Lock()
	defer it.mu.Unlock()
	return slices.Sorted(slices.Values(it.discarded))
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after 5 s: not %s", what)
		}
	}
}

func TestFillTakeRefill(t *testing.T) {
	it := &items{dead: map[int64]bool{}}
	p := New(Config[int64]{Size: 3, Make: it.make, Usable: it.usable, Discard: it.discard, RefillOnTake: true})
	waitFor(t, "3 ready", func() bool { return p.Stats().Ready == 3 })
	it.mu.Lock()
	it.dead[1] = true // died while it waited
	it.mu.Unlock()
	if n, ok := p.Take(); !ok || n != 2 {
		t.Fatalf("take: %d %v, want 2 (the oldest usable)", n, ok)
	}
	if g := it.gone(); !slices.Equal(g, []int64{1}) {
		t.Fatalf("discarded %v, want the dead one", g)
	}
	waitFor(t, "refilled to 3", func() bool { return p.Stats().Ready == 3 })
	s := p.Stats()
	if s.Takes != 1 || s.Misses != 0 || s.Err != nil {
		t.Fatalf("stats %+v", s)
	}
	p.Resize(1)
	if s := p.Stats(); s.Ready != 1 {
		t.Fatalf("after shrinking to 1: %d ready", s.Ready)
	}
	if g := it.gone(); len(g) != 3 || g[1] != 3 || g[2] != 4 {
		t.Fatalf("a shrink discards the oldest: %v", g)
	}
	left := p.Close()
	if !slices.Equal(left, []int64{5}) {
		t.Fatalf("close returned %v, want the newest", left)
	}
	if _, ok := p.Take(); ok {
		t.Fatal("a closed pool handed out an item")
	}
}

// Without RefillOnTake the pool refills on Kick only.
func TestRefillOnKick(t *testing.T) {
	it := &items{}
	p := New(Config[int64]{Size: 1, Make: it.make, Discard: it.discard})
	defer p.Close()
	waitFor(t, "1 ready", func() bool { return p.Stats().Ready == 1 })
	p.Take()
	time.Sleep(20 * time.Millisecond)
	if s := p.Stats(); s.Ready != 0 || it.next.Load() != 1 {
		t.Fatalf("refilled without a kick: %+v, %d made", s, it.next.Load())
	}
	if _, ok := p.Take(); ok || p.Stats().Misses != 1 {
		t.Fatalf("a take of an empty pool: %v, %+v", ok, p.Stats())
	}
	p.Kick()
	waitFor(t, "refilled after a kick", func() bool { return p.Stats().Ready == 1 })
}

// A failing recipe is retried after a backoff, and its error shown
// until it works; a kick retries at once.
func TestBackoff(t *testing.T) {
	var calls atomic.Int64
	fail := errors.New("no room")
	var failing atomic.Bool
	failing.Store(true)
	var waits []time.Duration
	var mu sync.Mutex
	p := New(Config[int]{Size: 1,
		Make: func(context.Context) (int, error) {
			calls.Add(1)
			if failing.Load() {
				return 0, fail
			}
			return 1, nil
		},
		Failed: func(err error, d time.Duration) { mu.Lock(); waits = append(waits, d); mu.Unlock() },
	})
	defer p.Close()
	waitFor(t, "two failures", func() bool { return calls.Load() >= 2 })
	if err := p.Stats().Err; !errors.Is(err, fail) {
		t.Fatalf("stats error %v", err)
	}
	mu.Lock()
	if waits[0] != minBackoff || waits[1] != 2*minBackoff {
		t.Fatalf("backoff %v, want doubling from %v", waits, minBackoff)
	}
	mu.Unlock()
	failing.Store(false)
	start := time.Now()
	p.Kick()
	waitFor(t, "made after the kick", func() bool { return p.Stats().Ready == 1 })
	if d := time.Since(start); d > time.Second {
		t.Fatalf("a kick waited out the backoff: %v", d)
	}
	if err := p.Stats().Err; err != nil {
		t.Fatalf("error after a success: %v", err)
	}
}

// Reset discards what the pool held and what it was making from the
// old recipe; Close waits for those discards.
func TestReset(t *testing.T) {
	it := &items{}
	release := make(chan struct{})
	slow := func(ctx context.Context) (int64, error) {
		<-release
		return 100, nil
	}
	p := New(Config[int64]{Size: 2, Discard: it.discard})
	if time.Sleep(10 * time.Millisecond); it.next.Load() != 0 || p.Stats().Ready != 0 {
		t.Fatal("a pool without a recipe made something")
	}
	p.Reset(it.make)
	if time.Sleep(10 * time.Millisecond); it.next.Load() != 0 {
		t.Fatal("a pool made from a new recipe before a kick")
	}
	p.Kick()
	waitFor(t, "2 ready", func() bool { return p.Stats().Ready == 2 })
	p.Reset(slow)
	p.Kick()
	waitFor(t, "making from the slow recipe", func() bool { return p.Stats().Filling == 1 })
	p.Reset(it.make) // while the slow one is under way
	close(release)
	waitFor(t, "2 ready again", func() bool { return p.Stats().Ready == 2 })
	left := p.Close()
	if g := it.gone(); !slices.Equal(g, []int64{1, 2, 100}) {
		t.Fatalf("discarded %v, want the first two and the one made from the old recipe", g)
	}
	if len(left) != 2 || left[0] == 100 {
		t.Fatalf("left %v", left)
	}
	p.Put(7)
	if g := it.gone(); !slices.Contains(g, 7) {
		t.Fatalf("put into a closed pool: %v", g)
	}
}

// Close cancels a make under way and discards what it made.
func TestCloseWhileMaking(t *testing.T) {
	it := &items{}
	started := make(chan struct{})
	p := New(Config[int64]{Size: 1, Discard: it.discard, Make: func(ctx context.Context) (int64, error) {
		close(started)
		<-ctx.Done()
		return 9, nil
	}})
	<-started
	if left := p.Close(); len(left) != 0 {
		t.Fatalf("left %v", left)
	}
	if g := it.gone(); !slices.Equal(g, []int64{9}) {
		t.Fatalf("discarded %v, want what the cancelled make returned", g)
	}
}

// After Close nothing stays in the pool, nor is made for it: an item
// made elsewhere and put in (a pool's first, made while the worker
// stops) is discarded, a new recipe makes nothing, a Take finds nothing.
func TestAfterClose(t *testing.T) {
	it := &items{}
	p := New(Config[int64]{Size: 2, Make: it.make, Discard: it.discard})
	waitFor(t, "2 ready", func() bool { return p.Stats().Ready == 2 })
	if left := p.Close(); len(left) != 2 {
		t.Fatalf("Close returned %v, want the 2 ready", left)
	}
	p.Put(100)
	p.Reset(it.make)
	p.Kick()
	if n, ok := p.Take(); ok {
		t.Fatalf("a closed pool handed out %d", n)
	}
	time.Sleep(20 * time.Millisecond) // a filler that still ran would make in this time
	if g := it.gone(); !slices.Equal(g, []int64{100}) || it.next.Load() != 2 {
		t.Fatalf("after Close: discarded %v, made %d, want 100 discarded and nothing made", g, it.next.Load())
	}
}

// A pool shrunk while it makes an item discards that item once made.
func TestShrinkWhileMaking(t *testing.T) {
	it := &items{}
	started, release := make(chan struct{}, 1), make(chan struct{})
	p := New(Config[int64]{Size: 1, Discard: it.discard, Make: func(ctx context.Context) (int64, error) {
		started <- struct{}{}
		<-release
		return it.make(ctx)
	}})
	defer p.Close()
	<-started
	p.Resize(0)
	close(release)
	waitFor(t, "the item made for the old size discarded", func() bool { return len(it.gone()) == 1 })
	if s := p.Stats(); s.Ready != 0 || s.Filling != 0 {
		t.Fatalf("after shrinking to 0 while making: %+v", s)
	}
}
