package sdk_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/sdk"
)

// freeAddr is a loopback TCP address nothing listens on now.
func freeAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().String()
}

// remoteWorker starts a worker that serves TCP with TLS on loopback, its
// clients' certificates signed by the CA it made; it returns the
// worker's root, a local client, the address and the certificates'
// directory.
func remoteWorker(t testing.TB, mtls bool) (string, *sdk.Client, string, string) {
	t.Helper()
	certs := t.TempDir()
	if err := auth.MakeCerts(certs, []string{"localhost", "127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	cfg := runtimetest.Config{Listen: []string{"tcp://" + addr},
		TLS: worker.TLS{Cert: filepath.Join(certs, auth.ServerFile), Key: filepath.Join(certs, auth.ServerKeyFile)}}
	if mtls {
		cfg.TLS.ClientCA = filepath.Join(certs, auth.CAFile)
	}
	w, c := setupWith(t, cfg)
	return w.Root, c, addr, certs
}

// remote is a client of the worker at addr with token, over TLS.
func remote(t *testing.T, addr, certs, token string, clientCert bool) *sdk.Client {
	t.Helper()
	o := sdk.Options{Host: "tcp://" + addr, Token: token, TLSCA: filepath.Join(certs, auth.CAFile)}
	if clientCert {
		o.ClientCert, o.ClientKey = filepath.Join(certs, auth.ClientFile), filepath.Join(certs, auth.ClientKeyFile)
	}
	c, err := sdk.New(o)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestRemoteAPI: over TCP with TLS, a token of scope sandboxes drives
// its own sandboxes as the unix socket does (streams, exit codes, exec
// ids replayed from another client, files, stop/start, pack-diff and
// branch), and sees nothing of another token's (404, as if it did not
// exist) nor may do what only the admin does (403); no token, a wrong
// one, an expired or removed one are 401 and nothing else; an admin
// token sees everything.
func TestRemoteAPI(t *testing.T) {
	root, local, addr, certs := remoteWorker(t, false)
	ctx := context.Background()
	tokens := auth.Open(root)
	ids := map[string]string{} // token: its id
	mint := func(scope string, ttl time.Duration) string {
		t.Helper()
		s, tok, err := tokens.Create(scope, ttl)
		if err != nil {
			t.Fatal(err)
		}
		ids[s] = tok.ID
		return s
	}
	aliceToken := mint(auth.Sandboxes, 0)
	alice := remote(t, addr, certs, aliceToken, false)
	bobToken := mint(auth.Sandboxes, 0)
	bob := remote(t, addr, certs, bobToken, false)
	admin := remote(t, addr, certs, mint(auth.Admin, 0), false)

	sb, err := alice.Create(ctx, api.SandboxSpec{Name: "a1", Layers: []string{"ws:1", "bb:1"}})
	if err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	res, err := sb.Exec(ctx, sdk.ExecOptions{ID: "s1", Args: []string{"sh", "-c", "echo out; echo err >&2; echo ran >> /ran; exit 3"}, Stdout: &out, Stderr: &errb})
	if err != nil || res.ExitCode != 3 || out.String() != "out\n" || errb.String() != "err\n" {
		t.Fatalf("exec over TCP: %+v %v %q %q", res, err, out.String(), errb.String())
	}
	// The same id from another client of the same token: the recorded
	// result, the command not run again.
	again := remote(t, addr, certs, aliceToken, false).Sandbox("a1")
	out.Reset()
	res, err = again.Exec(ctx, sdk.ExecOptions{ID: "s1", Args: []string{"sh", "-c", "echo out; echo err >&2; echo ran >> /ran; exit 3"}, Stdout: &out})
	if err != nil || !res.Replayed || res.ExitCode != 3 || out.String() != "out\n" {
		t.Fatalf("replay from another client: %+v %v %q", res, err, out.String())
	}
	if got, _ := run(t, again, "count", "wc -l < /ran"); strings.TrimSpace(got) != "1" {
		t.Fatalf("the step ran %s times", got)
	}
	if err := sb.WriteFile(ctx, "/in", strings.NewReader("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	var got bytes.Buffer
	if err := sb.ReadFile(ctx, "/in", &got); err != nil || got.String() != "data" {
		t.Fatalf("files: %q %v", got.String(), err)
	}
	if err := sb.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: "alice/a1:1"}); err != nil {
		t.Fatal(err)
	}
	branches, err := alice.Branch(ctx, api.BranchRequest{Snapshot: "alice/a1:1", N: 2})
	if err != nil || len(branches) != 2 {
		t.Fatalf("branch: %v %v", branches, err)
	}
	if out, _ := run(t, branches[1], "b", "cat /in"); out != "data" {
		t.Fatalf("a branch: %q", out)
	}
	if _, err := local.Create(ctx, api.SandboxSpec{Name: "admins", Layers: []string{"bb:1"}}); err != nil {
		t.Fatal(err)
	}

	// Bob sees none of it.
	if l, err := bob.List(ctx); err != nil || len(l) != 0 {
		t.Fatalf("bob lists %+v %v", l, err)
	}
	if s, err := bob.Snapshots(ctx); err != nil || len(s) != 0 {
		t.Fatalf("bob's snapshots %+v %v", s, err)
	}
	notFound := func(what string, err error) {
		t.Helper()
		if !errdefs.IsNotFound(err) {
			t.Errorf("bob %s: %v, want not found", what, err)
		}
	}
	_, err = bob.Sandbox("a1").Inspect(ctx)
	notFound("inspects a1", err)
	_, err = bob.Sandbox("admins").Inspect(ctx)
	notFound("inspects the admin's", err)
	_, err = bob.Sandbox("a1").Exec(ctx, sdk.ExecOptions{ID: "x", Args: []string{"true"}})
	notFound("execs in a1", err)
	notFound("reads a1's files", bob.Sandbox("a1").ReadFile(ctx, "/in", &got))
	notFound("stops a1", bob.Sandbox("a1").Stop(ctx))
	notFound("removes a1", bob.Sandbox("a1").Remove(ctx, true))
	_, err = bob.Branch(ctx, api.BranchRequest{Snapshot: "alice/a1:1", N: 1})
	notFound("branches alice's snapshot", err)
	_, err = bob.Create(ctx, api.SandboxSpec{Name: "b1", Snapshot: "alice/a1:1"})
	notFound("restores alice's snapshot", err)
	notFound("removes alice's snapshot", bob.RemoveSnapshot(ctx, "alice/a1:1", true))
	_, err = bob.Sandbox("a1").PackDiff(ctx, api.PackRequest{Tag: "bob/x:1"})
	notFound("packs a1", err)
	var missing *sdk.Error
	_, err = bob.Sandbox("nothing").Inspect(ctx)
	_, err2 := bob.Sandbox("a1").Inspect(ctx)
	if !errors.As(err, &missing) || err2 == nil || strings.Replace(err2.Error(), "a1", "nothing", 1) != err.Error() {
		t.Errorf("another token's sandbox is told apart from none: %v / %v", err2, err)
	}
	// What only the admin does.
	for what, err := range map[string]error{
		"shutdown":    bob.Shutdown(ctx),
		"pool":        func() error { _, err := bob.ResizePool(ctx, "p", api.PoolSpec{Size: 1}); return err }(),
		"save policy": bob.SavePolicy(ctx, "p", &api.Policy{}),
		"squash":      func() error { _, err := bob.Squash(ctx, "alice/a1:1", "x:1"); return err }(),
	} {
		if !errdefs.IsPermissionDenied(err) {
			t.Errorf("bob %s: %v, want permission denied", what, err)
		}
	}
	// The admin's token sees all.
	if l, err := admin.List(ctx); err != nil || len(l) != 4 {
		t.Fatalf("admin lists %d: %v", len(l), err)
	}
	if info, err := admin.Sandbox("a1").Inspect(ctx); err != nil || info.Owner != ids[aliceToken] {
		t.Fatalf("admin inspects a1: %+v %v", info, err)
	}

	// Tokens that are not.
	expired := mint(auth.Sandboxes, time.Second)
	time.Sleep(1100 * time.Millisecond)
	bobID := ids[bobToken]
	if err := tokens.Remove(bobID); err != nil {
		t.Fatal(err)
	}
	for what, tok := range map[string]string{"wrong": auth.Prefix + strings.Repeat("0", 40), "expired": expired, "removed": bobToken, "garbage": "x"} {
		_, err := remote(t, addr, certs, tok, false).List(ctx)
		var e *sdk.Error
		if !errdefs.IsUnauthorized(err) || !errors.As(err, &e) || e.API.Message != "unauthorized" {
			t.Errorf("%s token: %v", what, err)
		}
	}
	req, _ := http.NewRequest("GET", "https://"+addr+"/v1/sandboxes", nil)
	if resp, err := tlsClient(t, certs).Do(req); err != nil || resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("no token: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	if _, err := sdk.New(sdk.Options{Host: "tcp://" + addr}); !errdefs.IsUnauthorized(err) {
		t.Errorf("a client without a token: %v", err)
	}
	// Plain HTTP to the TLS listener is no way in.
	plain, err := sdk.New(sdk.Options{Host: "tcp://" + addr, Token: aliceToken})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := plain.List(ctx); err == nil {
		t.Error("plain HTTP to the TLS listener answered")
	}
	for _, s := range append(branches, sb) {
		if err := s.Remove(ctx, true); err != nil {
			t.Fatal(err)
		}
	}
	if err := local.Sandbox("admins").Remove(ctx, true); err != nil {
		t.Fatal(err)
	}
}

// TestRemoteMutualTLS: a worker given a client CA takes only clients
// with a certificate it signed.
func TestRemoteMutualTLS(t *testing.T) {
	root, _, addr, certs := remoteWorker(t, true)
	tok, _, err := auth.Open(root).Create(auth.Admin, 0)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if _, err := remote(t, addr, certs, tok, true).Version(ctx); err != nil {
		t.Fatalf("with the client certificate: %v", err)
	}
	if _, err := remote(t, addr, certs, tok, false).Version(ctx); !sdk.IsInfra(err) {
		t.Fatalf("without one: %v", err)
	}
}

func tlsClient(t *testing.T, certs string) *http.Client {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(certs, auth.CAFile))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(b)
	return &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}
}
