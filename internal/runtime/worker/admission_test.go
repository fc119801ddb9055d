package worker

import (
	"context"
	"testing"
	"time"
)

// TestGateBackfill: a request that fits goes ahead of a bigger one
// waiting for capacity (issue 29, item 12: one big request held every
// other creation for the queue's whole timeout); once the big one has
// waited half the timeout nothing passes it, and it is admitted as soon
// as capacity frees.
func TestGateBackfill(t *testing.T) {
	g := newGate(Admission{CPUOvercommit: 1, QueueTimeout: 2 * time.Second, MaxCreating: 10}, 2, 16<<30)
	ctx := context.Background()
	running := request{CPU: 1.5}
	if err := g.admit(ctx, running, nil); err != nil {
		t.Fatal(err)
	}
	g.created()
	big := make(chan error, 1)
	queued := make(chan struct{})
	go func() { big <- g.admit(ctx, request{CPU: 1}, func() { close(queued) }) }()
	<-queued
	t0 := time.Now()
	if err := g.admit(ctx, request{CPU: 0.4}, nil); err != nil || time.Since(t0) > 100*time.Millisecond {
		t.Fatalf("a small request behind a big one waited %v: %v", time.Since(t0), err)
	}
	g.created()
	g.release(request{CPU: 0.4})
	// Past half the timeout the big one is starving: a small one now
	// queues behind it.
	time.Sleep(time.Second + 50*time.Millisecond)
	small := make(chan error, 1)
	smallQueued := make(chan struct{})
	go func() { small <- g.admit(ctx, request{CPU: 0.1}, func() { close(smallQueued) }) }()
	select {
	case <-smallQueued:
	case err := <-small:
		t.Fatalf("a small request passed a starving one: %v", err)
	}
	g.release(running) // capacity frees: the big one first, then the small
	if err := <-big; err != nil {
		t.Fatalf("the big request: %v", err)
	}
	if err := <-small; err != nil {
		t.Fatalf("the small request: %v", err)
	}
}
