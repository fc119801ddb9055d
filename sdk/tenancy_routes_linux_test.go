package sdk_test

import (
	"bytes"
	"cmp"
	"compress/gzip"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
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

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/auth"
	"github.com/dsec-project/dsec/internal/e2b"
	"github.com/dsec-project/dsec/internal/layer"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/sdk"
)

// tenancyFixture is what TestTenancy's parties hold when its subtests
// start: each subtest is a method, tried against the same worker.
type tenancyFixture struct {
	te             *tenancy
	ctx            context.Context
	a, b, admin    *sdk.Client
	hc             *http.Client
	asb, adm, bsb  *sdk.Sandbox // A's, the admin's and B's sandboxes
	asnap, admSnap api.Snapshot // A's and the admin's snapshots
	ahex           string       // A's snapshot's digest, hex
	aeID, aeToken  string       // A's E2B sandbox and its envd token
}

func (f *tenancyFixture) refs(t *testing.T) {
	// Every way B may name A's snapshot, or the admin's, and a name
	// of the same shape that names nothing.
	other := randHex(64)
	refs := []struct{ name, ref, fake string }{
		{"a's tag", "a-snap:1", "zz-snap:1"},
		{"a's tag in its namespace", "tenants/" + f.te.ids["a"] + "/a-snap:1", "tenants/" + f.te.ids["a"] + "/zz-snap:1"},
		{"a's digest", f.asnap.Digest, "sha256:" + other},
		{"a's digest, bare", f.ahex, other},
		{"a's digest prefix", f.ahex[:12], other[:12]},
		{"the admin's snapshot", "adm-snap:1", "zz-snap:1"},
		{"the admin's snapshot's digest prefix", strings.TrimPrefix(f.admSnap.Digest, "sha256:")[:16], other[:16]},
		{"a's VM snapshot", "a-vm:1", "zz-vm:1"},
		{"a's VM snapshot in its namespace", "tenants/" + f.te.ids["a"] + "/a-vm:1", "tenants/" + f.te.ids["a"] + "/zz-vm:1"},
		{"the admin's VM snapshot", "adm-vm:1", "zz-vm:1"},
	}
	routes := []struct {
		name string
		call func(ref string) error
	}{
		{"create on layers", func(ref string) error {
			_, err := f.b.Create(f.ctx, api.SandboxSpec{Layers: []string{ref, "bb:1"}})
			return err
		}},
		{"create on a snapshot", func(ref string) error {
			_, err := f.b.Create(f.ctx, api.SandboxSpec{Snapshot: ref})
			return err
		}},
		{"branch", func(ref string) error {
			_, err := f.b.Branch(f.ctx, api.BranchRequest{Snapshot: ref, N: 2, NamePrefix: "br"})
			return err
		}},
		{"call", func(ref string) error {
			_, err := f.b.Call(f.ctx, sdk.CallOptions{Spec: &api.SandboxSpec{Layers: []string{ref, "bb:1"}}, ExecOptions: sdk.ExecOptions{Args: []string{"cat", "/work/secret"}}})
			return err
		}},
		{"batch", func(ref string) error {
			var said error // (its first item's: each answers alike)
			err := f.b.Batch(f.ctx, api.SandboxSpec{Snapshot: ref}, 2, func(it api.BatchItem) {
				switch {
				case it.Sandbox != nil:
					said = fmt.Errorf("made %s", it.Sandbox.Name)
				case said == nil:
					said = it.Error
				}
			})
			return cmp.Or(err, said)
		}},
		{"remove snapshot", func(ref string) error { return f.b.RemoveSnapshot(f.ctx, ref, true) }},
		{"snapshot by name", func(ref string) error { _, err := f.b.Snapshot(f.ctx, ref); return err }},
		{"e2b create", func(ref string) error {
			code, body := f.te.e2bDo(t, f.hc, "POST", "/sandboxes", f.te.tokens["b"], map[string]any{"templateID": ref})
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
	if l, err := f.b.List(f.ctx); err != nil || len(l) != 1 || l[0].Name != "b-sb" {
		t.Errorf("b lists %+v %v", l, err)
	}
	if s, err := f.b.Snapshots(f.ctx); err != nil || len(s) != 0 {
		t.Errorf("b's snapshots: %+v %v", s, err)
	}
	// A names its own, by tag, digest and prefix, and sees its own
	// names (never the namespace).
	for _, ref := range []string{"a-snap:1", f.asnap.Digest, f.ahex[:12]} {
		sb, err := f.a.Create(f.ctx, api.SandboxSpec{Snapshot: ref})
		if err != nil {
			t.Fatalf("a restores its snapshot by %s: %v", ref, err)
		}
		if out, _ := run(t, sb, "r", "cat /work/secret"); out != "secret-a\n" {
			t.Errorf("a's restore by %s: %q", ref, out)
		}
		if info, _ := sb.Inspect(f.ctx); ref == "a-snap:1" && info.Snapshot != "a-snap:1" {
			t.Errorf("a sees its sandbox on %q", info.Snapshot)
		}
		sb.Remove(f.ctx, true)
	}
	var mine []string
	if s, err := f.a.Snapshots(f.ctx); err == nil {
		for _, n := range s {
			mine = append(mine, n.Name)
		}
	}
	if slices.Sort(mine); !slices.Equal(mine, []string{"a-snap:1", "a-vm:1", "bb:2"}) {
		t.Errorf("a's snapshots: %v", mine)
	}
	if n, err := f.a.Snapshot(f.ctx, "a-vm:1"); err != nil || n.Name != "a-vm:1" || n.Parent != "vm-base:1" {
		t.Errorf("a's VM snapshot by name: %+v %v", n, err)
	}
	if n, err := f.a.Snapshot(f.ctx, "a-snap:1"); err != nil || n.Name != "a-snap:1" || n.Digest != f.asnap.Digest {
		t.Errorf("a's snapshot by name: %+v %v", n, err)
	}
	if _, err := f.a.Snapshot(f.ctx, "bb:1"); !errdefs.IsNotFound(err) { // a layer
		t.Errorf("a layer as a snapshot: %v", err)
	}
	// The admin sees A's by their whole tags.
	all, _ := f.admin.Snapshots(f.ctx)
	var whole []string
	for _, n := range all {
		whole = append(whole, n.Name)
	}
	if !strings.Contains(strings.Join(whole, " "), "tenants/"+f.te.ids["a"]+"/a-snap:1") {
		t.Errorf("the admin's snapshot list: %v", whole)
	}
	// B may use what the admin built, by tag or digest prefix, and
	// the admin's snapshot only through the template that offers it.
	bb, err := layer.Resolve(f.ctx, mustStore(t, f.te.root), "bb:1")
	if err != nil {
		t.Fatal(err)
	}
	sb, err := f.b.Create(f.ctx, api.SandboxSpec{Layers: []string{bb.Digest.Encoded()[:12]}})
	if err != nil {
		t.Fatalf("b on the admin's layer by a digest prefix: %v", err)
	}
	sb.Remove(f.ctx, true)
	id, _ := f.te.e2bCreate(t, f.hc, f.te.tokens["b"], "adm-tmpl")
	if err := f.b.Sandbox(id).Remove(f.ctx, true); err != nil {
		t.Errorf("b's sandbox of the admin's template: %v", err)
	}
	if res, err := f.b.Call(f.ctx, sdk.CallOptions{Pool: "p", ExecOptions: sdk.ExecOptions{Args: []string{"true"}}}); err != nil || res.ExitCode != 0 {
		t.Errorf("b's call in the admin's pool: %+v %v", res, err)
	}
}

func (f *tenancyFixture) images(t *testing.T) {
	// A tenant's create may not make the worker fetch from its own
	// host or a private network (a registry only it reaches, a
	// metadata service), on the API or through the E2B front: the
	// pull's dialer refuses every address that is not public,
	// whatever name led there.
	for _, img := range []string{"127.0.0.1:5000/x:1", "10.0.0.1:5000/x:1", "169.254.169.254/latest:1", "localhost:5000/x:1"} {
		_, err := f.b.Create(f.ctx, api.SandboxSpec{Image: img})
		if !errdefs.IsPermissionDenied(err) {
			t.Errorf("b's create on %s: %v, want permission denied", img, err)
		}
		code, body := f.te.e2bDo(t, f.hc, "POST", "/sandboxes", f.te.tokens["b"], map[string]any{"templateID": "base", "metadata": map[string]string{"image": img}})
		if code != http.StatusForbidden {
			t.Errorf("b's E2B create on %s: %d %s, want 403", img, code, body)
		}
	}
	if l, err := f.b.List(f.ctx); err != nil || len(l) != 1 {
		t.Errorf("b lists %+v %v", l, err)
	}
}

func (f *tenancyFixture) squatting(t *testing.T) {
	// A's bb:2 is A's alone: B finds none, the admin builds its own.
	_, err := f.b.Create(f.ctx, api.SandboxSpec{Layers: []string{"bb:2"}})
	if !errdefs.IsNotFound(err) {
		t.Fatalf("b on bb:2 before the admin built one: %v", err)
	}
	s := mustStore(t, f.te.root)
	base := layertest.BusyboxRoot(t, t.TempDir())
	os.WriteFile(filepath.Join(base, "etc", "answer"), []byte("admin's 2\n"), 0o644)
	ref, _ := layer.ParseRef("bb:2")
	if _, err := layer.Build(f.ctx, s, layer.BuildOptions{Source: base, Kind: layer.KindBase, Ref: ref}); err != nil {
		t.Fatalf("the admin's layer build -t bb:2: %v", err)
	}
	for who, spec := range map[string]api.SandboxSpec{"b": {Layers: []string{"bb:2", "bb:1"}}, "a": {Snapshot: "bb:2"}} {
		want := map[string]string{"b": "admin's 2\n", "a": "trojan\n"}[who]
		sb, err := f.te.c[who].Create(f.ctx, spec)
		if err != nil {
			t.Fatalf("%s on bb:2: %v", who, err)
		}
		if out, _ := run(t, sb, "c", "cat /etc/answer"); out != want {
			t.Errorf("%s's bb:2 says %q, want %q", who, out, want)
		}
		sb.Remove(f.ctx, true)
	}
	// A tag in another's namespace is refused as any such tag.
	fakeID := randHex(12)
	_, e1 := f.bsb.PackDiff(f.ctx, api.PackRequest{Tag: "tenants/" + f.te.ids["a"] + "/a-snap:1"})
	_, e2 := f.bsb.PackDiff(f.ctx, api.PackRequest{Tag: "tenants/" + fakeID + "/a-snap:1"})
	if !errdefs.IsInvalidArgument(e1) || e2 == nil || strings.ReplaceAll(e1.Error(), f.te.ids["a"], fakeID) != e2.Error() {
		t.Errorf("b packs into a's namespace: %v / %v", e1, e2)
	}
}

func (f *tenancyFixture) sandboxRoutes(t *testing.T) {
	routes := []struct {
		name string
		call func(sb *sdk.Sandbox) error
	}{
		{"inspect", func(sb *sdk.Sandbox) error { _, err := sb.Inspect(f.ctx); return err }},
		{"stop", func(sb *sdk.Sandbox) error { return sb.Stop(f.ctx) }},
		{"start", func(sb *sdk.Sandbox) error { return sb.Start(f.ctx) }},
		{"pause", func(sb *sdk.Sandbox) error { return sb.Pause(f.ctx) }},
		{"resume", func(sb *sdk.Sandbox) error { return sb.Resume(f.ctx) }},
		{"evict", func(sb *sdk.Sandbox) error { return sb.Evict(f.ctx) }},
		{"exec", func(sb *sdk.Sandbox) error {
			_, err := sb.Exec(f.ctx, sdk.ExecOptions{ID: "a-step", Args: []string{"true"}})
			return err
		}},
		{"logs", func(sb *sdk.Sandbox) error {
			_, err := sb.Logs(f.ctx, "a-step", false, io.Discard, io.Discard)
			return err
		}},
		{"signal", func(sb *sdk.Sandbox) error { return sb.Signal(f.ctx, "a-step", syscall.SIGKILL) }},
		{"write", func(sb *sdk.Sandbox) error { return sb.WriteFile(f.ctx, "/work/x", strings.NewReader("x"), 0o644) }},
		{"read", func(sb *sdk.Sandbox) error { return sb.ReadFile(f.ctx, "/work/secret", io.Discard) }},
		{"stat", func(sb *sdk.Sandbox) error { _, err := sb.Stat(f.ctx, "/work/secret", false); return err }},
		{"list", func(sb *sdk.Sandbox) error { _, err := sb.ListDir(f.ctx, "/work", 1); return err }},
		{"mkdir", func(sb *sdk.Sandbox) error { _, err := sb.MakeDir(f.ctx, "/work/d", true); return err }},
		{"rename", func(sb *sdk.Sandbox) error { _, err := sb.Rename(f.ctx, "/work/secret", "/work/s2"); return err }},
		{"rm path", func(sb *sdk.Sandbox) error { return sb.RemovePath(f.ctx, "/work/secret", false) }},
		{"copy from", func(sb *sdk.Sandbox) error {
			s, _, err := sb.CopyFrom(f.ctx, "/work", sdk.CopyFromOptions{})
			if s != nil {
				s.Close()
			}
			return err
		}},
		{"copy to", func(sb *sdk.Sandbox) error {
			_, err := sb.CopyTo(f.ctx, "/work", bytes.NewReader(emptyTar()), false)
			return err
		}},
		{"pack", func(sb *sdk.Sandbox) error {
			_, err := sb.PackDiff(f.ctx, api.PackRequest{Tag: "stolen:1"})
			return err
		}},
		{"policy", func(sb *sdk.Sandbox) error {
			_, err := sb.ApplyPolicy(f.ctx, api.PolicyRequest{Policy: &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy"}})
			return err
		}},
		{"branch like", func(sb *sdk.Sandbox) error {
			_, err := f.b.Branch(f.ctx, api.BranchRequest{Snapshot: "zz-snap:1", N: 1, Like: sb.Name})
			return err
		}},
		{"port", func(sb *sdk.Sandbox) error {
			req, _ := http.NewRequest("GET", "https://"+f.te.addr+"/v1/sandboxes/"+sb.Name+"/ports/8080/", nil)
			req.Header.Set("Authorization", "Bearer "+f.te.tokens["b"])
			resp, err := f.hc.Do(req)
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
			_, err := sb.Grade(f.ctx, api.GradeRequest{ID: "g", Grader: []string{"bb:1"}, Carry: []string{"/work/**"}, Args: []string{"true"}})
			return err
		}},
		{"fork", func(sb *sdk.Sandbox) error { _, err := sb.Fork(f.ctx, api.ForkRequest{N: 1}); return err }},
		{"idle", func(sb *sdk.Sandbox) error { _, err := sb.Idle(f.ctx, time.Minute); return err }},
		{"screen", func(sb *sdk.Sandbox) error { _, _, err := sb.Screenshot(f.ctx); return err }},
		{"input", func(sb *sdk.Sandbox) error { return sb.Type(f.ctx, "x") }},
		{"vnc", func(sb *sdk.Sandbox) error { _, err := sb.VNC(f.ctx); return err }},
		{"vnc revoke", func(sb *sdk.Sandbox) error { return sb.RevokeVNC(f.ctx) }},
		{"vnc socket", func(sb *sdk.Sandbox) error { // no grant: every token and name alike
			_, err := f.b.DialVNC(f.ctx, api.VNC{Sandbox: sb.Name, Path: api.VNCPath(sb.Name), Token: f.te.tokens["b"]})
			return err
		}},
		{"remove", func(sb *sdk.Sandbox) error { return sb.Remove(f.ctx, true) }},
	}
	for _, r := range routes {
		for _, target := range []string{"a-sb", "adm-sb", f.aeID} {
			sameAnswer(t, r.name+" of "+target, r.call(f.b.Sandbox(target)), r.call(f.b.Sandbox("zz-sb")), target, "zz-sb")
		}
	}
	// A's step is A's: B's own sandbox has no exec of that id.
	if _, err := f.bsb.Logs(f.ctx, "a-step", false, io.Discard, io.Discard); !errdefs.IsNotFound(err) {
		t.Errorf("a's exec id in b's sandbox: %v", err)
	}
	// Still there, untouched.
	if out, _ := run(t, f.asb, "check", "cat /work/secret"); out != "secret-a\n" {
		t.Errorf("a's sandbox after b's tries: %q", out)
	}
}

func (f *tenancyFixture) groupsAndLeases(t *testing.T) {
	// A's fork group and lease are A's: B's calls about them answer as
	// about ids that name nothing, and B's lists do not show them.
	src, err := f.a.Create(f.ctx, api.SandboxSpec{Name: "a-forked", Layers: []string{"bb:1"}})
	if err != nil {
		t.Fatal(err)
	}
	g, err := src.Fork(f.ctx, api.ForkRequest{N: 1, TTL: 600})
	if err != nil {
		t.Fatal(err)
	}
	fakeGroup, fakeLease := "group-"+randHex(12), "lease-"+randHex(12)
	for _, r := range []struct {
		name     string
		id, fake string
		call     func(id string) error
	}{
		{"group", g.ID, fakeGroup, func(id string) error { _, err := f.b.Group(f.ctx, id); return err }},
		{"keep", g.ID, fakeGroup, func(id string) error { _, err := f.b.KeepMember(f.ctx, id, g.Members[0].Name); return err }},
		{"rm group", g.ID, fakeGroup, func(id string) error { _, err := f.b.RemoveGroup(f.ctx, id); return err }},
		{"renew", g.Lease, fakeLease, func(id string) error { _, err := f.b.RenewLease(f.ctx, id, 60); return err }},
		{"rm lease", g.Lease, fakeLease, func(id string) error { _, err := f.b.RemoveLease(f.ctx, id); return err }},
		{"fork under", g.Lease, fakeLease, func(id string) error { _, err := f.bsb.Fork(f.ctx, api.ForkRequest{N: 1, Lease: id}); return err }},
	} {
		sameAnswer(t, r.name+" of a's", r.call(r.id), r.call(r.fake), r.id, r.fake)
	}
	if gs, err := f.b.Groups(f.ctx); err != nil || len(gs) != 0 {
		t.Errorf("b's groups: %+v %v", gs, err)
	}
	if ls, err := f.b.Leases(f.ctx); err != nil || len(ls) != 0 {
		t.Errorf("b's leases: %+v %v", ls, err)
	}
	if got, err := f.a.Group(f.ctx, g.ID); err != nil || got.Members[0].Status != api.StatusRunning {
		t.Errorf("a's group after b's tries: %+v %v", got, err)
	}
	if _, err := f.a.RemoveLease(f.ctx, g.Lease); err != nil {
		t.Fatal(err)
	}
	src.Remove(f.ctx, true)
}

func (f *tenancyFixture) adminRoutes(t *testing.T) {
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
		req, _ := http.NewRequest(r.method, "https://"+f.te.addr+r.path, strings.NewReader(r.body))
		req.Header.Set("Authorization", "Bearer "+f.te.tokens["b"])
		req.Header.Set("Content-Type", "application/json")
		resp, err := f.hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("b's %s %s: %s, want 403", r.method, r.path, resp.Status)
		}
	}
	if v, err := f.admin.Version(f.ctx); err != nil || v.Cordoned {
		t.Errorf("the worker after b's cordon: %v %v", v.Cordoned, err)
	}
}

func (f *tenancyFixture) e2bRecord(t *testing.T) {
	// A gateway's E2B front sends its creates' records; a tenant's
	// create with one gets none (its sandbox no timeout another set,
	// no access token).
	rec := base64.RawURLEncoding.EncodeToString([]byte(`{"id":"b-rec","template":"t","started":"2026-01-01T00:00:00Z","end_at":"2026-01-01T00:00:01Z"}`))
	req, _ := http.NewRequest("POST", "https://"+f.te.addr+"/v1/sandboxes", strings.NewReader(`{"name":"b-rec","layers":["bb:1"]}`))
	req.Header.Set("Authorization", "Bearer "+f.te.tokens["b"])
	req.Header.Set(e2b.HeaderRecord, rec)
	resp, err := f.hc.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	var sb api.Sandbox
	json.NewDecoder(resp.Body).Decode(&sb)
	resp.Body.Close()
	if resp.StatusCode != http.StatusCreated || sb.E2B != nil {
		t.Errorf("b's create with an E2B record: %s, its E2B state %+v: want 201 and none", resp.Status, sb.E2B)
	}
	if err := f.b.Sandbox("b-rec").Remove(f.ctx, true); err != nil {
		t.Error(err)
	}
}

func (f *tenancyFixture) e2bRoutes(t *testing.T) {
	fake := "zz" + randHex(18)
	for _, r := range []struct{ method, path string }{
		{"GET", "/sandboxes/%s"}, {"DELETE", "/sandboxes/%s"}, {"POST", "/sandboxes/%s/timeout"}, {"POST", "/sandboxes/%s/refreshes"},
		{"POST", "/sandboxes/%s/pause"}, {"POST", "/sandboxes/%s/resume"}, {"POST", "/sandboxes/%s/connect"},
		{"GET", "/sandboxes/%s/metrics"}, {"POST", "/sandboxes/%s/fork"}, {"POST", "/sandboxes/%s/snapshots"},
	} {
		body := map[string]any{"timeout": 60}
		code, got := f.te.e2bDo(t, f.hc, r.method, fmt.Sprintf(r.path, f.aeID), f.te.tokens["b"], body)
		code0, want := f.te.e2bDo(t, f.hc, r.method, fmt.Sprintf(r.path, fake), f.te.tokens["b"], body)
		if code != http.StatusNotFound || code0 != code || strings.ReplaceAll(string(got), f.aeID, fake) != string(want) {
			t.Errorf("b %s %s: %d %s / %d %s", r.method, r.path, code, got, code0, want)
		}
	}
	// envd with B's key, and with A's sandbox's access token on
	// another of A's sandboxes.
	pc, fsc := f.te.envd(f.hc, f.aeID, f.te.tokens["b"])
	if _, err := run1(pc, "cat /etc/hostname"); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("b runs a command in a's e2b sandbox: %v", err)
	}
	if err := statOK(fsc); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("b stats in a's e2b sandbox: %v", err)
	}
	if !strings.HasPrefix(f.aeToken, "envd_") || strings.Contains(f.aeToken, f.te.tokens["a"][5:]) {
		t.Errorf("a's envdAccessToken %q is not a sandbox's own", f.aeToken)
	}
	if _, fsc := f.te.envd(f.hc, f.aeID, f.aeToken); statOK(fsc) != nil {
		t.Error("a's access token does not open its sandbox")
	}
	other, _ := f.te.e2bCreate(t, f.hc, f.te.tokens["a"], "base")
	if _, fsc := f.te.envd(f.hc, other, f.aeToken); connect.CodeOf(statOK(fsc)) != connect.CodeUnauthenticated {
		t.Errorf("a's access token on a's other sandbox: %v", statOK(fsc))
	}
	if code, _ := f.te.e2bDo(t, f.hc, "GET", "/sandboxes", f.aeToken, nil); code != http.StatusUnauthorized {
		t.Errorf("an access token on the control plane: %d", code)
	}
	// A sandbox's access token dies with its owner's token.
	gid, gtoken := f.te.e2bCreate(t, f.hc, f.te.tokens["gone"], "base")
	if _, fsc := f.te.envd(f.hc, gid, gtoken); statOK(fsc) != nil {
		t.Errorf("an access token before its key goes: %v", statOK(fsc))
	}
	if err := auth.Open(f.te.root).Remove(f.te.ids["gone"]); err != nil {
		t.Fatal(err)
	}
	if _, fsc := f.te.envd(f.hc, gid, gtoken); connect.CodeOf(statOK(fsc)) != connect.CodeUnauthenticated {
		t.Errorf("an access token after its key went: %v", statOK(fsc))
	}
	f.te.local.Sandbox(gid).Remove(f.ctx, true)
	// The front speaks HTTP/2 over TLS where asked (e2b.http2).
	resp, err := f.hc.Get("https://" + f.te.front + "/health")
	if err != nil || resp.ProtoMajor != 2 {
		t.Errorf("the E2B front over TLS: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
	f.b.Sandbox(other).Remove(f.ctx, true)
	f.te.c["a"].Sandbox(other).Remove(f.ctx, true)
}

func (f *tenancyFixture) beforeTheKey(t *testing.T) {
	// No key, and a body that never comes: answered 401 at once,
	// on the TCP API, the control plane and envd alike.
	for _, c := range []struct{ name, url string }{
		{"api", "https://" + f.te.addr + "/v1/sandboxes"},
		{"control", "https://" + f.te.front + "/sandboxes"},
		{"envd", "https://" + f.te.front + "/process.Process/Start"},
	} {
		pr, pw := io.Pipe()
		req, _ := http.NewRequest("POST", c.url, pr)
		req.Header.Set("E2b-Sandbox-Id", f.aeID)
		req.Header.Set("Content-Type", "application/connect+proto")
		t0 := time.Now()
		resp, err := f.hc.Do(req)
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
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", f.te.w.Pid()))
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "VmHWM:"); ok {
				n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
				return n << 10
			}
		}
		return 0
	}
	before := hwm()
	for _, key := range []string{"", "dsec_" + strings.Repeat("0", 40), f.aeToken} {
		env := make([]byte, 5, 5+bomb.Len())
		env[0] = 1 // compressed
		binary.BigEndian.PutUint32(env[1:], uint32(bomb.Len()))
		req, _ := http.NewRequest("POST", "https://"+f.te.front+"/process.Process/Start", bytes.NewReader(append(env, bomb.Bytes()...)))
		req.Header.Set("E2b-Sandbox-Id", f.aeID)
		req.Header.Set("Content-Type", "application/connect+proto")
		req.Header.Set("Connect-Content-Encoding", "gzip")
		req.Header.Set("Connect-Protocol-Version", "1")
		req.Header.Set("Connect-Accept-Encoding", "identity")
		req.Header.Set("X-Access-Token", key)
		resp, err := f.hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		body = connectMessages(body)
		if key != f.aeToken && !strings.Contains(string(body), `"unauthenticated"`) || key == f.aeToken && !strings.Contains(string(body), "resource_exhausted") {
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
	fds := func() int { e, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", f.te.w.Pid())); return len(e) }
	n0 := fds()
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	for range 600 {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			code, _ := f.te.e2bDo(t, f.hc, "GET", "/sandboxes", "e2b_"+randHex(40), nil)
			if code != http.StatusUnauthorized {
				t.Errorf("a random key: %d", code)
			}
		})
	}
	wg.Wait()
	f.hc.CloseIdleConnections()
	if n := fds(); n > n0+32 {
		t.Errorf("600 random keys took the worker from %d descriptors to %d", n0, n)
	}
}

func (f *tenancyFixture) staleRecord(t *testing.T) {
	// A's E2B sandbox gets a timeout, and is removed outside E2B; B
	// makes one of the same name: the front neither kills it nor
	// answers 404 for it.
	id, _ := f.te.e2bCreate(t, f.hc, f.te.tokens["a"], "base")
	if code, body := f.te.e2bDo(t, f.hc, "POST", "/sandboxes/"+id+"/timeout", f.te.tokens["a"], map[string]any{"timeout": 1}); code != http.StatusNoContent {
		t.Fatalf("timeout: %d %s", code, body)
	}
	if err := f.a.Sandbox(id).Remove(f.ctx, true); err != nil {
		t.Fatal(err)
	}
	sb, err := f.b.Create(f.ctx, api.SandboxSpec{Name: id, Layers: []string{"bb:1"}})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second) // the front checks timeouts every second
	if _, err := sb.Inspect(f.ctx); err != nil {
		t.Fatalf("b's sandbox of a's old name: %v", err)
	}
	if _, fsc := f.te.envd(f.hc, id, f.te.tokens["b"]); statOK(fsc) != nil {
		t.Errorf("envd for b's sandbox of a's old name: %v", statOK(fsc))
	}
	sb.Remove(f.ctx, true)
}

func (f *tenancyFixture) requestSlots(t *testing.T) {
	// One token holds its bound of streams: its next request is
	// busy, another's goes through.
	slots := f.te.c["slots1"]
	sb, err := slots.Create(f.ctx, api.SandboxSpec{Layers: []string{"bb:1"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sb.Exec(f.ctx, sdk.ExecOptions{ID: "long", Args: []string{"sleep", "60"}, Detach: true}); err != nil {
		t.Fatal(err)
	}
	sctx, cancel := context.WithCancel(f.ctx)
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
		if _, busy = sb.Inspect(f.ctx); errdefs.IsResourceExhausted(busy) {
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
	if _, err := f.asb.Inspect(f.ctx); err != nil {
		t.Errorf("another token meanwhile: %v", err)
	}
	cancel()
	wg.Wait()
	// The worker frees a stream's slot once it sees the stream's
	// connection gone, a moment after the client has let go.
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if err = sb.Remove(f.ctx, true); !errdefs.IsResourceExhausted(err) {
			break
		}
	}
	if err != nil {
		t.Errorf("the token's slots after its streams ended: %v", err)
	}
}

func (f *tenancyFixture) allowances(t *testing.T) {
	if err := f.te.local.SavePolicy(f.ctx, "stored", &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy"}); err != nil {
		t.Fatal(err)
	}
	free := f.te.c["free"]
	for who, ok := range map[string]bool{"b": false, "free": true} {
		c := f.te.c[who]
		_, err := c.Create(f.ctx, api.SandboxSpec{Layers: []string{"bb:1"}, Policy: &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy"}})
		if (err == nil) != ok || !ok && !errdefs.IsPermissionDenied(err) {
			t.Errorf("%s gives a policy of its own: %v", who, err)
		}
		_, err = c.Create(f.ctx, api.SandboxSpec{Layers: []string{"bb:1"}, Memory: api.Unlimited})
		if (err == nil) != ok || !ok && !errdefs.IsPermissionDenied(err) {
			t.Errorf("%s asks for unlimited memory: %v", who, err)
		}
		for what, spec := range map[string]api.SandboxSpec{"memory": {Memory: 1 << 50}, "pids": {Pids: 1 << 40}, "disk": {Disk: 1 << 55}} {
			spec.Layers = []string{"bb:1"}
			_, err = c.Create(f.ctx, spec)
			if !ok && (!errdefs.IsPermissionDenied(err) || !strings.Contains(err.Error(), "more than the host has")) {
				t.Errorf("%s asks for more %s than the host has: %v", who, what, err)
			}
		}
		sb, err := c.Create(f.ctx, api.SandboxSpec{Layers: []string{"bb:1"}, PolicyName: "stored"})
		if err != nil {
			t.Fatalf("%s names a stored policy: %v", who, err)
		}
		_, err = sb.ApplyPolicy(f.ctx, api.PolicyRequest{Name: "stored"})
		if (err == nil) != ok || !ok && !errdefs.IsPermissionDenied(err) {
			t.Errorf("%s applies a policy: %v", who, err)
		}
	}
	l, _ := free.List(f.ctx)
	for _, sb := range l {
		free.Sandbox(sb.Name).Remove(f.ctx, true)
	}
	l, _ = f.b.List(f.ctx)
	for _, sb := range l {
		if sb.Name != "b-sb" {
			f.b.Sandbox(sb.Name).Remove(f.ctx, true)
		}
	}
	if err := f.te.local.SavePolicy(f.ctx, "other", &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy"}); err != nil {
		t.Fatal(err)
	}
	listed := f.te.c["listed"]
	if _, err := listed.Create(f.ctx, api.SandboxSpec{Layers: []string{"bb:1"}, PolicyName: "other"}); !errdefs.IsPermissionDenied(err) {
		t.Errorf("a token's unlisted stored policy: %v", err)
	}
	if ps, err := listed.Policies(f.ctx); err != nil || len(ps) != 1 || ps[0].Metadata.Name != "stored" {
		t.Errorf("a token with listed policies sees %+v %v", ps, err)
	}
	if _, err := listed.Policy(f.ctx, "other"); !errdefs.IsNotFound(err) {
		t.Errorf("a token gets an unlisted policy: %v", err)
	}
	if sb, err := listed.Create(f.ctx, api.SandboxSpec{Layers: []string{"bb:1"}, PolicyName: "stored"}); err != nil {
		t.Errorf("a token's listed stored policy: %v", err)
	} else {
		sb.Remove(f.ctx, true)
	}
	f.te.local.RemovePolicy(f.ctx, "other")
	// Pools and stored policies: what B may use, without others' use.
	pools, err := f.b.Pools(f.ctx)
	if err != nil || len(pools) != 1 || pools[0].Calls != 0 {
		t.Errorf("b's pools: %+v %v", pools, err)
	}
	if ps, err := f.b.Policies(f.ctx); err != nil || len(ps) != 1 {
		t.Errorf("b's policies: %+v %v", ps, err)
	}
}

func (f *tenancyFixture) quotas(t *testing.T) {
	q := f.te.c["quota"]
	for i := range 2 {
		if _, err := q.Create(f.ctx, api.SandboxSpec{Name: "q" + strconv.Itoa(i), Layers: []string{"bb:1"}, Memory: 256 << 20}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := q.Create(f.ctx, api.SandboxSpec{Layers: []string{"bb:1"}, Memory: 256 << 20}); !errdefs.IsResourceExhausted(err) {
		t.Errorf("a third sandbox: %v", err)
	}
	// A call in the admin's pool is held by the caller's quota too.
	if _, err := q.Call(f.ctx, sdk.CallOptions{Pool: "p", ExecOptions: sdk.ExecOptions{Args: []string{"true"}}}); !errdefs.IsResourceExhausted(err) {
		t.Errorf("a pool's call past the quota: %v", err)
	}
	q.Sandbox("q0").Remove(f.ctx, true)
	if _, err := q.Create(f.ctx, api.SandboxSpec{Layers: []string{"bb:1"}, Memory: 1 << 30}); !errdefs.IsResourceExhausted(err) {
		t.Errorf("past the memory quota: %v", err)
	}
	q.Sandbox("q1").Remove(f.ctx, true)

	s := f.te.c["snapq"]
	sb, err := s.Create(f.ctx, api.SandboxSpec{Layers: []string{"bb:1"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sb.PackDiff(f.ctx, api.PackRequest{Tag: "s:1"}); err != nil {
		t.Fatalf("a small snapshot: %v", err)
	}
	run(t, sb, "big", "head -c 200000 /dev/urandom > /root/big")
	if _, err := sb.PackDiff(f.ctx, api.PackRequest{Tag: "s:2"}); !errdefs.IsResourceExhausted(err) || !strings.Contains(err.Error(), "quota") {
		t.Errorf("past the snapshot quota: %v", err)
	}
	if l, _ := s.Snapshots(f.ctx); len(l) != 1 {
		t.Errorf("snapshots after the refused pack: %+v", l)
	}
	// A request may lower the worker's pack bound (1 MiB here),
	// never raise it; the admin may.
	run(t, f.asb, "2m", "head -c 2000000 /dev/urandom > /root/two")
	if _, err := f.asb.PackDiff(f.ctx, api.PackRequest{Tag: "a-big:1", MaxBytes: 100 << 20}); err == nil || !strings.Contains(err.Error(), "max-bytes") {
		t.Errorf("a tenant raises the pack bound: %v", err)
	}
	if _, err := f.te.local.Sandbox("a-sb").PackDiff(f.ctx, api.PackRequest{Tag: "a-big:1", MaxBytes: 100 << 20}); err != nil {
		t.Errorf("the admin raises the pack bound: %v", err)
	}
	sb.Remove(f.ctx, true)
}
