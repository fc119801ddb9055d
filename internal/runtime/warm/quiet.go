package warm

import (
	"context"
	"sync"
	"time"
)

// Quiet holds back what is made ahead of need while the requests it is
// told of are served: a sandbox primed or an init started while a
// create's first command runs takes the CPUs that command needs (on a
// 2-CPU host it made a first exec 5-8 ms slower, BENCHMARKS.md). Wait
// returns once no request has been served for After. A request holds it
// for Most from its start at the longest (a command that runs for
// minutes, a shell, an output followed holds nothing after that), and a
// Wait lasts Most at the longest, so a host that is never quiet still
// refills, one item per Most.
//
// A nil Quiet never holds anything back.
type Quiet struct {
	after, most time.Duration

	mu      sync.Mutex
	next    uint64
	serving map[uint64]time.Time // the requests being served, by when they began
	last    time.Time            // when a request last ended
	ended   chan struct{}        // closed, and replaced, when a request ends
}

// NewQuiet is a Quiet that waits for after without requests, and for
// most at the longest.
func NewQuiet(after, most time.Duration) *Quiet {
	return &Quiet{after: after, most: most, serving: map[uint64]time.Time{}, ended: make(chan struct{})}
}

// Enter tells q a request is being served, until the returned func is
// called (more calls do nothing).
func (q *Quiet) Enter() (leave func()) {
	if q == nil {
		return func() {}
	}
	q.mu.Lock()
	q.next++
	id := q.next
	q.serving[id] = time.Now()
	q.mu.Unlock()
	return func() {
		q.mu.Lock()
		defer q.mu.Unlock()
		if _, ok := q.serving[id]; !ok {
			return
		}
		delete(q.serving, id)
		q.last = time.Now()
		close(q.ended)
		q.ended = make(chan struct{})
	}
}

// Wait returns nil once no request has been served for q's After, the
// requests begun more than its Most ago aside, or once its Most has
// passed; ctx's error if it ends first.
func (q *Quiet) Wait(ctx context.Context) error {
	if q == nil {
		return ctx.Err()
	}
	deadline := time.Now().Add(q.most)
	for {
		q.mu.Lock()
		open := q.last.Add(q.after)
		for _, began := range q.serving {
			if t := began.Add(q.most); t.After(open) {
				open = t
			}
		}
		ended := q.ended
		q.mu.Unlock()
		now := time.Now()
		if !now.Before(open) || !now.Before(deadline) {
			return ctx.Err()
		}
		t := time.NewTimer(min(open.Sub(now), deadline.Sub(now)))
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-ended:
		case <-t.C:
		}
		t.Stop()
	}
}
