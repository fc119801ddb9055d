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
// returns once no request has been in flight for After, or at the
// latest Most after it was called, so a host that is never quiet still
// refills, one item per Most.
//
// A nil Quiet never holds anything back.
type Quiet struct {
	after, most time.Duration

	mu   sync.Mutex
	busy int
	last time.Time     // when busy last fell to 0
	idle chan struct{} // closed when busy falls to 0; nil while it is 0
}

// NewQuiet is a Quiet that waits for after without requests, and for
// most at the longest.
func NewQuiet(after, most time.Duration) *Quiet {
	return &Quiet{after: after, most: most}
}

// Enter tells q a request is being served, until the returned func is
// called (once).
func (q *Quiet) Enter() (leave func()) {
	if q == nil {
		return func() {}
	}
	q.mu.Lock()
	if q.busy == 0 {
		q.idle = make(chan struct{})
	}
	q.busy++
	q.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			q.mu.Lock()
			q.busy--
			if q.busy == 0 {
				q.last = time.Now()
				close(q.idle)
				q.idle = nil
			}
			q.mu.Unlock()
		})
	}
}

// Wait returns nil once no request has been served for q's After, or
// once q's Most has passed; ctx's error if it ends first.
func (q *Quiet) Wait(ctx context.Context) error {
	if q == nil {
		return ctx.Err()
	}
	deadline := time.Now().Add(q.most)
	for {
		now := time.Now()
		left := deadline.Sub(now)
		if left <= 0 {
			return ctx.Err()
		}
		q.mu.Lock()
		idle, wait := q.idle, left
		if idle == nil {
			if since := now.Sub(q.last); since >= q.after {
				q.mu.Unlock()
				return ctx.Err()
			} else {
				wait = min(q.after-since, left)
			}
		}
		q.mu.Unlock()
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-idle: // nil while quiet: only the timer then
		case <-t.C:
		}
		t.Stop()
	}
}
