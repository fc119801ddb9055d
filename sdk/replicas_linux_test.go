package sdk_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// TestGatewayReplicas: two gateways of one fleet (replicas: one token
// store, no other state shared) hold nothing the other lacks. Creates
// of one name sent through both at once make one sandbox, the rest
// refused as a name taken; a batch's names likewise; a name removed
// is free again at once; a worker cordoned through one is cordoned for
// the other, and uncordoned through the other for the first.
func TestGatewayReplicas(t *testing.T) {
	ctx := context.Background()
	ws := []*fleetWorker{startFleetWorker(t), startFleetWorker(t), startFleetWorker(t)}
	root := t.TempDir()
	addr1, _ := startGateway(t, root, ws)
	addr2, _ := startGateway(t, root, ws)
	admin1, _, err := auth.Open(root).New(auth.Spec{Scope: auth.Admin})
	if err != nil {
		t.Fatal(err)
	}
	c1, err := sdk.New(sdk.Options{Host: "tcp://" + addr1, Token: admin1})
	if err != nil {
		t.Fatal(err)
	}
	c2 := gatewayClient(t, root, addr2, auth.Spec{Scope: auth.Admin})
	spec := api.SandboxSpec{Layers: []string{"bb:1"}, Memory: 64 << 20}

	// holders are the workers that hold a sandbox of name.
	holders := func(name string) []string {
		var out []string
		for _, w := range ws {
			c, err := sdk.New(sdk.Options{Host: w.url, Token: w.admin, TLSCA: w.ca})
			if err != nil {
				t.Fatal(err)
			}
			list, err := c.ListBrief(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, s := range list {
				if s.Name == name {
					out = append(out, w.url)
				}
			}
		}
		return out
	}

	for round := range 6 {
		name := fmt.Sprint("dup-", round)
		var mu sync.Mutex
		var made []string
		var wg sync.WaitGroup
		for i := range 4 {
			c := []*sdk.Client{c1, c2}[i%2]
			wg.Go(func() {
				s := spec
				s.Name = name
				sb, err := c.Create(ctx, s)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err == nil:
					made = append(made, sb.Info.Node)
				case !errdefs.IsAlreadyExists(err):
					t.Errorf("create %s: %v, want made or already exists", name, err)
				}
			})
		}
		wg.Wait()
		if h := holders(name); len(made) != 1 || len(h) != 1 {
			t.Errorf("4 creates of %s through two gateways at once: made on %v, held by %v; want one", name, made, h)
		}
	}

	// A batch's names against a create of one of them through the
	// other: the batch is made whole, or refused whole (its names are
	// claimed together), and the create is the other.
	var wg sync.WaitGroup
	var batchErr error
	batchMade := 0
	wg.Go(func() {
		s := spec
		s.Name = "bat"
		batchErr = c1.Batch(ctx, s, 4, func(item api.BatchItem) {
			if item.Sandbox != nil {
				batchMade++
			} else {
				t.Errorf("a batch's item: %+v", item.Error)
			}
		})
	})
	s := spec
	s.Name = api.BatchName("bat", 2)
	_, single := c2.Create(ctx, s)
	wg.Wait()
	switch {
	case batchErr == nil && batchMade == 4 && errdefs.IsAlreadyExists(single):
	case errdefs.IsAlreadyExists(batchErr) && single == nil:
	default:
		t.Errorf("a batch of bat-0..3 (%d made, %v) and a create of bat-2 (%v) through two gateways at once", batchMade, batchErr, single)
	}
	for i := range 4 {
		want := 1
		if batchErr != nil && i != 2 {
			want = 0
		}
		if h := holders(api.BatchName("bat", i)); len(h) != want {
			t.Errorf("%s is held by %v, want %d worker", api.BatchName("bat", i), h, want)
		}
	}

	// Removed, a name is free again at once (its claim let go).
	if err := c1.Sandbox("dup-0").Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	s = spec
	s.Name = "dup-0"
	if _, err := c1.Create(ctx, s); err != nil {
		t.Errorf("dup-0 made again at once: %v", err)
	}

	// Made, removed and made again at once, its claim not settled yet.
	s.Name = "quick"
	for i := range 3 {
		sb, err := c1.Create(ctx, s)
		if err != nil {
			t.Fatalf("quick, made the %d. time at once after its removal: %v", i+1, err)
		}
		if err := sb.Remove(ctx, true); err != nil {
			t.Fatal(err)
		}
	}

	// A cordon is the worker's: the other gateway sees it.
	if err := c1.Cordon(ctx, ws[0].url, true); err != nil {
		t.Fatal(err)
	}
	cordoned := func(c *sdk.Client, want bool) func() bool {
		return func() bool {
			nodes, err := c.Nodes(ctx)
			return err == nil && len(nodes) == 3 && nodes[0].Cordoned == want && !nodes[1].Cordoned && !nodes[2].Cordoned
		}
	}
	waitFor(t, "the second gateway to see the cordon", cordoned(c2, true))
	for range 3 {
		sb, err := c2.Create(ctx, spec)
		if err != nil {
			t.Fatal(err)
		}
		if sb.Info.Node == ws[0].url {
			t.Errorf("a create through the second gateway went to the cordoned worker")
		}
	}
	if err := c2.Cordon(ctx, ws[0].url, false); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the first gateway to see the cordon lifted", cordoned(c1, false))

	// What a gateway does not serve (a worker's own shutdown) says so.
	req, _ := http.NewRequest("POST", "http://"+addr1+"/v1/shutdown", nil)
	req.Header.Set("Authorization", "Bearer "+admin1)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var e api.Error
	json.NewDecoder(resp.Body).Decode(&e)
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotImplemented || !strings.Contains(e.Message, "the gateway does not serve") {
		t.Errorf("a worker's shutdown through a gateway: %s %+v", resp.Status, e)
	}
}

// TestClaimsOutliveTheWorker: the names gateways claim on a worker (the
// names' home) are kept across its restart, stopped or killed with -9
// once they were written: another holder's claim of one is refused by
// the worker started again, and a new name is claimed as before.
func TestClaimsOutliveTheWorker(t *testing.T) {
	fw := startFleetWorker(t)
	tlsConf, err := auth.ClientTLS(fw.ca, "", "")
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: tlsConf}}
	claim := func(name, holder string) int {
		t.Helper()
		b, _ := json.Marshal(api.ClaimRequest{Names: []string{name}, Holder: holder, TTLMillis: 60_000})
		req, _ := http.NewRequest("POST", "https://"+strings.TrimPrefix(fw.url, "tcp://")+"/v1/claims", strings.NewReader(string(b)))
		req.Header.Set("Authorization", "Bearer "+fw.admin)
		req.Header.Set("Content-Type", "application/json")
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode/100 == 2 {
			return http.StatusOK
		}
		return resp.StatusCode
	}
	for _, c := range []struct {
		name string
		stop func()
	}{
		{"kept-stopped", func() { fw.w.Stop(t, false) }},
		{"kept-killed", func() { time.Sleep(3 * claimsWritten); fw.w.Crash() }},
	} {
		if code := claim(c.name, "gateway-1"); code != http.StatusOK {
			t.Fatalf("claim %s: %d", c.name, code)
		}
		c.stop()
		fw.w = runtimetest.StartWorkerWith(t, fw.w.Root, fw.cfg)
		if code := claim(c.name, "gateway-2"); code != http.StatusConflict {
			t.Errorf("%s claimed by another once its worker restarted: %d, want 409", c.name, code)
		}
		if code := claim(c.name, "gateway-1"); code != http.StatusOK {
			t.Errorf("%s renewed by its holder once its worker restarted: %d", c.name, code)
		}
		if code := claim(c.name+"-new", "gateway-2"); code != http.StatusOK {
			t.Errorf("a new name claimed once its worker restarted: %d", code)
		}
	}
}

// claimsWritten is how often a worker writes its claims as they change.
const claimsWritten = 200 * time.Millisecond
