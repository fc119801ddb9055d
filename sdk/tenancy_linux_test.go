package sdk_test

import (
	"bytes"
	"compress/gzip"
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/containerd/errdefs"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	fspb "github.com/dsec-project/dsec/internal/e2b/envd/filesystem"
	"github.com/dsec-project/dsec/internal/e2b/envd/filesystem/filesystemconnect"
	pb "github.com/dsec-project/dsec/internal/e2b/envd/process"
	"github.com/dsec-project/dsec/internal/e2b/envd/process/processconnect"
	"github.com/dsec-project/dsec/internal/layer"
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
	f := &tenancyFixture{te: te, ctx: ctx, a: a, b: b, admin: admin, hc: hc, asb: asb, adm: adm, bsb: bsb,
		asnap: asnap, admSnap: admSnap, ahex: ahex, aeID: aeID, aeToken: aeToken}

	t.Run("refs", f.refs)
	t.Run("images", f.images)
	t.Run("squatting", f.squatting)
	t.Run("sandbox routes", f.sandboxRoutes)
	t.Run("groups and leases", f.groupsAndLeases)
	t.Run("admin routes", f.adminRoutes)
	t.Run("e2b record", f.e2bRecord)
	t.Run("e2b routes", f.e2bRoutes)
	t.Run("before the key", f.beforeTheKey)
	t.Run("stale record", f.staleRecord)
	t.Run("request slots", f.requestSlots)
	t.Run("allowances", f.allowances)
	t.Run("quotas", f.quotas)

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
