package sdk_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
	"github.com/dsec-project/dsec/internal/gateway"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/sdk"
)

// TestGatewayE2BReplicas: two gateways of one worker (one set of tokens),
// each with an E2B front that keeps nothing. A sandbox made through one
// is every replica's: its files, its description, its list entry and
// its timeout through the other; an access token opens its own sandbox
// alone, and dies with its owner's token; another tenant's key sees
// nothing. Its timeout is kept by the worker with no gateway running.
func TestGatewayE2BReplicas(t *testing.T) {
	ctx := context.Background()
	fw := startFleetWorker(t)
	tokens := t.TempDir()
	fronts := gatewayFronts(t, tokens, []*fleetWorker{fw}, 2)
	one, two := fronts[0].URL, fronts[1].URL
	store := auth.Open(tokens)
	admin, _, _ := store.Create(auth.Admin, 0)
	alice, aliceTok, _ := store.Create(auth.Sandboxes, 0)
	bob, _, _ := store.Create(auth.Sandboxes, 0)

	do := func(url, method, path string, header map[string]string, body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(method, url+path, strings.NewReader(body))
		for k, v := range header {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	key := func(k string) map[string]string {
		return map[string]string{"X-Api-Key": k, "Content-Type": "application/json"}
	}
	made := func(url, k string) (id, access string) {
		t.Helper()
		code, body := do(url, "POST", "/sandboxes", key(k), `{"templateID":"base","metadata":{"run":"r1"},"timeout":300}`)
		var out struct{ SandboxID, EnvdAccessToken string }
		json.Unmarshal([]byte(body), &out)
		if code != http.StatusCreated || out.EnvdAccessToken == "" {
			t.Fatalf("an E2B create: %d %s", code, body)
		}
		return out.SandboxID, out.EnvdAccessToken
	}
	envd := func(id, token string) map[string]string {
		return map[string]string{"E2b-Sandbox-Id": id, "X-Access-Token": token, "Content-Type": "application/octet-stream"}
	}
	aID, aAccess := made(one, alice)
	bID, bAccess := made(two, bob)
	adID, adAccess := made(two, admin)
	for _, f := range []struct{ id, access, text string }{{aID, aAccess, "alice"}, {bID, bAccess, "bob"}, {adID, adAccess, "admin"}} {
		if code, body := do(one, "POST", "/files?path=/tmp/by", envd(f.id, f.access), f.text); code != http.StatusOK {
			t.Fatalf("%s's file through the first replica: %d %s", f.text, code, body)
		}
	}
	for _, c := range []struct {
		what   string
		url    string
		method string
		path   string
		header map[string]string
		body   string
		code   int
		want   string
	}{
		{"her file, with her access token, through the other replica", two, "GET", "/files?path=/tmp/by", envd(aID, aAccess), "", 200, "alice"},
		{"her file, with her key", two, "GET", "/files?path=/tmp/by", envd(aID, alice), "", 200, "alice"},
		{"her file, with bob's key", two, "GET", "/files?path=/tmp/by", envd(aID, bob), "", 404, ""},
		{"her sandbox, with bob's access token", two, "GET", "/files?path=/tmp/by", envd(aID, bAccess), "", 401, ""},
		{"bob's sandbox, with her access token", one, "GET", "/files?path=/tmp/by", envd(bID, aAccess), "", 401, ""},
		{"bob's sandbox, with his access token", two, "GET", "/files?path=/tmp/by", envd(bID, bAccess), "", 200, "bob"},
		{"the admin's sandbox, with its access token", two, "GET", "/files?path=/tmp/by", envd(adID, adAccess), "", 200, "admin"},
		{"the admin's sandbox, with her access token", two, "GET", "/files?path=/tmp/by", envd(adID, aAccess), "", 401, ""},
		{"the admin's sandbox, with her key", two, "GET", "/files?path=/tmp/by", envd(adID, alice), "", 404, ""},
		{"a forged access token", two, "GET", "/files?path=/tmp/by", envd(aID, "envd_"+strings.Repeat("0", 64)), "", 401, ""},
		{"her sandbox described through the other replica", two, "GET", "/sandboxes/" + aID, key(alice), "", 200, `"templateID":"base"`},
		{"her sandbox, described to bob", two, "GET", "/sandboxes/" + aID, key(bob), "", 404, ""},
		{"her sandboxes listed through the other replica", two, "GET", "/v2/sandboxes?metadata=run%3Dr1", key(alice), "", 200, aID},
		{"her timeout set through the other replica", two, "POST", "/sandboxes/" + aID + "/timeout", key(alice), `{"timeout":900}`, 204, ""},
		{"her timeout set by bob", one, "POST", "/sandboxes/" + aID + "/timeout", key(bob), `{"timeout":1}`, 404, ""},
	} {
		code, body := do(c.url, c.method, c.path, c.header, c.body)
		if code != c.code || !strings.Contains(body, c.want) {
			t.Errorf("%s: %d %q, want %d %q", c.what, code, body, c.code, c.want)
		}
	}
	if code, body := do(two, "GET", "/v2/sandboxes", key(bob), ""); code != 200 || strings.Contains(body, aID) {
		t.Errorf("bob's list: %d %s: holds alice's sandbox", code, body)
	}
	// Where a relay goes is its path's to say, never a header's that a
	// proxy drops when Connection names it: a control route with a
	// forged access token is refused, not served as the owner's.
	for _, drop := range []string{"E2b-Sandbox-Id", "E2b-Sandbox-Id, E2b-Sandbox-Port, X-Access-Token"} {
		conn, err := net.Dial("tcp", strings.TrimPrefix(two, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "GET /sandboxes/%s HTTP/1.1\r\nHost: x\r\nX-Access-Token: envd_x\r\nE2b-Sandbox-Id: %s\r\nConnection: %s\r\n\r\n", aID, aID, drop)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		conn.Close()
		if resp.StatusCode != http.StatusUnauthorized || strings.Contains(string(b), aAccess) {
			t.Errorf("her description asked for with a forged access token, Connection: %s: %s %s", drop, resp.Status, b)
		}
	}
	// A fork relayed to the worker counts in the forker's quota.
	carol, _, _ := store.New(auth.Spec{Scope: auth.Sandboxes, Quota: auth.Quota{Sandboxes: 2}})
	cID, _ := made(one, carol)
	if code, body := do(two, "POST", "/sandboxes/"+cID+"/fork", key(carol), `{"count":2}`); code != http.StatusTooManyRequests || !strings.Contains(body, "quota") {
		t.Errorf("two forks of a sandbox of a quota of two: %d %s", code, body)
	}
	if code, body := do(two, "POST", "/sandboxes/"+cID+"/fork", key(carol), `{"count":1}`); code != http.StatusCreated {
		t.Errorf("one fork of a sandbox of a quota of two: %d %s", code, body)
	}
	if code, body := do(two, "GET", "/v2/sandboxes", key(carol), ""); code != 200 || strings.Count(body, `"sandboxID"`) != 2 {
		t.Errorf("carol's list: %d %s, want her two sandboxes", code, body)
	}
	direct, err := sdk.New(sdk.Options{Host: fw.url, Token: fw.admin, TLSCA: fw.ca})
	if err != nil {
		t.Fatal(err)
	}
	info, err := direct.Sandbox(aID).Inspect(ctx)
	if err != nil || info.E2B == nil || info.E2B.Template != "base" || info.E2B.Metadata["run"] != "r1" || time.Until(info.E2B.EndAt) < 800*time.Second ||
		info.E2B.AccessToken != "" {
		t.Errorf("her sandbox as its worker describes it: %+v %v", info.E2B, err)
	}
	// Her token removed, her access token opens nothing.
	if err := store.Remove(aliceTok.ID); err != nil {
		t.Fatal(err)
	}
	if code, body := do(two, "GET", "/files?path=/tmp/by", envd(aID, aAccess), ""); code != http.StatusUnauthorized {
		t.Errorf("her access token after her token was removed: %d %s", code, body)
	}
	// Bob's timeout passes with no gateway running: his worker's front
	// keeps it.
	if code, body := do(one, "POST", "/sandboxes/"+bID+"/timeout", key(bob), `{"timeout":1}`); code != http.StatusNoContent {
		t.Fatalf("bob's timeout: %d %s", code, body)
	}
	for _, f := range fronts {
		f.Close()
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := direct.Sandbox(bID).Inspect(ctx); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("bob's sandbox outlived its timeout by 10 s with no gateway running")
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, id := range []string{aID, adID} {
		if err := direct.Sandbox(id).Remove(ctx, true); err != nil {
			t.Error(err)
		}
	}
	all, _ := direct.List(ctx)
	for _, sb := range all { // carol's
		direct.Sandbox(sb.Name).Remove(ctx, true)
	}
}

// gatewayFronts starts n gateways of ws with one token store (in dir),
// each with an E2B front (template base: the test layers) served on
// loopback until the test ends.
func gatewayFronts(t testing.TB, dir string, ws []*fleetWorker, n int) []*httptest.Server {
	return gatewayFrontsOf(t, dir, ws, n, map[string]api.SandboxSpec{"base": {Layers: []string{"ws:1", "bb:1"}}}, nil)
}

// gatewayFrontsOf is gatewayFronts with base's templates, served over
// TLS with cert if not nil.
func gatewayFrontsOf(t testing.TB, dir string, ws []*fleetWorker, n int, base map[string]api.SandboxSpec, cert *tls.Certificate) []*httptest.Server {
	t.Helper()
	var fronts []*httptest.Server
	for range n {
		cfg := gateway.Config{Tokens: auth.Open(dir), Heartbeat: 100 * time.Millisecond, DownAfter: 1500 * time.Millisecond}
		for _, w := range ws {
			cfg.Workers = append(cfg.Workers, gateway.Worker{URL: w.url, Token: w.admin, CA: w.ca})
		}
		g, err := gateway.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		gctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		g.Heartbeat(gctx)
		go g.Run(gctx)
		inproc, stop := e2b.InProcess(gctx, g.ActAs())
		t.Cleanup(stop)
		front, err := e2b.New(e2b.Options{Transport: inproc, Fleet: g, Templates: base,
			Authorize: func(key string) (string, bool, error) {
				tok, err := cfg.Tokens.Check(key, time.Now())
				return tok.ID, tok.Scope == auth.Admin, err
			},
			Live: func(id string) bool { _, ok := cfg.Tokens.Lookup(id); return ok }})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewUnstartedServer(front)
		if cert != nil {
			srv.TLS = &tls.Config{Certificates: []tls.Certificate{*cert}}
			srv.StartTLS()
		} else {
			srv.Start()
		}
		t.Cleanup(srv.Close)
		fronts = append(fronts, srv)
	}
	return fronts
}

// TestGatewayE2BNeedsAFront: a worker whose E2B front cannot start (a
// damaged record in its root) still starts and serves dsec's API, says
// so in its version, and a gateway places no E2B sandbox there.
func TestGatewayE2BNeedsAFront(t *testing.T) {
	ctx := context.Background()
	good, bad := startFleetWorker(t), startFleetWorker(t)
	bad.w.Crash()
	if err := os.MkdirAll(filepath.Join(bad.w.Root, "e2b"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(bad.w.Root, "e2b", "damaged.json"), []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	bad.w = runtimetest.StartWorkerWith(t, bad.w.Root, bad.cfg)
	direct, err := sdk.New(sdk.Options{Host: bad.url, Token: bad.admin, TLSCA: bad.ca})
	if err != nil {
		t.Fatal(err)
	}
	if v, err := direct.Version(ctx); err != nil || v.E2B {
		t.Fatalf("the version of a worker whose E2B front failed: e2b %v, %v", v.E2B, err)
	}
	tokens := t.TempDir()
	front := gatewayFronts(t, tokens, []*fleetWorker{good, bad}, 1)[0]
	key, _, _ := auth.Open(tokens).Create(auth.Sandboxes, 0)
	time.Sleep(300 * time.Millisecond) // (a heartbeat or two)
	for range 4 {
		req, _ := http.NewRequest("POST", front.URL+"/sandboxes", strings.NewReader(`{"templateID":"base"}`))
		req.Header.Set("X-Api-Key", key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("an E2B create with one worker's front down: %s %s", resp.Status, b)
		}
	}
	if sbs, err := direct.List(ctx); err != nil || len(sbs) != 0 {
		t.Errorf("E2B sandboxes on the worker whose front failed: %d %v", len(sbs), err)
	}
	gd, _ := sdk.New(sdk.Options{Host: good.url, Token: good.admin, TLSCA: good.ca})
	sbs, _ := gd.List(ctx)
	for _, sb := range sbs {
		gd.Sandbox(sb.Name).Remove(ctx, true)
	}
	if len(sbs) != 4 {
		t.Errorf("%d E2B sandboxes on the worker whose front serves, want 4", len(sbs))
	}
}

// TestGatewayQuotaFleetWide: a tenant's quota holds across the fleet,
// not once per worker: with two sandboxes of a quota of three on one
// worker and one on the other, a fourth is refused whichever worker it
// would go to (before, each worker counted only its own).
func TestGatewayQuotaFleetWide(t *testing.T) {
	ctx := context.Background()
	ws := []*fleetWorker{startFleetWorker(t), startFleetWorker(t)}
	gwRoot := t.TempDir()
	addr, _ := startGateway(t, gwRoot, ws)
	admin := gatewayClient(t, gwRoot, addr, auth.Spec{Scope: auth.Admin})
	alice := gatewayClient(t, gwRoot, addr, auth.Spec{Scope: auth.Sandboxes, Quota: auth.Quota{Sandboxes: 3, Memory: 256 << 20}})
	spec := func(name string, mem int64) api.SandboxSpec {
		return api.SandboxSpec{Name: name, Layers: []string{"ws:1", "bb:1"}, Memory: mem}
	}
	// Each worker in turn the only one open: two on the first, one on
	// the second.
	for i, name := range []string{"q0", "q1", "q2"} {
		open, shut := ws[0], ws[1]
		if i == 2 {
			open, shut = ws[1], ws[0]
		}
		if err := admin.Cordon(ctx, shut.url, true); err != nil {
			t.Fatal(err)
		}
		if err := admin.Cordon(ctx, open.url, false); err != nil {
			t.Fatal(err)
		}
		sb, err := alice.Create(ctx, spec(name, 64<<20))
		if err != nil {
			t.Fatal(err)
		}
		if sb.Info.Node != open.url {
			t.Fatalf("%s went to %s, not %s, the only worker open", name, sb.Info.Node, open.url)
		}
	}
	// The second holds one of three: alone, it would take a fourth.
	if _, err := alice.Create(ctx, spec("q3", 64<<20)); !errdefs.IsResourceExhausted(err) {
		t.Errorf("a fourth sandbox of a quota of three, on the worker that holds one: %v", err)
	}
	if err := admin.Cordon(ctx, ws[0].url, false); err != nil {
		t.Fatal(err)
	}
	if _, err := alice.Create(ctx, spec("q3", 64<<20)); !errdefs.IsResourceExhausted(err) {
		t.Errorf("a fourth sandbox of a quota of three, either worker open: %v", err)
	}
	// Memory too, once one goes: with 128 MiB of a 256 MiB quota held,
	// a sandbox of 192 MiB does not fit, one of 128 MiB does.
	if err := alice.Sandbox("q0").Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
	if _, err := alice.Create(ctx, spec("q4", 192<<20)); !errdefs.IsResourceExhausted(err) {
		t.Errorf("a sandbox of 192 MiB with 128 MiB of a 256 MiB memory quota held: %v", err)
	}
	if _, err := alice.Create(ctx, spec("q4", 128<<20)); err != nil {
		t.Errorf("a sandbox of 128 MiB with 128 MiB of a 256 MiB memory quota held: %v", err)
	}
	for _, name := range []string{"q1", "q2", "q4"} {
		alice.Sandbox(name).Remove(ctx, true)
	}
}
