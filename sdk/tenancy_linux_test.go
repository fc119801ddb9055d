package sdk_test

import (
	"bytes"
	"cmp"
	"compress/gzip"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/containerd/errdefs"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
	fspb "github.com/dsec-project/dsec/internal/e2b/envd/filesystem"
	"github.com/dsec-project/dsec/internal/e2b/envd/filesystem/filesystemconnect"
	pb "github.com/dsec-project/dsec/internal/e2b/envd/process"
	"github.com/dsec-project/dsec/internal/e2b/envd/process/processconnect"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/layer/store"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
	"github.com/dsec-project/dsec/internal/runtime/vm"
	"github.com/dsec-project/dsec/internal/runtime/worker"
	"github.com/dsec-project/dsec/internal/snap"
	"github.com/dsec-project/dsec/sdk"
)

// The tenancy suite: tenants (tokens of scope sandboxes) share one
// worker over TCP with TLS and over its E2B front (TLS, HTTP/2), and
// each tries every route with the other's names, IDs, digests, digest
// prefixes and tags. What a tenant may not see answers exactly as what
// does not exist.

// tenancy is the suite's worker and what each party holds on it.
type tenancy struct {
	root, addr, front, certs string
	w                        *runtimetest.Worker
	local                    *sdk.Client // the admin, on the unix socket
	ids                      map[string]string
	tokens                   map[string]string // party: token
	c                        map[string]*sdk.Client
}

const tenancyPerToken = 8 // api.max_requests_per_token of the suite's worker

func newTenancy(t *testing.T) *tenancy {
	t.Helper()
	certs := t.TempDir()
	if err := auth.MakeCerts(certs, []string{"localhost", "127.0.0.1"}); err != nil {
		t.Fatal(err)
	}
	te := &tenancy{addr: freeAddr(t), front: freeAddr(t), certs: certs, ids: map[string]string{}, tokens: map[string]string{}, c: map[string]*sdk.Client{}}
	te.root = t.TempDir()
	runtimetest.Layers(t, te.root)
	// A root left open by an earlier layer build: the worker makes it
	// private as it starts.
	for _, p := range []string{te.root, filepath.Join(te.root, "store")} {
		os.Chmod(p, 0o755)
	}
	cfg := runtimetest.Config{Listen: []string{"tcp://" + te.addr},
		TLS: worker.TLS{Cert: filepath.Join(certs, auth.ServerFile), Key: filepath.Join(certs, auth.ServerKeyFile)},
		E2B: worker.E2B{Listen: te.front, HTTP2: true, Templates: map[string]api.SandboxSpec{
			"base":     {Layers: []string{"bb:1"}},
			"adm-tmpl": {Snapshot: "adm-snap:1"}, // the admin's snapshot, offered as a template
		}},
		Pools:               []worker.PoolConfig{{Name: "p", Size: 1, Spec: api.SandboxSpec{Layers: []string{"bb:1"}}}},
		MaxRequestsPerToken: tenancyPerToken,
		SnapLimits:          snap.Limits{MaxBytes: 1 << 20},
	}
	te.w, te.local = setupAt(t, te.root, cfg)
	for _, p := range []string{te.root, filepath.Join(te.root, "store")} {
		if fi, err := os.Stat(p); err != nil || fi.Mode().Perm() != 0o700 {
			t.Errorf("%s after the worker's start: %v %v", p, fi.Mode(), err)
		}
	}
	for party, spec := range map[string]auth.Spec{
		"a": {Scope: auth.Sandboxes}, "b": {Scope: auth.Sandboxes}, "admin": {Scope: auth.Admin},
		"free":   {Scope: auth.Sandboxes, Allow: []string{auth.AllowPolicy, auth.AllowUnlimited}},
		"quota":  {Scope: auth.Sandboxes, Quota: auth.Quota{Sandboxes: 2, Memory: 1 << 30}},
		"snapq":  {Scope: auth.Sandboxes, Quota: auth.Quota{SnapshotBytes: 64 << 10}},
		"slots1": {Scope: auth.Sandboxes},
		"listed": {Scope: auth.Sandboxes, Policies: []string{"stored"}},
		"gone":   {Scope: auth.Sandboxes},
	} {
		secret, tok, err := auth.Open(te.root).New(spec)
		if err != nil {
			t.Fatal(err)
		}
		te.tokens[party], te.ids[party] = secret, tok.ID
		te.c[party] = remote(t, te.addr, certs, secret, false)
	}
	return te
}

// tlsHTTP is an HTTP client that trusts the suite's CA (HTTP/2 where
// the server offers it).
func (te *tenancy) tlsHTTP(t *testing.T) *http.Client {
	b, err := os.ReadFile(filepath.Join(te.certs, auth.CAFile))
	if err != nil {
		t.Fatal(err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(b)
	return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, ForceAttemptHTTP2: true}}
}

// e2bDo sends a control plane request to the front with key.
func (te *tenancy) e2bDo(t *testing.T, hc *http.Client, method, path, key string, body any) (int, []byte) {
	t.Helper()
	var r io.Reader
	if body != nil {
		b, _ := json.Marshal(body)
		r = bytes.NewReader(b)
	}
	req, _ := http.NewRequest(method, "https://"+te.front+path, r)
	if key != "" {
		req.Header.Set("X-API-KEY", key)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, out
}

// e2bCreate makes an E2B sandbox of template with key: its id and envd
// access token.
func (te *tenancy) e2bCreate(t *testing.T, hc *http.Client, key, template string) (string, string) {
	t.Helper()
	code, body := te.e2bDo(t, hc, "POST", "/sandboxes", key, map[string]any{"templateID": template})
	if code != http.StatusCreated {
		t.Fatalf("e2b create %s: %d %s", template, code, body)
	}
	var a struct {
		SandboxID       string `json:"sandboxID"`
		EnvdAccessToken string `json:"envdAccessToken"`
	}
	json.Unmarshal(body, &a)
	return a.SandboxID, a.EnvdAccessToken
}

// envd is a Connect client of sandbox id's envd with token.
func (te *tenancy) envd(hc *http.Client, id, token string) (processconnect.ProcessClient, filesystemconnect.FilesystemClient) {
	i := connect.WithInterceptors(headers{"E2b-Sandbox-Id": id, "X-Access-Token": token})
	return processconnect.NewProcessClient(hc, "https://"+te.front, i), filesystemconnect.NewFilesystemClient(hc, "https://"+te.front, i)
}

// headers sets a client's requests' headers.
type headers map[string]string

func (h headers) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, r connect.AnyRequest) (connect.AnyResponse, error) {
		for k, v := range h {
			r.Header().Set(k, v)
		}
		return next(ctx, r)
	}
}

func (h headers) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, s connect.Spec) connect.StreamingClientConn {
		c := next(ctx, s)
		for k, v := range h {
			c.RequestHeader().Set(k, v)
		}
		return c
	}
}

func (h headers) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// statOK stats / in a sandbox through envd.
func statOK(fsc filesystemconnect.FilesystemClient) error {
	_, err := fsc.Stat(context.Background(), connect.NewRequest(&fspb.StatRequest{Path: "/"}))
	return err
}

// run1 runs a command through envd and returns its stdout.
func run1(pc processconnect.ProcessClient, script string) (string, error) {
	st, err := pc.Start(context.Background(), connect.NewRequest(&pb.StartRequest{Process: &pb.ProcessConfig{Cmd: "sh", Args: []string{"-c", script}}}))
	if err != nil {
		return "", err
	}
	defer st.Close()
	var out bytes.Buffer
	for st.Receive() {
		if d := st.Msg().GetEvent().GetData(); d != nil {
			out.Write(d.GetStdout())
		}
	}
	return out.String(), st.Err()
}

// sameAnswer: err, a call about what another tenant holds (named by
// name), is not found and reads as err0, the same call about a name
// that names nothing (fake): nothing tells the two apart.
func sameAnswer(t *testing.T, what string, err, err0 error, name, fake string) {
	t.Helper()
	if err == nil {
		t.Errorf("%s: it worked", what)
		return
	}
	if err0 == nil {
		t.Errorf("%s: the fake %s worked", what, fake)
		return
	}
	if !errdefs.IsNotFound(err) && !errdefs.IsPermissionDenied(err) && !errdefs.IsInvalidArgument(err) {
		t.Errorf("%s: %v, want not found", what, err)
	}
	if got, want := strings.ReplaceAll(err.Error(), name, fake), err0.Error(); got != want {
		t.Errorf("%s: told apart from nothing:\n  %s\n  %s", what, got, want)
	}
}

// randHex is n random hex digits.
func randHex(n int) string {
	b := make([]byte, (n+1)/2)
	rand.Read(b)
	return hex.EncodeToString(b)[:n]
}

// TestTenancy: see the suite's comment above.
func TestTenancy(t *testing.T) {
	te := newTenancy(t)
	ctx := context.Background()
	a, b, admin := te.c["a"], te.c["b"], te.c["admin"]
	hc := te.tlsHTTP(t)

	// What A holds: a sandbox, a step, snapshots (one under the tag of
	// a base layer: a squat), and an E2B sandbox.
	asb, err := a.Create(ctx, api.SandboxSpec{Name: "a-sb", Layers: []string{"ws:1", "bb:1"}})
	if err != nil {
		t.Fatal(err)
	}
	if out, _ := run(t, asb, "a-step", "echo secret-a > /work/secret; echo trojan > /etc/answer; echo out-a"); out != "out-a\n" {
		t.Fatalf("a's step: %q", out)
	}
	asnap, err := asb.PackDiff(ctx, api.PackRequest{Tag: "a-snap:1"})
	if err != nil || asnap.Name != "a-snap:1" {
		t.Fatalf("a's snapshot: %+v %v", asnap, err)
	}
	if _, err := asb.PackDiff(ctx, api.PackRequest{Tag: "bb:2"}); err != nil {
		t.Fatalf("a's snapshot tagged bb:2: %v", err)
	}
	ahex := strings.TrimPrefix(asnap.Digest, "sha256:")
	aeID, aeToken := te.e2bCreate(t, hc, te.tokens["a"], "base")
	// The admin's: a snapshot, made over the socket.
	adm, err := te.local.Create(ctx, api.SandboxSpec{Name: "adm-sb", Layers: []string{"bb:1"}})
	if err != nil {
		t.Fatal(err)
	}
	run(t, adm, "w", "echo admin-secret > /root/secret")
	admSnap, err := adm.PackDiff(ctx, api.PackRequest{Tag: "adm-snap:1"})
	if err != nil {
		t.Fatal(err)
	}
	// A full VM's snapshots, A's and the admin's, as a worker records
	// them: a block diff over a VM image's disk (no VM boots here).
	vmSnapshot(t, te.root, "tenants/"+te.ids["a"]+"/a-vm:1")
	vmSnapshot(t, te.root, "adm-vm:1")
	// B's own sandbox, to try A's exec ids and files from.
	bsb, err := b.Create(ctx, api.SandboxSpec{Name: "b-sb", Layers: []string{"bb:1"}})
	if err != nil {
		t.Fatal(err)
	}

	t.Run("refs", func(t *testing.T) {
		// Every way B may name A's snapshot, or the admin's, and a name
		// of the same shape that names nothing.
		other := randHex(64)
		refs := []struct{ name, ref, fake string }{
			{"a's tag", "a-snap:1", "zz-snap:1"},
			{"a's tag in its namespace", "tenants/" + te.ids["a"] + "/a-snap:1", "tenants/" + te.ids["a"] + "/zz-snap:1"},
			{"a's digest", asnap.Digest, "sha256:" + other},
			{"a's digest, bare", ahex, other},
			{"a's digest prefix", ahex[:12], other[:12]},
			{"the admin's snapshot", "adm-snap:1", "zz-snap:1"},
			{"the admin's snapshot's digest prefix", strings.TrimPrefix(admSnap.Digest, "sha256:")[:16], other[:16]},
			{"a's VM snapshot", "a-vm:1", "zz-vm:1"},
			{"a's VM snapshot in its namespace", "tenants/" + te.ids["a"] + "/a-vm:1", "tenants/" + te.ids["a"] + "/zz-vm:1"},
			{"the admin's VM snapshot", "adm-vm:1", "zz-vm:1"},
		}
		routes := []struct {
			name string
			call func(ref string) error
		}{
			{"create on layers", func(ref string) error {
				_, err := b.Create(ctx, api.SandboxSpec{Layers: []string{ref, "bb:1"}})
				return err
			}},
			{"create on a snapshot", func(ref string) error {
				_, err := b.Create(ctx, api.SandboxSpec{Snapshot: ref})
				return err
			}},
			{"branch", func(ref string) error {
				_, err := b.Branch(ctx, api.BranchRequest{Snapshot: ref, N: 2, NamePrefix: "br"})
				return err
			}},
			{"call", func(ref string) error {
				_, err := b.Call(ctx, sdk.CallOptions{Spec: &api.SandboxSpec{Layers: []string{ref, "bb:1"}}, ExecOptions: sdk.ExecOptions{Args: []string{"cat", "/work/secret"}}})
				return err
			}},
			{"batch", func(ref string) error {
				var said error // (its first item's: each answers alike)
				err := b.Batch(ctx, api.SandboxSpec{Snapshot: ref}, 2, func(it api.BatchItem) {
					switch {
					case it.Sandbox != nil:
						said = fmt.Errorf("made %s", it.Sandbox.Name)
					case said == nil:
						said = it.Error
					}
				})
				return cmp.Or(err, said)
			}},
			{"remove snapshot", func(ref string) error { return b.RemoveSnapshot(ctx, ref, true) }},
			{"snapshot by name", func(ref string) error { _, err := b.Snapshot(ctx, ref); return err }},
			{"e2b create", func(ref string) error {
				code, body := te.e2bDo(t, hc, "POST", "/sandboxes", te.tokens["b"], map[string]any{"templateID": ref})
				if code == http.StatusCreated {
					return nil
				}
				var e struct{ Message string }
				json.Unmarshal(body, &e)
				if code == http.StatusNotFound {
					return fmt.Errorf("%s: %w", e.Message, errdefs.ErrNotFound)
				}
				return fmt.Errorf("%d %s", code, e.Message)
			}},
		}
		for _, r := range refs {
			for _, route := range routes {
				sameAnswer(t, route.name+" with "+r.name, route.call(r.ref), route.call(r.fake), r.ref, r.fake)
			}
		}
		if l, err := b.List(ctx); err != nil || len(l) != 1 || l[0].Name != "b-sb" {
			t.Errorf("b lists %+v %v", l, err)
		}
		if s, err := b.Snapshots(ctx); err != nil || len(s) != 0 {
			t.Errorf("b's snapshots: %+v %v", s, err)
		}
		// A names its own, by tag, digest and prefix, and sees its own
		// names (never the namespace).
		for _, ref := range []string{"a-snap:1", asnap.Digest, ahex[:12]} {
			sb, err := a.Create(ctx, api.SandboxSpec{Snapshot: ref})
			if err != nil {
				t.Fatalf("a restores its snapshot by %s: %v", ref, err)
			}
			if out, _ := run(t, sb, "r", "cat /work/secret"); out != "secret-a\n" {
				t.Errorf("a's restore by %s: %q", ref, out)
			}
			if info, _ := sb.Inspect(ctx); ref == "a-snap:1" && info.Snapshot != "a-snap:1" {
				t.Errorf("a sees its sandbox on %q", info.Snapshot)
			}
			sb.Remove(ctx, true)
		}
		var mine []string
		if s, err := a.Snapshots(ctx); err == nil {
			for _, n := range s {
				mine = append(mine, n.Name)
			}
		}
		if slices.Sort(mine); !slices.Equal(mine, []string{"a-snap:1", "a-vm:1", "bb:2"}) {
			t.Errorf("a's snapshots: %v", mine)
		}
		if n, err := a.Snapshot(ctx, "a-vm:1"); err != nil || n.Name != "a-vm:1" || n.Parent != "vm-base:1" {
			t.Errorf("a's VM snapshot by name: %+v %v", n, err)
		}
		if n, err := a.Snapshot(ctx, "a-snap:1"); err != nil || n.Name != "a-snap:1" || n.Digest != asnap.Digest {
			t.Errorf("a's snapshot by name: %+v %v", n, err)
		}
		if _, err := a.Snapshot(ctx, "bb:1"); !errdefs.IsNotFound(err) { // a layer
			t.Errorf("a layer as a snapshot: %v", err)
		}
		// The admin sees A's by their whole tags.
		all, _ := admin.Snapshots(ctx)
		var whole []string
		for _, n := range all {
			whole = append(whole, n.Name)
		}
		if !strings.Contains(strings.Join(whole, " "), "tenants/"+te.ids["a"]+"/a-snap:1") {
			t.Errorf("the admin's snapshot list: %v", whole)
		}
		// B may use what the admin built, by tag or digest prefix, and
		// the admin's snapshot only through the template that offers it.
		bb, err := layer.Resolve(ctx, mustStore(t, te.root), "bb:1")
		if err != nil {
			t.Fatal(err)
		}
		sb, err := b.Create(ctx, api.SandboxSpec{Layers: []string{bb.Digest.Encoded()[:12]}})
		if err != nil {
			t.Fatalf("b on the admin's layer by a digest prefix: %v", err)
		}
		sb.Remove(ctx, true)
		id, _ := te.e2bCreate(t, hc, te.tokens["b"], "adm-tmpl")
		if err := b.Sandbox(id).Remove(ctx, true); err != nil {
			t.Errorf("b's sandbox of the admin's template: %v", err)
		}
		if res, err := b.Call(ctx, sdk.CallOptions{Pool: "p", ExecOptions: sdk.ExecOptions{Args: []string{"true"}}}); err != nil || res.ExitCode != 0 {
			t.Errorf("b's call in the admin's pool: %+v %v", res, err)
		}
	})

	t.Run("images", func(t *testing.T) {
		// A tenant's create may not make the worker fetch from its own
		// host or a private network (a registry only it reaches, a
		// metadata service), on the API or through the E2B front: the
		// pull's dialer refuses every address that is not public,
		// whatever name led there.
		for _, img := range []string{"127.0.0.1:5000/x:1", "10.0.0.1:5000/x:1", "169.254.169.254/latest:1", "localhost:5000/x:1"} {
			_, err := b.Create(ctx, api.SandboxSpec{Image: img})
			if !errdefs.IsPermissionDenied(err) {
				t.Errorf("b's create on %s: %v, want permission denied", img, err)
			}
			code, body := te.e2bDo(t, hc, "POST", "/sandboxes", te.tokens["b"], map[string]any{"templateID": "base", "metadata": map[string]string{"image": img}})
			if code != http.StatusForbidden {
				t.Errorf("b's E2B create on %s: %d %s, want 403", img, code, body)
			}
		}
		if l, err := b.List(ctx); err != nil || len(l) != 1 {
			t.Errorf("b lists %+v %v", l, err)
		}
	})

	t.Run("squatting", func(t *testing.T) {
		// A's bb:2 is A's alone: B finds none, the admin builds its own.
		_, err := b.Create(ctx, api.SandboxSpec{Layers: []string{"bb:2"}})
		if !errdefs.IsNotFound(err) {
			t.Fatalf("b on bb:2 before the admin built one: %v", err)
		}
		s := mustStore(t, te.root)
		base := layertest.BusyboxRoot(t, t.TempDir())
		os.WriteFile(filepath.Join(base, "etc", "answer"), []byte("admin's 2\n"), 0o644)
		ref, _ := layer.ParseRef("bb:2")
		if _, err := layer.Build(ctx, s, layer.BuildOptions{Source: base, Kind: layer.KindBase, Ref: ref}); err != nil {
			t.Fatalf("the admin's layer build -t bb:2: %v", err)
		}
		for who, spec := range map[string]api.SandboxSpec{"b": {Layers: []string{"bb:2", "bb:1"}}, "a": {Snapshot: "bb:2"}} {
			want := map[string]string{"b": "admin's 2\n", "a": "trojan\n"}[who]
			sb, err := te.c[who].Create(ctx, spec)
			if err != nil {
				t.Fatalf("%s on bb:2: %v", who, err)
			}
			if out, _ := run(t, sb, "c", "cat /etc/answer"); out != want {
				t.Errorf("%s's bb:2 says %q, want %q", who, out, want)
			}
			sb.Remove(ctx, true)
		}
		// A tag in another's namespace is refused as any such tag.
		fakeID := randHex(12)
		_, e1 := bsb.PackDiff(ctx, api.PackRequest{Tag: "tenants/" + te.ids["a"] + "/a-snap:1"})
		_, e2 := bsb.PackDiff(ctx, api.PackRequest{Tag: "tenants/" + fakeID + "/a-snap:1"})
		if !errdefs.IsInvalidArgument(e1) || e2 == nil || strings.ReplaceAll(e1.Error(), te.ids["a"], fakeID) != e2.Error() {
			t.Errorf("b packs into a's namespace: %v / %v", e1, e2)
		}
	})

	t.Run("sandbox routes", func(t *testing.T) {
		routes := []struct {
			name string
			call func(sb *sdk.Sandbox) error
		}{
			{"inspect", func(sb *sdk.Sandbox) error { _, err := sb.Inspect(ctx); return err }},
			{"stop", func(sb *sdk.Sandbox) error { return sb.Stop(ctx) }},
			{"start", func(sb *sdk.Sandbox) error { return sb.Start(ctx) }},
			{"pause", func(sb *sdk.Sandbox) error { return sb.Pause(ctx) }},
			{"resume", func(sb *sdk.Sandbox) error { return sb.Resume(ctx) }},
			{"evict", func(sb *sdk.Sandbox) error { return sb.Evict(ctx) }},
			{"exec", func(sb *sdk.Sandbox) error {
				_, err := sb.Exec(ctx, sdk.ExecOptions{ID: "a-step", Args: []string{"true"}})
				return err
			}},
			{"logs", func(sb *sdk.Sandbox) error {
				_, err := sb.Logs(ctx, "a-step", false, io.Discard, io.Discard)
				return err
			}},
			{"signal", func(sb *sdk.Sandbox) error { return sb.Signal(ctx, "a-step", syscall.SIGKILL) }},
			{"write", func(sb *sdk.Sandbox) error { return sb.WriteFile(ctx, "/work/x", strings.NewReader("x"), 0o644) }},
			{"read", func(sb *sdk.Sandbox) error { return sb.ReadFile(ctx, "/work/secret", io.Discard) }},
			{"stat", func(sb *sdk.Sandbox) error { _, err := sb.Stat(ctx, "/work/secret", false); return err }},
			{"list", func(sb *sdk.Sandbox) error { _, err := sb.ListDir(ctx, "/work", 1); return err }},
			{"mkdir", func(sb *sdk.Sandbox) error { _, err := sb.MakeDir(ctx, "/work/d", true); return err }},
			{"rename", func(sb *sdk.Sandbox) error { _, err := sb.Rename(ctx, "/work/secret", "/work/s2"); return err }},
			{"rm path", func(sb *sdk.Sandbox) error { return sb.RemovePath(ctx, "/work/secret", false) }},
			{"copy from", func(sb *sdk.Sandbox) error {
				s, _, err := sb.CopyFrom(ctx, "/work", sdk.CopyFromOptions{})
				if s != nil {
					s.Close()
				}
				return err
			}},
			{"copy to", func(sb *sdk.Sandbox) error {
				_, err := sb.CopyTo(ctx, "/work", bytes.NewReader(emptyTar()), false)
				return err
			}},
			{"pack", func(sb *sdk.Sandbox) error { _, err := sb.PackDiff(ctx, api.PackRequest{Tag: "stolen:1"}); return err }},
			{"policy", func(sb *sdk.Sandbox) error {
				_, err := sb.ApplyPolicy(ctx, api.PolicyRequest{Policy: &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy"}})
				return err
			}},
			{"branch like", func(sb *sdk.Sandbox) error {
				_, err := b.Branch(ctx, api.BranchRequest{Snapshot: "zz-snap:1", N: 1, Like: sb.Name})
				return err
			}},
			{"port", func(sb *sdk.Sandbox) error {
				req, _ := http.NewRequest("GET", "https://"+te.addr+"/v1/sandboxes/"+sb.Name+"/ports/8080/", nil)
				req.Header.Set("Authorization", "Bearer "+te.tokens["b"])
				resp, err := hc.Do(req)
				if err != nil {
					return err
				}
				defer resp.Body.Close()
				var e api.Error
				if resp.StatusCode/100 == 2 || json.NewDecoder(resp.Body).Decode(&e) != nil {
					return nil
				}
				return &e
			}},
			{"grade", func(sb *sdk.Sandbox) error {
				_, err := sb.Grade(ctx, api.GradeRequest{ID: "g", Grader: []string{"bb:1"}, Carry: []string{"/work/**"}, Args: []string{"true"}})
				return err
			}},
			{"fork", func(sb *sdk.Sandbox) error { _, err := sb.Fork(ctx, api.ForkRequest{N: 1}); return err }},
			{"idle", func(sb *sdk.Sandbox) error { _, err := sb.Idle(ctx, time.Minute); return err }},
			{"screen", func(sb *sdk.Sandbox) error { _, _, err := sb.Screenshot(ctx); return err }},
			{"input", func(sb *sdk.Sandbox) error { return sb.Type(ctx, "x") }},
			{"vnc", func(sb *sdk.Sandbox) error { _, err := sb.VNC(ctx); return err }},
			{"vnc revoke", func(sb *sdk.Sandbox) error { return sb.RevokeVNC(ctx) }},
			{"vnc socket", func(sb *sdk.Sandbox) error { // no grant: every token and name alike
				_, err := b.DialVNC(ctx, api.VNC{Sandbox: sb.Name, Path: api.VNCPath(sb.Name), Token: te.tokens["b"]})
				return err
			}},
			{"remove", func(sb *sdk.Sandbox) error { return sb.Remove(ctx, true) }},
		}
		for _, r := range routes {
			for _, target := range []string{"a-sb", "adm-sb", aeID} {
				sameAnswer(t, r.name+" of "+target, r.call(b.Sandbox(target)), r.call(b.Sandbox("zz-sb")), target, "zz-sb")
			}
		}
		// A's step is A's: B's own sandbox has no exec of that id.
		if _, err := bsb.Logs(ctx, "a-step", false, io.Discard, io.Discard); !errdefs.IsNotFound(err) {
			t.Errorf("a's exec id in b's sandbox: %v", err)
		}
		// Still there, untouched.
		if out, _ := run(t, asb, "check", "cat /work/secret"); out != "secret-a\n" {
			t.Errorf("a's sandbox after b's tries: %q", out)
		}
	})

	t.Run("groups and leases", func(t *testing.T) {
		// A's fork group and lease are A's: B's calls about them answer as
		// about ids that name nothing, and B's lists do not show them.
		src, err := a.Create(ctx, api.SandboxSpec{Name: "a-forked", Layers: []string{"bb:1"}})
		if err != nil {
			t.Fatal(err)
		}
		g, err := src.Fork(ctx, api.ForkRequest{N: 1, TTL: 600})
		if err != nil {
			t.Fatal(err)
		}
		fakeGroup, fakeLease := "group-"+randHex(12), "lease-"+randHex(12)
		for _, r := range []struct {
			name     string
			id, fake string
			call     func(id string) error
		}{
			{"group", g.ID, fakeGroup, func(id string) error { _, err := b.Group(ctx, id); return err }},
			{"keep", g.ID, fakeGroup, func(id string) error { _, err := b.KeepMember(ctx, id, g.Members[0].Name); return err }},
			{"rm group", g.ID, fakeGroup, func(id string) error { _, err := b.RemoveGroup(ctx, id); return err }},
			{"renew", g.Lease, fakeLease, func(id string) error { _, err := b.RenewLease(ctx, id, 60); return err }},
			{"rm lease", g.Lease, fakeLease, func(id string) error { _, err := b.RemoveLease(ctx, id); return err }},
			{"fork under", g.Lease, fakeLease, func(id string) error { _, err := bsb.Fork(ctx, api.ForkRequest{N: 1, Lease: id}); return err }},
		} {
			sameAnswer(t, r.name+" of a's", r.call(r.id), r.call(r.fake), r.id, r.fake)
		}
		if gs, err := b.Groups(ctx); err != nil || len(gs) != 0 {
			t.Errorf("b's groups: %+v %v", gs, err)
		}
		if ls, err := b.Leases(ctx); err != nil || len(ls) != 0 {
			t.Errorf("b's leases: %+v %v", ls, err)
		}
		if got, err := a.Group(ctx, g.ID); err != nil || got.Members[0].Status != api.StatusRunning {
			t.Errorf("a's group after b's tries: %+v %v", got, err)
		}
		if _, err := a.RemoveLease(ctx, g.Lease); err != nil {
			t.Fatal(err)
		}
		src.Remove(ctx, true)
	})

	t.Run("admin routes", func(t *testing.T) {
		// The fleet's routes are an admin's (a gateway's): a tenant may
		// not claim another's names, cordon the worker, nor learn what
		// its store holds.
		for _, r := range []struct{ method, path, body string }{
			{"POST", "/v1/claims", `{"names":["a-sb"],"holder":"b"}`},
			{"POST", "/v1/claims", `{"names":["a-sb"],"release":true}`},
			{"PUT", "/v1/cordon", `{"cordoned":true}`},
			{"POST", "/v1/estimates", `{"layers":["bb:1"]}`},
			{"POST", "/v1/squash", `{"snapshot":"a-snap:1"}`},
			{"PUT", "/v1/pools/p", `{"size":5}`},
			{"PUT", "/v1/policies/stored", `{}`},
			// A gateway's E2B front's relay: a tenant's key would be
			// taken unchecked.
			{"GET", "/v1/e2b/sandboxes/a-sb", ``},
			{"POST", "/v1/e2b/sandboxes/a-sb/timeout", `{"timeout":1}`},
			{"POST", "/v1/e2b/process.Process/List", `{}`},
		} {
			req, _ := http.NewRequest(r.method, "https://"+te.addr+r.path, strings.NewReader(r.body))
			req.Header.Set("Authorization", "Bearer "+te.tokens["b"])
			req.Header.Set("Content-Type", "application/json")
			resp, err := hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusForbidden {
				t.Errorf("b's %s %s: %s, want 403", r.method, r.path, resp.Status)
			}
		}
		if v, err := admin.Version(ctx); err != nil || v.Cordoned {
			t.Errorf("the worker after b's cordon: %v %v", v.Cordoned, err)
		}
	})

	t.Run("e2b record", func(t *testing.T) {
		// A gateway's E2B front sends its creates' records; a tenant's
		// create with one gets none (its sandbox no timeout another set,
		// no access token).
		rec := base64.RawURLEncoding.EncodeToString([]byte(`{"id":"b-rec","template":"t","started":"2026-01-01T00:00:00Z","end_at":"2026-01-01T00:00:01Z"}`))
		req, _ := http.NewRequest("POST", "https://"+te.addr+"/v1/sandboxes", strings.NewReader(`{"name":"b-rec","layers":["bb:1"]}`))
		req.Header.Set("Authorization", "Bearer "+te.tokens["b"])
		req.Header.Set(e2b.HeaderRecord, rec)
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var sb api.Sandbox
		json.NewDecoder(resp.Body).Decode(&sb)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated || sb.E2B != nil {
			t.Errorf("b's create with an E2B record: %s, its E2B state %+v: want 201 and none", resp.Status, sb.E2B)
		}
		if err := b.Sandbox("b-rec").Remove(ctx, true); err != nil {
			t.Error(err)
		}
	})

	t.Run("e2b routes", func(t *testing.T) {
		fake := "zz" + randHex(18)
		for _, r := range []struct{ method, path string }{
			{"GET", "/sandboxes/%s"}, {"DELETE", "/sandboxes/%s"}, {"POST", "/sandboxes/%s/timeout"}, {"POST", "/sandboxes/%s/refreshes"},
			{"POST", "/sandboxes/%s/pause"}, {"POST", "/sandboxes/%s/resume"}, {"POST", "/sandboxes/%s/connect"},
			{"GET", "/sandboxes/%s/metrics"}, {"POST", "/sandboxes/%s/fork"}, {"POST", "/sandboxes/%s/snapshots"},
		} {
			body := map[string]any{"timeout": 60}
			code, got := te.e2bDo(t, hc, r.method, fmt.Sprintf(r.path, aeID), te.tokens["b"], body)
			code0, want := te.e2bDo(t, hc, r.method, fmt.Sprintf(r.path, fake), te.tokens["b"], body)
			if code != http.StatusNotFound || code0 != code || strings.ReplaceAll(string(got), aeID, fake) != string(want) {
				t.Errorf("b %s %s: %d %s / %d %s", r.method, r.path, code, got, code0, want)
			}
		}
		// envd with B's key, and with A's sandbox's access token on
		// another of A's sandboxes.
		pc, fsc := te.envd(hc, aeID, te.tokens["b"])
		if _, err := run1(pc, "cat /etc/hostname"); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("b runs a command in a's e2b sandbox: %v", err)
		}
		if err := statOK(fsc); connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("b stats in a's e2b sandbox: %v", err)
		}
		if !strings.HasPrefix(aeToken, "envd_") || strings.Contains(aeToken, te.tokens["a"][5:]) {
			t.Errorf("a's envdAccessToken %q is not a sandbox's own", aeToken)
		}
		if _, fsc := te.envd(hc, aeID, aeToken); statOK(fsc) != nil {
			t.Error("a's access token does not open its sandbox")
		}
		other, _ := te.e2bCreate(t, hc, te.tokens["a"], "base")
		if _, fsc := te.envd(hc, other, aeToken); connect.CodeOf(statOK(fsc)) != connect.CodeUnauthenticated {
			t.Errorf("a's access token on a's other sandbox: %v", statOK(fsc))
		}
		if code, _ := te.e2bDo(t, hc, "GET", "/sandboxes", aeToken, nil); code != http.StatusUnauthorized {
			t.Errorf("an access token on the control plane: %d", code)
		}
		// A sandbox's access token dies with its owner's token.
		gid, gtoken := te.e2bCreate(t, hc, te.tokens["gone"], "base")
		if _, fsc := te.envd(hc, gid, gtoken); statOK(fsc) != nil {
			t.Errorf("an access token before its key goes: %v", statOK(fsc))
		}
		if err := auth.Open(te.root).Remove(te.ids["gone"]); err != nil {
			t.Fatal(err)
		}
		if _, fsc := te.envd(hc, gid, gtoken); connect.CodeOf(statOK(fsc)) != connect.CodeUnauthenticated {
			t.Errorf("an access token after its key went: %v", statOK(fsc))
		}
		te.local.Sandbox(gid).Remove(ctx, true)
		// The front speaks HTTP/2 over TLS where asked (e2b.http2).
		resp, err := hc.Get("https://" + te.front + "/health")
		if err != nil || resp.ProtoMajor != 2 {
			t.Errorf("the E2B front over TLS: %v %v", resp, err)
		} else {
			resp.Body.Close()
		}
		b.Sandbox(other).Remove(ctx, true)
		te.c["a"].Sandbox(other).Remove(ctx, true)
	})

	t.Run("before the key", func(t *testing.T) {
		// No key, and a body that never comes: answered 401 at once,
		// on the TCP API, the control plane and envd alike.
		for _, c := range []struct{ name, url string }{
			{"api", "https://" + te.addr + "/v1/sandboxes"},
			{"control", "https://" + te.front + "/sandboxes"},
			{"envd", "https://" + te.front + "/process.Process/Start"},
		} {
			pr, pw := io.Pipe()
			req, _ := http.NewRequest("POST", c.url, pr)
			req.Header.Set("E2b-Sandbox-Id", aeID)
			req.Header.Set("Content-Type", "application/connect+proto")
			t0 := time.Now()
			resp, err := hc.Do(req)
			pw.Close()
			if err != nil || time.Since(t0) > 5*time.Second {
				t.Errorf("%s without a key: %v after %v", c.name, err, time.Since(t0))
				continue
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusUnauthorized && !strings.Contains(string(body), `"unauthenticated"`) {
				t.Errorf("%s without a key: %d %s", c.name, resp.StatusCode, body)
			}
		}
		// A gzip bomb: without a key it is never read; with one, for
		// the key's own sandbox, it is read only up to the bound.
		var bomb bytes.Buffer
		zw, _ := gzip.NewWriterLevel(&bomb, gzip.BestCompression)
		zw.Write(make([]byte, 256<<20))
		zw.Close()
		hwm := func() int64 {
			b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", te.w.Pid()))
			for _, l := range strings.Split(string(b), "\n") {
				if v, ok := strings.CutPrefix(l, "VmHWM:"); ok {
					n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
					return n << 10
				}
			}
			return 0
		}
		before := hwm()
		for _, key := range []string{"", "dsec_" + strings.Repeat("0", 40), aeToken} {
			env := make([]byte, 5, 5+bomb.Len())
			env[0] = 1 // compressed
			binary.BigEndian.PutUint32(env[1:], uint32(bomb.Len()))
			req, _ := http.NewRequest("POST", "https://"+te.front+"/process.Process/Start", bytes.NewReader(append(env, bomb.Bytes()...)))
			req.Header.Set("E2b-Sandbox-Id", aeID)
			req.Header.Set("Content-Type", "application/connect+proto")
			req.Header.Set("Connect-Content-Encoding", "gzip")
			req.Header.Set("Connect-Protocol-Version", "1")
			req.Header.Set("Connect-Accept-Encoding", "identity")
			req.Header.Set("X-Access-Token", key)
			resp, err := hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			body = connectMessages(body)
			if key != aeToken && !strings.Contains(string(body), `"unauthenticated"`) || key == aeToken && !strings.Contains(string(body), "resource_exhausted") {
				t.Errorf("a gzip bomb with key %q: %d %s", key, resp.StatusCode, body)
			}
		}
		// Unbounded, the message alone would take 256 MiB (several times
		// that under the race detector).
		bound := int64(48 << 20)
		if raceEnabled {
			bound = 192 << 20
		}
		if grew := hwm() - before; grew > bound {
			t.Errorf("a gzip bomb grew the worker by %d MiB", grew>>20)
		} else {
			t.Logf("a gzip bomb grew the worker by %d MiB", grew>>20)
		}
		// Keys that are not: no descriptor is kept for each.
		fds := func() int { e, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", te.w.Pid())); return len(e) }
		n0 := fds()
		var wg sync.WaitGroup
		sem := make(chan struct{}, 16)
		for range 600 {
			sem <- struct{}{}
			wg.Go(func() {
				defer func() { <-sem }()
				code, _ := te.e2bDo(t, hc, "GET", "/sandboxes", "e2b_"+randHex(40), nil)
				if code != http.StatusUnauthorized {
					t.Errorf("a random key: %d", code)
				}
			})
		}
		wg.Wait()
		hc.CloseIdleConnections()
		if n := fds(); n > n0+32 {
			t.Errorf("600 random keys took the worker from %d descriptors to %d", n0, n)
		}
	})

	t.Run("stale record", func(t *testing.T) {
		// A's E2B sandbox gets a timeout, and is removed outside E2B; B
		// makes one of the same name: the front neither kills it nor
		// answers 404 for it.
		id, _ := te.e2bCreate(t, hc, te.tokens["a"], "base")
		if code, body := te.e2bDo(t, hc, "POST", "/sandboxes/"+id+"/timeout", te.tokens["a"], map[string]any{"timeout": 1}); code != http.StatusNoContent {
			t.Fatalf("timeout: %d %s", code, body)
		}
		if err := a.Sandbox(id).Remove(ctx, true); err != nil {
			t.Fatal(err)
		}
		sb, err := b.Create(ctx, api.SandboxSpec{Name: id, Layers: []string{"bb:1"}})
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(3 * time.Second) // the front checks timeouts every second
		if _, err := sb.Inspect(ctx); err != nil {
			t.Fatalf("b's sandbox of a's old name: %v", err)
		}
		if _, fsc := te.envd(hc, id, te.tokens["b"]); statOK(fsc) != nil {
			t.Errorf("envd for b's sandbox of a's old name: %v", statOK(fsc))
		}
		sb.Remove(ctx, true)
	})

	t.Run("request slots", func(t *testing.T) {
		// One token holds its bound of streams: its next request is
		// busy, another's goes through.
		slots := te.c["slots1"]
		sb, err := slots.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := sb.Exec(ctx, sdk.ExecOptions{ID: "long", Args: []string{"sleep", "60"}, Detach: true}); err != nil {
			t.Fatal(err)
		}
		sctx, cancel := context.WithCancel(ctx)
		var wg sync.WaitGroup
		ended := make(chan error, tenancyPerToken)
		for range tenancyPerToken {
			wg.Go(func() {
				if _, err := sb.Logs(sctx, "long", true, io.Discard, io.Discard); sctx.Err() == nil {
					ended <- err // a stream that ends early frees its slot
				}
			})
		}
		var busy error
		// A loaded CI host may take seconds to open the streams; the
		// command they follow runs for a minute.
		for deadline := time.Now().Add(40 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			if _, busy = sb.Inspect(ctx); errdefs.IsResourceExhausted(busy) {
				break
			}
		}
		if !errdefs.IsResourceExhausted(busy) || !strings.Contains(busy.Error(), "this token") {
			select {
			case err := <-ended:
				t.Errorf("a token past its bound: %v (a logs stream ended early: %v)", busy, err)
			default:
				t.Errorf("a token past its bound: %v", busy)
			}
		}
		if _, err := asb.Inspect(ctx); err != nil {
			t.Errorf("another token meanwhile: %v", err)
		}
		cancel()
		wg.Wait()
		// The worker frees a stream's slot once it sees the stream's
		// connection gone, a moment after the client has let go.
		for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			if err = sb.Remove(ctx, true); !errdefs.IsResourceExhausted(err) {
				break
			}
		}
		if err != nil {
			t.Errorf("the token's slots after its streams ended: %v", err)
		}
	})

	t.Run("allowances", func(t *testing.T) {
		if err := te.local.SavePolicy(ctx, "stored", &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy"}); err != nil {
			t.Fatal(err)
		}
		free := te.c["free"]
		for who, ok := range map[string]bool{"b": false, "free": true} {
			c := te.c[who]
			_, err := c.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, Policy: &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy"}})
			if (err == nil) != ok || !ok && !errdefs.IsPermissionDenied(err) {
				t.Errorf("%s gives a policy of its own: %v", who, err)
			}
			_, err = c.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, Memory: api.Unlimited})
			if (err == nil) != ok || !ok && !errdefs.IsPermissionDenied(err) {
				t.Errorf("%s asks for unlimited memory: %v", who, err)
			}
			for what, spec := range map[string]api.SandboxSpec{"memory": {Memory: 1 << 50}, "pids": {Pids: 1 << 40}, "disk": {Disk: 1 << 55}} {
				spec.Layers = []string{"bb:1"}
				_, err = c.Create(ctx, spec)
				if !ok && (!errdefs.IsPermissionDenied(err) || !strings.Contains(err.Error(), "more than the host has")) {
					t.Errorf("%s asks for more %s than the host has: %v", who, what, err)
				}
			}
			sb, err := c.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, PolicyName: "stored"})
			if err != nil {
				t.Fatalf("%s names a stored policy: %v", who, err)
			}
			_, err = sb.ApplyPolicy(ctx, api.PolicyRequest{Name: "stored"})
			if (err == nil) != ok || !ok && !errdefs.IsPermissionDenied(err) {
				t.Errorf("%s applies a policy: %v", who, err)
			}
		}
		l, _ := free.List(ctx)
		for _, sb := range l {
			free.Sandbox(sb.Name).Remove(ctx, true)
		}
		l, _ = b.List(ctx)
		for _, sb := range l {
			if sb.Name != "b-sb" {
				b.Sandbox(sb.Name).Remove(ctx, true)
			}
		}
		if err := te.local.SavePolicy(ctx, "other", &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy"}); err != nil {
			t.Fatal(err)
		}
		listed := te.c["listed"]
		if _, err := listed.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, PolicyName: "other"}); !errdefs.IsPermissionDenied(err) {
			t.Errorf("a token's unlisted stored policy: %v", err)
		}
		if ps, err := listed.Policies(ctx); err != nil || len(ps) != 1 || ps[0].Metadata.Name != "stored" {
			t.Errorf("a token with listed policies sees %+v %v", ps, err)
		}
		if _, err := listed.Policy(ctx, "other"); !errdefs.IsNotFound(err) {
			t.Errorf("a token gets an unlisted policy: %v", err)
		}
		if sb, err := listed.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, PolicyName: "stored"}); err != nil {
			t.Errorf("a token's listed stored policy: %v", err)
		} else {
			sb.Remove(ctx, true)
		}
		te.local.RemovePolicy(ctx, "other")
		// Pools and stored policies: what B may use, without others' use.
		pools, err := b.Pools(ctx)
		if err != nil || len(pools) != 1 || pools[0].Calls != 0 {
			t.Errorf("b's pools: %+v %v", pools, err)
		}
		if ps, err := b.Policies(ctx); err != nil || len(ps) != 1 {
			t.Errorf("b's policies: %+v %v", ps, err)
		}
	})

	t.Run("quotas", func(t *testing.T) {
		q := te.c["quota"]
		for i := range 2 {
			if _, err := q.Create(ctx, api.SandboxSpec{Name: "q" + strconv.Itoa(i), Layers: []string{"bb:1"}, Memory: 256 << 20}); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := q.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, Memory: 256 << 20}); !errdefs.IsResourceExhausted(err) {
			t.Errorf("a third sandbox: %v", err)
		}
		// A call in the admin's pool is held by the caller's quota too.
		if _, err := q.Call(ctx, sdk.CallOptions{Pool: "p", ExecOptions: sdk.ExecOptions{Args: []string{"true"}}}); !errdefs.IsResourceExhausted(err) {
			t.Errorf("a pool's call past the quota: %v", err)
		}
		q.Sandbox("q0").Remove(ctx, true)
		if _, err := q.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}, Memory: 1 << 30}); !errdefs.IsResourceExhausted(err) {
			t.Errorf("past the memory quota: %v", err)
		}
		q.Sandbox("q1").Remove(ctx, true)

		s := te.c["snapq"]
		sb, err := s.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: "s:1"}); err != nil {
			t.Fatalf("a small snapshot: %v", err)
		}
		run(t, sb, "big", "head -c 200000 /dev/urandom > /root/big")
		if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: "s:2"}); !errdefs.IsResourceExhausted(err) || !strings.Contains(err.Error(), "quota") {
			t.Errorf("past the snapshot quota: %v", err)
		}
		if l, _ := s.Snapshots(ctx); len(l) != 1 {
			t.Errorf("snapshots after the refused pack: %+v", l)
		}
		// A request may lower the worker's pack bound (1 MiB here),
		// never raise it; the admin may.
		run(t, asb, "2m", "head -c 2000000 /dev/urandom > /root/two")
		if _, err := asb.PackDiff(ctx, api.PackRequest{Tag: "a-big:1", MaxBytes: 100 << 20}); err == nil || !strings.Contains(err.Error(), "max-bytes") {
			t.Errorf("a tenant raises the pack bound: %v", err)
		}
		if _, err := te.local.Sandbox("a-sb").PackDiff(ctx, api.PackRequest{Tag: "a-big:1", MaxBytes: 100 << 20}); err != nil {
			t.Errorf("the admin raises the pack bound: %v", err)
		}
		sb.Remove(ctx, true)
	})

	for _, c := range []*sdk.Sandbox{asb, bsb, adm} {
		te.local.Sandbox(c.Name).Remove(ctx, true)
	}
	te.local.Sandbox(aeID).Remove(ctx, true)
	if l, err := te.local.List(ctx); err != nil || len(l) != 0 {
		t.Errorf("left: %+v %v", l, err)
	}
}

// vmSnapshot records tag in root's store as a full VM's snapshot: a
// diff over the disk of the VM image vm-base:1, both small qcow2
// images of their own.
func vmSnapshot(t *testing.T, root, tag string) {
	t.Helper()
	vmImage(t, root, tag, vm.Record{Created: time.Now().UTC(), Sandbox: "a VM", Parent: "vm-base:1", Disk: vm.Disk{Size: 1 << 20, Agent: vm.AgentSystemd}})
}

// vmImage records tag in root's store as the VM image rec describes,
// its disk a chain of two small qcow2 images.
func vmImage(t *testing.T, root, tag string, rec vm.Record) {
	t.Helper()
	ctx := context.Background()
	s := mustStore(t, root)
	release, err := s.Writer()
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	var chain []ocispec.Descriptor
	for i := range 2 {
		p := filepath.Join(t.TempDir(), "disk.qcow2")
		if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", p, strconv.Itoa(1<<20+i<<16)).CombinedOutput(); err != nil {
			t.Fatalf("qemu-img (make deps installs qemu-utils): %v: %s", err, out)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		d, err := s.WriteBlob(vm.MediaTypeDisk, b)
		if err != nil {
			t.Fatal(err)
		}
		chain = append(chain, d)
	}
	ref, err := layer.ParseRef(tag)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := vm.Snapshot(ctx, s, ref, chain, nil, nil, rec); err != nil {
		t.Fatal(err)
	}
}

func mustStore(t *testing.T, root string) *store.Store {
	t.Helper()
	s, err := store.Open(filepath.Join(root, "store"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// connectMessages is what a Connect stream's messages hold, each
// decompressed.
func connectMessages(b []byte) []byte {
	var out []byte
	for len(b) >= 5 {
		flags, n := b[0], int(binary.BigEndian.Uint32(b[1:5]))
		if len(b) < 5+n {
			break
		}
		m := b[5 : 5+n]
		if flags&1 != 0 {
			if zr, err := gzip.NewReader(bytes.NewReader(m)); err == nil {
				m, _ = io.ReadAll(zr)
			}
		}
		out = append(out, m...)
		b = b[5+n:]
	}
	return out
}

// emptyTar is a tar stream of nothing.
func emptyTar() []byte { return make([]byte, 1024) }

// TestOwnersMigrate: snapshots an older worker recorded as a token's
// (owners.json, their tags among everyone's) move into that token's
// namespace at the next start; an entry of an admin token, of a token
// gone, or whose tag names a layer that is not a snapshot stays the
// admin's.
func TestOwnersMigrate(t *testing.T) {
	root := t.TempDir()
	runtimetest.Layers(t, root)
	cfg := runtimetest.Config{Listen: []string{"tcp://" + freeAddr(t)}}
	w, _ := setupAt(t, root, cfg)
	tokens := auth.Open(root)
	secret, tok, err := tokens.Create(auth.Sandboxes, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, admin, _ := tokens.Create(auth.Admin, 0)
	ctx := context.Background()
	c, err := sdk.New(sdk.Options{Host: cfg.Listen[0], Token: secret})
	if err != nil {
		t.Fatal(err)
	}
	sb, err := c.Create(ctx, api.SandboxSpec{Layers: []string{"bb:1"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tag := range []string{"m:1", "adm:1"} {
		run(t, sb, tag, "echo "+tag+" > /root/"+tag)
		if _, err := sb.PackDiff(ctx, api.PackRequest{Tag: tag}); err != nil {
			t.Fatal(err)
		}
	}
	sb.Remove(ctx, true)
	w.Kill()
	// As an older worker left them: the tags among everyone's.
	s := mustStore(t, root)
	for _, tag := range []string{"m:1", "adm:1"} {
		d, err := s.Resolve(ctx, "tenants/"+tok.ID+"/"+tag)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Tag(ctx, tag, d, false); err != nil {
			t.Fatal(err)
		}
		s.Untag(ctx, "tenants/"+tok.ID+"/"+tag)
	}
	b, _ := json.Marshal(map[string]string{"m:1": tok.ID, "bb:1": tok.ID, "adm:1": admin.ID, "ws:1": "gone0000"})
	if err := os.WriteFile(filepath.Join(root, "owners.json"), b, 0o600); err != nil {
		t.Fatal(err)
	}
	runtimetest.StartWorkerWith(t, root, cfg)
	for tag, want := range map[string]bool{"tenants/" + tok.ID + "/m:1": true, "m:1": false, "bb:1": true, "ws:1": true, "adm:1": true,
		"tenants/" + tok.ID + "/bb:1": false, "tenants/" + admin.ID + "/adm:1": false} {
		if _, err := s.Resolve(ctx, tag); (err == nil) != want {
			t.Errorf("%s after the migration: %v", tag, err)
		}
	}
	if _, err := os.Stat(filepath.Join(root, "owners.json")); !os.IsNotExist(err) {
		t.Errorf("owners.json stays: %v", err)
	}
	if l, err := c.Snapshots(ctx); err != nil || len(l) != 1 || l[0].Name != "m:1" {
		t.Errorf("the token's snapshots: %+v %v", l, err)
	}
}
