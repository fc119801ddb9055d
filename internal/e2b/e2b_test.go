package e2b

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/containerd/errdefs"

	"github.com/dsec-project/dsec/api"
	pb "github.com/dsec-project/dsec/internal/e2b/envd/process"
)

func TestHostRoute(t *testing.T) {
	for host, want := range map[string][2]string{
		"49983-abc123.sandbox.example": {"abc123", "49983"},
		"8080-i9x.e2b.local:443":       {"i9x", "8080"},
		"api.example":                  {"", ""},
		"localhost:3000":               {"", ""},
		"x-abc.example":                {"", ""}, // no port
		"49983-.example":               {"", ""},
		"49983-_bad.example":           {"", ""}, // not a sandbox name
		"":                             {"", ""},
	} {
		id, port := hostRoute(host)
		if id != want[0] || port != want[1] {
			t.Errorf("%q: %q %q, want %q %q", host, id, port, want[0], want[1])
		}
	}
}

// TestMetadataQuery: the SDK escapes keys and values, then the query
// string as a whole; both are undone.
func TestMetadataQuery(t *testing.T) {
	m, err := metadataQuery("suite=a%2520b&user%253D=x%2526y")
	if err != nil || len(m) != 2 || m["suite"] != "a b" || m["user="] != "x&y" {
		t.Fatalf("%v %v", m, err)
	}
	if m, err := metadataQuery(""); m != nil || err != nil {
		t.Fatalf("none: %v %v", m, err)
	}
	if _, err := metadataQuery("a=%zz"); !errdefs.IsInvalidArgument(err) {
		t.Fatalf("bad escape: %v", err)
	}
	if !matches(map[string]string{"a": "1", "b": "2"}, map[string]string{"a": "1"}) || matches(map[string]string{"a": "1"}, map[string]string{"a": "2"}) ||
		matches(nil, map[string]string{"a": ""}) {
		t.Fatal("matches")
	}
}

func TestTimeoutOf(t *testing.T) {
	n := func(v int64) *int64 { return &v }
	for _, c := range []struct {
		in   *int64
		want time.Duration
		bad  bool
	}{{nil, defaultTimeout, false}, {n(0), defaultTimeout, false}, {n(60), time.Minute, false}, {n(-1), 0, true}, {n(int64(maxTimeout/time.Second) + 1), 0, true}} {
		d, err := timeoutOf(c.in, defaultTimeout)
		if (err != nil) != c.bad || (!c.bad && d != c.want) {
			t.Errorf("%v: %v %v", c.in, d, err)
		}
	}
}

func TestHomeRelative(t *testing.T) {
	for in, want := range map[string]string{"": "", "~": "/root", "~/a": "/root/a", "a/b": "/root/a/b", "/tmp": "/tmp"} {
		if got := homeRelative(in); got != want {
			t.Errorf("%q: %q, want %q", in, got, want)
		}
	}
	if p, err := absPath("../../etc/x"); err != nil || p != "/etc/x" {
		t.Errorf("absPath of a relative path with ..: %q %v", p, err) // stays in the sandbox's tree: resolved there
	}
}

func TestNewID(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		id := newID()
		if !regexp.MustCompile(`^[a-z][a-z0-9]{19}$`).MatchString(id) || api.ValidName(id) != nil || seen[id] {
			t.Fatalf("id %q", id)
		}
		seen[id] = true
	}
}

// TestEndEvent: exit codes as envd states them; a failure of the
// sandbox is an error, never a code of the command's.
func TestEndEvent(t *testing.T) {
	end := func(res api.ExecResult, err error) *pb.ProcessEvent_EndEvent { return endEvent(res, err).GetEnd() }
	if e := end(api.ExecResult{ExitCode: 0}, nil); e.ExitCode != 0 || !e.Exited || e.Status != "exit status 0" || e.Error != nil {
		t.Errorf("0: %v", e)
	}
	if e := end(api.ExecResult{ExitCode: 137}, nil); e.ExitCode != 137 || e.Status != "signal: killed" {
		t.Errorf("137: %v", e)
	}
	if e := end(api.ExecResult{ExitCode: 137, OOM: true}, nil); e.Error == nil || !strings.Contains(*e.Error, "memory") {
		t.Errorf("oom: %v", e)
	}
	if e := end(api.ExecResult{}, errors.New("lost the worker")); e.Exited || e.Error == nil || e.ExitCode != -1 {
		t.Errorf("infra: %v", e)
	}
}

// TestErrorClasses: each dsec error class has the E2B status and the
// Connect code the SDKs branch on.
func TestErrorClasses(t *testing.T) {
	for _, c := range []struct {
		err    error
		status int
		code   connect.Code
	}{
		{errdefs.ErrNotFound, 404, connect.CodeNotFound},
		{errdefs.ErrInvalidArgument, 400, connect.CodeInvalidArgument},
		{errdefs.ErrFailedPrecondition, 409, connect.CodeFailedPrecondition},
		{errdefs.ErrAlreadyExists, 409, connect.CodeAlreadyExists},
		{errdefs.ErrUnauthenticated, 401, connect.CodeUnauthenticated},
		{errdefs.ErrResourceExhausted, 429, connect.CodeResourceExhausted},
		{errdefs.ErrUnavailable, 502, connect.CodeUnavailable},
		{errdefs.ErrNotImplemented, 501, connect.CodeUnimplemented},
		{errors.New("other"), 500, connect.CodeInternal},
	} {
		err := fmt.Errorf("wrapped: %w", c.err)
		if got := statusOf(err); got != c.status {
			t.Errorf("%v: status %d, want %d", c.err, got, c.status)
		}
		if got := connect.CodeOf(connErr(err)); got != c.code {
			t.Errorf("%v: code %v, want %v", c.err, got, c.code)
		}
	}
	rec := &recorder{header: http.Header{}}
	writeError(rec, fmt.Errorf("queue full: %w", errdefs.ErrResourceExhausted))
	if rec.status != 429 || rec.header.Get("Retry-After") != "1" || !strings.Contains(rec.body, `"code":429`) {
		t.Errorf("429: %d %v %s", rec.status, rec.header, rec.body)
	}
}

type recorder struct {
	header http.Header
	status int
	body   string
}

func (r *recorder) Header() http.Header         { return r.header }
func (r *recorder) WriteHeader(code int)        { r.status = code }
func (r *recorder) Write(b []byte) (int, error) { r.body += string(b); return len(b), nil }

// TestRecords: records are written whole, read back by a new front,
// kept under their sandbox's ID once it is known (pending until then),
// and die with it: forgotten by its ID, or dropped at a start when the
// name is gone or names another sandbox; an older front's file moves to
// its place; a create's record survives a crash that cuts its unsynced
// write; a damaged one refuses to start it with the file named.
func TestRecords(t *testing.T) {
	dir := t.TempDir()
	r, err := openRecords(dir)
	if err != nil {
		t.Fatal(err)
	}
	exists := func(f string) bool { _, err := os.Stat(filepath.Join(dir, f)); return err == nil }
	end := time.Now().UTC().Truncate(time.Second)
	if err := r.put(record{ID: "abc", Template: "base", EndAt: end, Metadata: map[string]string{"k": "v"}}); err != nil {
		t.Fatal(err)
	}
	if !exists("pending-abc.json") {
		t.Fatal("no pending record")
	}
	if err := r.update("abc", func(rec *record) {
		rec.Sandbox = "sb-1111"
		rec.Procs = append(rec.Procs, proc{PID: 1, Exec: "e2b-1"})
		rec.NextPID = 2
	}); err != nil {
		t.Fatal(err)
	}
	if exists("pending-abc.json") || !exists("sb-1111.json") {
		t.Fatal("the record is not kept under its sandbox's ID")
	}
	if err := r.update("nosuch", func(*record) {}); !errdefs.IsNotFound(err) {
		t.Fatalf("update a missing record: %v", err)
	}
	r2, err := openRecords(dir)
	if err != nil {
		t.Fatal(err)
	}
	got, ok := r2.get("abc")
	if !ok || got.Sandbox != "sb-1111" || got.Template != "base" || !got.EndAt.Equal(end) || got.Metadata["k"] != "v" || len(got.Procs) != 1 || got.NextPID != 2 {
		t.Fatalf("read back: %+v", got)
	}
	if name := r2.forget("sb-1111"); name != "abc" || exists("sb-1111.json") {
		t.Fatalf("forget: %q", name)
	}
	if _, ok := r2.get("abc"); ok {
		t.Fatal("a forgotten record is still there")
	}

	// At a start: one whose sandbox is gone, one whose name now names
	// another, one pending whose sandbox was made, an older front's.
	for _, rec := range []record{{ID: "gone", Sandbox: "sb-gone"}, {ID: "reused", Sandbox: "sb-old"}, {ID: "made"}} {
		if err := r2.put(rec); err != nil {
			t.Fatal(err)
		}
	}
	b, _ := json.Marshal(record{ID: "legacy", Template: "old"})
	os.WriteFile(filepath.Join(dir, "legacy.json"), b, 0o600)
	r3, err := openRecords(dir)
	if err != nil {
		t.Fatal(err)
	}
	live := map[string]string{"reused": "sb-new", "made": "sb-made", "legacy": "sb-legacy"}
	r3.reconcile(func(name string) (string, bool) { id, ok := live[name]; return id, ok })
	for name, want := range map[string]string{"gone": "", "reused": "", "made": "sb-made", "legacy": "sb-legacy"} {
		rec, ok := r3.get(name)
		if ok != (want != "") || ok && rec.Sandbox != want {
			t.Errorf("%s after reconcile: %+v %v", name, rec, ok)
		}
	}
	for f, want := range map[string]bool{"sb-gone.json": false, "sb-old.json": false, "pending-made.json": false, "sb-made.json": true,
		"legacy.json": false, "sb-legacy.json": true} {
		if exists(f) != want {
			t.Errorf("%s: exists %v", f, !want)
		}
	}
	// A create: the pending record synced, the one under the ID not,
	// the pending one behind it until the record is next synced. Read
	// back, it is the latter; cut by a crash (empty), the former, which
	// reconcile completes.
	if err := r3.put(record{ID: "new", Template: "base"}); err != nil {
		t.Fatal(err)
	}
	if err := r3.created("new", "sb-new1"); err != nil {
		t.Fatal(err)
	}
	if !exists("pending-new.json") || !exists("sb-new1.json") {
		t.Fatal("after a create: want the pending record and the sandbox's")
	}
	r4, err := openRecords(dir)
	if err != nil {
		t.Fatal(err)
	}
	if rec, ok := r4.get("new"); !ok || rec.Sandbox != "sb-new1" || !rec.pending {
		t.Fatalf("a created record read back: %+v %v", rec, ok)
	}
	os.WriteFile(filepath.Join(dir, "sb-new1.json"), nil, 0o600)
	r5, err := openRecords(dir)
	if err != nil {
		t.Fatal(err)
	}
	if rec, ok := r5.get("new"); !ok || rec.Sandbox != "" || exists("sb-new1.json") {
		t.Fatalf("a created record a crash cut: %+v %v", rec, ok)
	}
	live["new"] = "sb-new1"
	r5.reconcile(func(name string) (string, bool) { id, ok := live[name]; return id, ok })
	if rec, _ := r5.get("new"); rec.Sandbox != "sb-new1" || exists("pending-new.json") || !exists("sb-new1.json") {
		t.Fatalf("a pending record completed: %+v", rec)
	}
	if err := r5.created("new", "sb-new1"); err != nil {
		t.Fatal(err)
	}
	r5.remove("new")
	if exists("pending-new.json") || exists("sb-new1.json") {
		t.Fatal("a removed record left a file")
	}
	if err := r5.put(record{ID: "new2"}); err != nil {
		t.Fatal(err)
	}
	r5.created("new2", "sb-new2")
	if err := r5.update("new2", func(rec *record) { rec.EndAt = end }); err != nil || exists("pending-new2.json") || !exists("sb-new2.json") {
		t.Fatalf("a created record synced: the pending one stays (%v)", err)
	}
	if r5.forget("sb-new2") != "new2" || exists("sb-new2.json") {
		t.Fatal("forget left the record")
	}

	os.WriteFile(filepath.Join(dir, "bad.json"), []byte("{"), 0o600)
	if _, err := openRecords(dir); !errdefs.IsDataLoss(err) || !strings.Contains(err.Error(), "bad.json") {
		t.Fatalf("a damaged record: %v", err)
	}
	os.Remove(filepath.Join(dir, "bad.json"))
	b, _ = json.Marshal(record{ID: "x", Sandbox: "sb-x"})
	os.WriteFile(filepath.Join(dir, "sb-y.json"), b, 0o600)
	if _, err := openRecords(dir); !errdefs.IsDataLoss(err) || !strings.Contains(err.Error(), "sb-y.json") {
		t.Fatalf("a record under another sandbox's name: %v", err)
	}
}

// FuzzRoutes: the parts of a request the front parses itself (the Host
// of host routing, the list's metadata filter) never panic, and what
// they take is well formed.
func FuzzRoutes(f *testing.F) {
	for _, s := range []string{"49983-abc.example", "suite=a%2520b&x=y", "%", "1-a.b", "a=b=c&&", "-.", "49983-abc.example:99999"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if id, port := hostRoute(s); id != "" && (api.ValidName(id) != nil || port == "") {
			t.Fatalf("%q: took %q %q", s, id, port)
		}
		if m, err := metadataQuery(s); err == nil && s != "" && m == nil {
			t.Fatalf("%q: no map and no error", s)
		}
	})
}

// TestAdopt: a record a gateway's front sends is kept from before its
// sandbox is made; the create ends it, made (the record then describes
// the sandbox, with an access token) or dropped (no record is left, and
// the name may be adopted again).
func TestAdopt(t *testing.T) {
	dir := t.TempDir()
	s, err := New(Options{Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	raw := func(id string) string {
		b, _ := json.Marshal(map[string]any{"id": id, "template": "base", "started": "2026-01-01T00:00:00Z", "end_at": "2026-01-01T00:05:00Z"})
		return base64.RawURLEncoding.EncodeToString(b)
	}
	for name, bad := range map[string]string{"other": raw("x"), "x": "%%", "y": base64.RawURLEncoding.EncodeToString([]byte("{"))} {
		if _, err := s.Adopt(bad, name, "owner"); !errdefs.IsInvalidArgument(err) {
			t.Errorf("a bad record for %s: %v", name, err)
		}
	}
	a, err := s.Adopt(raw("x"), "x", "owner")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Adopt(raw("x"), "x", "owner"); !errdefs.IsAlreadyExists(err) {
		t.Errorf("a second record of a sandbox being made: %v", err)
	}
	a.Drop()
	if st := s.State("x", ""); st != nil {
		t.Errorf("a dropped record describes %+v", st)
	}
	if again, err := New(Options{Dir: dir}); err != nil || again.State("x", "") != nil {
		t.Errorf("a dropped record read again from its directory: %v", err)
	}
	if a, err = s.Adopt(raw("x"), "x", "owner"); err != nil {
		t.Fatalf("the name after a drop: %v", err)
	}
	st, err := a.Made("_id1")
	if err != nil {
		t.Fatal(err)
	}
	if st.Template != "base" || st.AccessToken == "" || st.EndAt.IsZero() {
		t.Errorf("the state of the sandbox made: %+v", st)
	}
	if s.State("x", "_id2") != nil || s.State("x", "_id1") == nil {
		t.Error("the record is not tied to the sandbox made")
	}
	a.Drop() // a late drop leaves the sandbox's record
	if again, err := New(Options{Dir: dir}); err != nil || again.State("x", "_id1") == nil {
		t.Errorf("the sandbox's record read again from its directory: %v", err)
	}
}
