// Package warm keeps things made ahead of need: the one primitive under
// a worker's spare inits, its primed sandboxes and its FnCall pools, and
// under any backend that can start sandboxes before they are asked for
// (a microVM boots in seconds; a pool of booted ones is what makes it
// answer in milliseconds).
//
// A Pool holds up to its size of items, oldest first. One goroutine
// makes them, one at a time, whenever the pool is short; Take hands out
// the oldest that is still usable. A failure to make one is retried
// after a backoff that doubles from 100 ms to 10 s and is reset by the
// next success, and a Take or a Kick cuts the wait short. Reset changes
// what the pool makes (a new template, other layers): what it holds is
// discarded, and so is an item made from the old recipe while it
// changed.
package warm

import (
	"context"
	"sync"
	"time"
)

// The backoff after a failed make: doubled per failure, up to maxBackoff.
const (
	minBackoff = 100 * time.Millisecond
	maxBackoff = 10 * time.Second
)

// Config describes a pool of T.
type Config[T any] struct {
	// Size is how many items the pool keeps ready.
	Size int
	// Make makes one item; nil: the pool makes nothing until Reset
	// gives it a recipe.
	Make func(context.Context) (T, error)
	// Usable reports whether a ready item can still be handed out (a
	// spare init that died cannot); nil: always.
	Usable func(T) bool
	// Discard disposes of an item the pool will not hand out: dead, no
	// longer wanted, or made from an old recipe. It may be called from
	// the filler or from Take, never with the pool's lock held.
	Discard func(T)
	// Failed hears each failed make and how long the pool waits before
	// the next (a log line); nil: nobody.
	Failed func(err error, retry time.Duration)
	// RefillOnTake: a Take has the filler make a replacement at once. Without
	// it the pool refills only on Kick (a worker that answers its
	// request first, as primed sandboxes are).
	RefillOnTake bool
}

// Stats is what a pool did and holds.
type Stats struct {
	Ready, Filling int
	Takes, Misses  int64 // Takes that found nothing ready are Misses too
	Err            error // the last make's failure, nil after a success
}

// Pool is a pool of T made ahead.
type Pool[T any] struct {
	cfg Config[T]

	mu      sync.Mutex
	ready   []T
	gen     int // of the recipe; bumped by Reset
	filling int
	stats   Stats
	closed  bool
	// discarding: Reset's discards of what the pool held, which Close
	// waits for.
	discarding sync.WaitGroup

	kick chan struct{}
	stop chan struct{}
	done chan struct{}
}

// New starts a pool and its filler, which runs until Close.
func New[T any](cfg Config[T]) *Pool[T] {
	p := &Pool[T]{cfg: cfg, kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{})}
	go p.fill()
	return p
}

// Take hands out the oldest usable item; false when none is ready.
// Unusable items met on the way are discarded.
func (p *Pool[T]) Take() (T, bool) {
	var zero T
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return zero, false
	}
	p.stats.Takes++
	p.mu.Unlock()
	if p.cfg.RefillOnTake {
		defer p.Kick()
	}
	for {
		p.mu.Lock()
		if len(p.ready) == 0 {
			p.stats.Misses++
			p.mu.Unlock()
			return zero, false
		}
		it := p.ready[0]
		p.ready = p.ready[1:]
		p.mu.Unlock()
		if p.cfg.Usable == nil || p.cfg.Usable(it) {
			return it, true
		}
		p.discard(it)
	}
}

// Kick has the filler look again now: refill what was taken, retry a
// failure without waiting out its backoff.
func (p *Pool[T]) Kick() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// Resize sets how many items the pool keeps; a smaller pool discards
// its oldest beyond the new size.
func (p *Pool[T]) Resize(n int) {
	p.mu.Lock()
	p.cfg.Size = n
	var extra []T
	if over := len(p.ready) - max(n, 0); over > 0 {
		extra, p.ready = p.ready[:over], p.ready[over:]
	}
	p.mu.Unlock()
	for _, it := range extra {
		p.discard(it)
	}
	p.Kick()
}

// Reset gives the pool a new recipe, which it makes from on the next
// Kick (or Take, with RefillOnTake). What it holds is discarded now, in
// the background; an item being made from the old recipe is discarded
// once made.
func (p *Pool[T]) Reset(recipe func(context.Context) (T, error)) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.cfg.Make = recipe
	p.gen++
	old := p.ready
	p.ready = nil
	if len(old) > 0 {
		p.discarding.Go(func() {
			for _, it := range old {
				p.discard(it)
			}
		})
	}
	p.mu.Unlock()
}

// Put adds an item made elsewhere to the ready ones, as the newest (a
// pool's first, made while its creator waits); a closed pool discards
// it.
func (p *Pool[T]) Put(it T) {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		p.discard(it)
		return
	}
	p.ready = append(p.ready, it)
	p.mu.Unlock()
}

// Stats says what the pool holds and did.
func (p *Pool[T]) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.stats
	s.Ready, s.Filling = len(p.ready), p.filling
	return s
}

// Close stops the filler, waiting for a make under way and for Reset's
// discards, and returns what the pool held, for the caller to keep or
// discard.
func (p *Pool[T]) Close() []T {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	close(p.stop)
	<-p.done
	p.discarding.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	ready := p.ready
	p.ready = nil
	return ready
}

func (p *Pool[T]) discard(it T) {
	if p.cfg.Discard != nil {
		p.cfg.Discard(it)
	}
}

// fill makes items while the pool is short and waits for a kick when
// it is not; after a failure it waits, longer each time.
func (p *Pool[T]) fill() {
	defer close(p.done)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-p.stop:
			cancel()
		case <-p.done:
		}
	}()
	backoff := minBackoff
	for {
		p.mu.Lock()
		recipe, gen := p.cfg.Make, p.gen
		short := !p.closed && recipe != nil && len(p.ready)+p.filling < p.cfg.Size
		if short {
			p.filling++
		}
		p.mu.Unlock()
		if !short {
			select {
			case <-p.kick:
				continue
			case <-p.stop:
				return
			}
		}
		it, err := recipe(ctx)
		p.mu.Lock()
		p.filling--
		// Not kept: made from an old recipe, for a closed pool, or for
		// one shrunk meanwhile.
		keep := err == nil && gen == p.gen && !p.closed && len(p.ready) < p.cfg.Size
		if keep {
			p.ready = append(p.ready, it)
		}
		p.stats.Err = err
		p.mu.Unlock()
		if err == nil {
			if !keep {
				p.discard(it)
			}
			backoff = minBackoff
			continue
		}
		if p.cfg.Failed != nil {
			p.cfg.Failed(err, backoff)
		}
		select {
		case <-time.After(backoff):
			backoff = min(2*backoff, maxBackoff)
		case <-p.kick:
		case <-p.stop:
			return
		}
	}
}
