package sdk_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/gateway"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// TestGatewayDiscovery: a gateway whose workers are discovered (as it
// follows a Kubernetes Service's endpoints) takes a worker at once when
// discovery names it; keeps one discovery no longer names while it
// answers (a worker's pod being replaced), its sandboxes served; drops
// one no longer named once it is silent; takes it back, its sandboxes
// with it, when it is named again. A worker whose certificate does not
// bear the server name given stays down, and says why.
func TestGatewayDiscovery(t *testing.T) {
	ctx := context.Background()
	a, b := startFleetWorker(t), startFleetWorker(t)
	found := make(chan []gateway.Worker)
	root := t.TempDir()
	tok, _, err := auth.Open(root).Create(auth.Admin, 0)
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := startGatewayWith(t, gateway.Config{Tokens: auth.Open(root), Heartbeat: 100 * time.Millisecond, DownAfter: 1500 * time.Millisecond,
		Discover: func(ctx context.Context, f func([]gateway.Worker)) error {
			for {
				select {
				case <-ctx.Done():
					return nil
				case ws := <-found:
					f(ws)
				}
			}
		}}, nil, worker.TLS{})
	c, err := sdk.New(sdk.Options{Host: "tcp://" + addr, Token: tok})
	if err != nil {
		t.Fatal(err)
	}
	of := func(w *fleetWorker) gateway.Worker { return gateway.Worker{URL: w.url, Token: w.admin, CA: w.ca} }
	fleet := func(want map[string]bool, what string) {
		t.Helper()
		var got []api.Node
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			got, err = c.Nodes(ctx)
			ok := err == nil && len(got) == len(want)
			for _, n := range got {
				if up, named := want[n.URL]; !named || up != n.Up {
					ok = false
				}
			}
			if ok {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the fleet is %+v (%v), want %v", what, got, err, want)
			}
		}
	}
	found <- []gateway.Worker{of(a)}
	fleet(map[string]bool{a.url: true}, "a discovered")
	found <- []gateway.Worker{of(a), of(b)}
	fleet(map[string]bool{a.url: true, b.url: true}, "b discovered")
	where := map[string]string{}
	for range 4 {
		sb, err := c.Create(ctx, api.SandboxSpec{Layers: []string{"ws:1", "bb:1"}, Memory: 64 << 20})
		if err != nil {
			t.Fatal(err)
		}
		where[sb.Info.Node] = sb.Name
	}
	onB := where[b.url]
	if onB == "" || where[a.url] == "" {
		t.Fatalf("creates placed on %v, want both workers", where)
	}
	exec := func(name string) error {
		var out bytes.Buffer
		res, err := c.Sandbox(name).Exec(ctx, sdk.ExecOptions{Args: []string{"echo", "hi"}, Stdout: &out})
		if err == nil && (res.ExitCode != 0 || out.String() != "hi\n") {
			t.Errorf("exec in %s: %+v %q", name, res, out.String())
		}
		return err
	}

	// No longer named, still answering: it stays.
	found <- []gateway.Worker{of(a)}
	time.Sleep(2 * time.Second) // (past DownAfter)
	fleet(map[string]bool{a.url: true, b.url: true}, "b no longer discovered, still answering")
	if err := exec(onB); err != nil {
		t.Errorf("exec in %s on a worker no longer discovered: %v", onB, err)
	}

	// Silent as well: it leaves.
	b.w.Crash()
	fleet(map[string]bool{a.url: true}, "b no longer discovered and silent")

	// Named again, started again: it joins, its sandboxes served.
	b.w = runtimetest.StartWorkerWith(t, b.w.Root, b.cfg)
	found <- []gateway.Worker{of(a), of(b)}
	fleet(map[string]bool{a.url: true, b.url: true}, "b discovered again")
	for deadline := time.Now().Add(5 * time.Second); exec(onB) != nil; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("exec in %s once b is back: %v", onB, exec(onB))
		}
	}

	// A server name its certificate does not bear.
	d := startFleetWorker(t)
	wrong := of(d)
	wrong.ServerName = "dsec-worker"
	found <- []gateway.Worker{of(a), of(b), wrong}
	fleet(map[string]bool{a.url: true, b.url: true, d.url: false}, "d with a wrong server name")
	time.Sleep(300 * time.Millisecond) // (a heartbeat's error)
	ns, err := c.Nodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range ns {
		if n.URL == d.url && !strings.Contains(n.Error, "dsec-worker") {
			t.Errorf("d's error: %q, want the certificate's refusal of dsec-worker", n.Error)
		}
	}
}

// TestGatewayDiscoveryAsksAtOnce: a worker discovered is asked how it
// is as it joins, not a heartbeat later: with heartbeats an hour apart,
// it is up, and takes a create, within seconds of being named (a
// gateway replica's first creates came before its first heartbeat).
func TestGatewayDiscoveryAsksAtOnce(t *testing.T) {
	ctx := context.Background()
	a := startFleetWorker(t)
	root := t.TempDir()
	tok, _, err := auth.Open(root).Create(auth.Admin, 0)
	if err != nil {
		t.Fatal(err)
	}
	addr, _ := startGatewayWith(t, gateway.Config{Tokens: auth.Open(root), Heartbeat: time.Hour, DownAfter: 5 * time.Second,
		Discover: func(ctx context.Context, f func([]gateway.Worker)) error {
			f([]gateway.Worker{{URL: a.url, Token: a.admin, CA: a.ca}})
			<-ctx.Done()
			return nil
		}}, nil, worker.TLS{})
	c, err := sdk.New(sdk.Options{Host: "tcp://" + addr, Token: tok})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		ns, err := c.Nodes(ctx)
		if err == nil && len(ns) == 1 && ns[0].Up {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the worker discovered is not up 5 s after it joined: %+v, %v", ns, err)
		}
	}
	sb, err := c.Create(ctx, api.SandboxSpec{Layers: []string{"ws:1", "bb:1"}, Memory: 64 << 20})
	if err != nil {
		t.Fatalf("a create once the worker joined: %v", err)
	}
	if err := sb.Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
}
