package store_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/containerd/errdefs"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/dsec-project/dsec/internal/layer/store"
)

func open(t *testing.T) *store.Store {
	t.Helper()
	s, err := store.Open(filepath.Join(t.TempDir(), "store"))
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func TestLayoutIsOCI(t *testing.T) {
	s := open(t)
	b, err := os.ReadFile(filepath.Join(s.Dir(), "oci-layout"))
	if err != nil || string(b) != `{"imageLayoutVersion":"1.0.0"}` {
		t.Fatalf("oci-layout = %s, %v", b, err)
	}
	var idx ocispec.Index
	b, _ = os.ReadFile(filepath.Join(s.Dir(), "index.json"))
	if err := json.Unmarshal(b, &idx); err != nil || idx.SchemaVersion != 2 {
		t.Fatalf("index.json = %s, %v", b, err)
	}
	// Opening again keeps what is there.
	d, _ := s.WriteBlob("application/json", []byte("{}"))
	if err := s.Tag(context.Background(), "a:1", d, false); err != nil {
		t.Fatal(err)
	}
	s2, err := store.Open(s.Dir())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s2.Resolve(context.Background(), "a:1"); err != nil {
		t.Fatal(err)
	}
}

func TestBlobsVerifyOnRead(t *testing.T) {
	s := open(t)
	d, err := s.WriteBlob("application/json", []byte(`{"a":1}`))
	if err != nil {
		t.Fatal(err)
	}
	if d.Digest != digest.FromString(`{"a":1}`) || d.Size != 7 {
		t.Fatalf("descriptor %+v", d)
	}
	if st, _ := os.Stat(s.BlobPath(d.Digest)); st.Mode().Perm() != 0o444 {
		t.Errorf("blob mode %v, want read-only", st.Mode())
	}
	b, err := s.ReadBlob(d.Digest, 100)
	if err != nil || string(b) != `{"a":1}` {
		t.Fatalf("read %s, %v", b, err)
	}
	if _, err := s.ReadBlob(d.Digest, 3); !errdefs.IsDataLoss(err) {
		t.Errorf("oversized read: %v", err)
	}
	os.Chmod(s.BlobPath(d.Digest), 0o644)
	os.WriteFile(s.BlobPath(d.Digest), []byte(`{"a":2}`), 0o644)
	if _, err := s.ReadBlob(d.Digest, 100); !errdefs.IsDataLoss(err) {
		t.Fatalf("corrupt blob read: %v", err)
	}
	if err := s.VerifyBlob(d.Digest); !errdefs.IsDataLoss(err) {
		t.Fatalf("corrupt blob verify: %v", err)
	}
	if _, err := s.ReadBlob(digest.FromString("nope"), 100); !errdefs.IsNotFound(err) {
		t.Fatalf("missing blob: %v", err)
	}
	// An ingest whose bytes do not match the expected digest is refused
	// and leaves nothing behind.
	in, _ := s.NewIngest()
	in.Write([]byte("abc"))
	if _, err := in.Commit(digest.FromString("abd")); !errdefs.IsDataLoss(err) {
		t.Fatalf("mismatched commit: %v", err)
	}
	if s.Exists(digest.FromString("abc")) {
		t.Fatal("mismatched ingest was published")
	}
	if ents, _ := os.ReadDir(filepath.Join(s.Dir(), "ingest")); len(ents) != 0 {
		t.Fatalf("ingest left %d files", len(ents))
	}
}

func TestTags(t *testing.T) {
	ctx := context.Background()
	s := open(t)
	a, _ := s.WriteBlob("application/json", []byte(`"a"`))
	b, _ := s.WriteBlob("application/json", []byte(`"b"`))
	if err := s.Tag(ctx, "x:1", a, false); err != nil {
		t.Fatal(err)
	}
	if err := s.Tag(ctx, "x:1", a, false); err != nil {
		t.Fatalf("retag of the same content: %v", err)
	}
	if err := s.Tag(ctx, "x:1", b, false); !errdefs.IsAlreadyExists(err) {
		t.Fatalf("retag of other content without force: %v", err)
	}
	if err := s.Tag(ctx, "x:1", b, true); err != nil {
		t.Fatal(err)
	}
	if d, _ := s.Resolve(ctx, "x:1"); d.Digest != b.Digest {
		t.Fatalf("x:1 -> %s", d.Digest)
	}
	if err := s.Tag(ctx, "y:1", ocispec.Descriptor{Digest: digest.FromString("missing")}, false); !errdefs.IsNotFound(err) {
		t.Fatalf("tag of a missing blob: %v", err)
	}
	if _, err := s.Untag(ctx, "x:1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Untag(ctx, "x:1"); !errdefs.IsNotFound(err) {
		t.Fatalf("second untag: %v", err)
	}
}

// TestIndexReadOnce: a store reads its index again only once another
// file is in its place, also one another Store (another process) wrote;
// what a caller does with the tags it got changes no later answer.
func TestIndexReadOnce(t *testing.T) {
	ctx := context.Background()
	s := open(t)
	other, err := store.Open(s.Dir())
	if err != nil {
		t.Fatal(err)
	}
	a, _ := s.WriteBlob("application/json", []byte(`"a"`))
	b, _ := s.WriteBlob("application/json", []byte(`"b"`))
	if err := s.Tag(ctx, "x:1", a, false); err != nil {
		t.Fatal(err)
	}
	tags, err := s.Tags(ctx)
	if err != nil || len(tags) != 1 {
		t.Fatal(tags, err)
	}
	tags[0].Digest = b.Digest // the caller's copy
	if d, err := s.Resolve(ctx, "x:1"); err != nil || d.Digest != a.Digest {
		t.Fatalf("x:1 -> %s %v after a caller changed its tags", d.Digest, err)
	}
	for i, ref := range []string{"y:1", "y:2", "y:3"} { // each seen by the other at once
		if err := other.Tag(ctx, ref, b, false); err != nil {
			t.Fatal(err)
		}
		if tags, _ := s.Tags(ctx); len(tags) != i+2 {
			t.Fatalf("after another store's tag %s: %d tags, want %d", ref, len(tags), i+2)
		}
	}
	if _, err := other.Untag(ctx, "x:1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Resolve(ctx, "x:1"); !errdefs.IsNotFound(err) {
		t.Fatalf("x:1 after another store untagged it: %v", err)
	}
}

func TestGC(t *testing.T) {
	ctx := context.Background()
	s := open(t)
	// An Exclusive lock nobody holds goes; a held one stays.
	held, err := s.Exclusive(ctx, "held")
	if err != nil {
		t.Fatal(err)
	}
	defer held()
	free, err := s.Exclusive(ctx, "free")
	if err != nil {
		t.Fatal(err)
	}
	free()
	leaf, _ := s.WriteBlob("application/octet-stream", []byte("leaf"))
	orphan, _ := s.WriteBlob("application/octet-stream", []byte("orphan"))
	parentBody, _ := json.Marshal(leaf)
	parent, _ := s.WriteBlob("application/vnd.test+json", parentBody)
	if err := s.Tag(ctx, "p:1", parent, false); err != nil {
		t.Fatal(err)
	}
	in, _ := s.NewIngest() // a killed writer's leftover
	in.Write([]byte("partial"))
	in.Close()
	// What an interrupted transfer kept goes, unless a transfer holds it.
	kept, _ := s.ResumeIngest(digest.FromString("kept"))
	kept.Write([]byte("kept for later"))
	kept.Abort()
	busy, _ := s.ResumeIngest(digest.FromString("busy"))
	busy.Write([]byte("being written"))
	defer busy.Discard()
	refs := func(d ocispec.Descriptor, b []byte) ([]ocispec.Descriptor, error) {
		var child ocispec.Descriptor
		return []ocispec.Descriptor{child}, json.Unmarshal(b, &child)
	}
	// Untagged: a root keeps its blob; an owned blob (a manifest whose
	// image is kept) is kept with what it refers to; one whose owner
	// goes, goes.
	rooted, _ := s.WriteBlob("application/octet-stream", []byte("rooted"))
	ownedLeaf, _ := s.WriteBlob("application/octet-stream", []byte("owned leaf"))
	ownedBody, _ := json.Marshal(ownedLeaf)
	owned, _ := s.WriteBlob("application/vnd.test+json", append([]byte(`{"owner":"`+rooted.Digest+`",`), ownedBody[1:]...))
	strayBody, _ := json.Marshal(orphan)
	stray, _ := s.WriteBlob("application/vnd.test+json", append([]byte(`{"owner":"`+orphan.Digest+`",`), strayBody[1:]...))
	owner := func(b []byte) (digest.Digest, string, bool) {
		var v struct{ Owner digest.Digest }
		if json.Unmarshal(b, &v) != nil || v.Owner == "" {
			return "", "", false
		}
		return v.Owner, "application/vnd.test+json", true
	}
	res, err := s.GC(ctx, store.Marks{Refs: refs, Roots: []ocispec.Descriptor{rooted}, Owner: owner})
	if err != nil {
		t.Fatal(err)
	}
	// Bytes: the two blobs, a killed writer's 7 and the kept 14.
	if res.Blobs != 2 || res.Ingests != 2 || res.Bytes != int64(len("orphan"))+stray.Size+7+14 {
		t.Fatalf("gc = %+v", res)
	}
	if _, err := os.Stat(kept.Name()); !os.IsNotExist(err) {
		t.Errorf("gc kept an interrupted transfer's bytes nobody holds: %v", err)
	}
	if _, err := os.Stat(busy.Name()); err != nil {
		t.Errorf("gc removed the bytes of a transfer under way: %v", err)
	}
	if _, err := os.Stat(filepath.Join(s.Dir(), "locks", "held")); err != nil {
		t.Errorf("gc removed a held lock: %v", err)
	}
	if _, err := os.Stat(filepath.Join(s.Dir(), "locks", "free")); !os.IsNotExist(err) {
		t.Errorf("gc kept a lock nobody holds: %v", err)
	}
	for _, d := range []ocispec.Descriptor{leaf, parent, rooted, owned, ownedLeaf} {
		if !s.Exists(d.Digest) {
			t.Errorf("gc removed %s", d.Digest)
		}
	}
	if s.Exists(orphan.Digest) || s.Exists(stray.Digest) {
		t.Fatal("gc kept a blob nothing needs")
	}
}

// TestLeases: a live lease keeps its blobs, and what they refer to,
// from collection, untagged; a released one, or one whose holder died
// (its file unlocked), does not; Leased names the leases by digest and
// skips a line being cut.
func TestLeases(t *testing.T) {
	ctx := context.Background()
	s := open(t)
	child, _ := s.WriteBlob("application/octet-stream", []byte("child"))
	body, _ := json.Marshal(child)
	parent, _ := s.WriteBlob("application/vnd.test+json", body)
	other, _ := s.WriteBlob("application/octet-stream", []byte("other"))
	dead, _ := s.WriteBlob("application/octet-stream", []byte("dead"))
	refs := func(d ocispec.Descriptor, b []byte) ([]ocispec.Descriptor, error) {
		var c ocispec.Descriptor
		return []ocispec.Descriptor{c}, json.Unmarshal(b, &c)
	}
	a, err := s.Lease("create-a")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Release()
	if _, err := s.Lease("create-a"); err == nil {
		t.Error("a second lease of one name")
	}
	if err := a.Add(parent.Digest); err != nil {
		t.Fatal(err)
	}
	if err := a.Add("sha256:nothex"); err == nil {
		t.Error("a lease took a bad digest")
	}
	b, err := s.Lease("create-b")
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Add(other.Digest, parent.Digest); err != nil {
		t.Fatal(err)
	}
	// A holder that died: its lease's file is there, unlocked.
	if err := os.WriteFile(filepath.Join(s.Dir(), "leases", "create-dead"), []byte(dead.Digest.String()+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A line being appended, cut.
	f, err := os.OpenFile(filepath.Join(s.Dir(), "leases", "create-a"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString("sha256:0123")
	f.Close()
	leased, err := s.Leased()
	if err != nil {
		t.Fatal(err)
	}
	if got := leased[parent.Digest]; len(got) != 2 || len(leased) != 2 || len(leased[other.Digest]) != 1 {
		t.Errorf("leased = %v", leased)
	}
	if _, err := os.Stat(filepath.Join(s.Dir(), "leases", "create-dead")); !os.IsNotExist(err) {
		t.Errorf("a dead holder's lease stays: %v", err)
	}
	if err := b.Release(); err != nil {
		t.Fatal(err)
	}
	if err := b.Release(); err != nil {
		t.Errorf("a second release: %v", err)
	}
	if err := b.Add(other.Digest); err == nil {
		t.Error("a released lease took a digest")
	}
	if _, err := s.GC(ctx, store.Marks{Refs: refs, LeasedAs: "application/vnd.test+json"}); err != nil {
		t.Fatal(err)
	}
	for d, want := range map[digest.Digest]bool{parent.Digest: true, child.Digest: true, other.Digest: false, dead.Digest: false} {
		if s.Exists(d) != want {
			t.Errorf("after gc, %s kept: %v, want %v", d, s.Exists(d), want)
		}
	}
	a.Release()
	if _, err := s.GC(ctx, store.Marks{Refs: refs}); err != nil {
		t.Fatal(err)
	}
	if s.Exists(parent.Digest) {
		t.Error("gc kept a blob whose lease was released")
	}
}

// BenchmarkLease: what a create's lease costs it: taken, one digest
// added under the writer lock, released.
func BenchmarkLease(b *testing.B) {
	s, err := store.Open(filepath.Join(b.TempDir(), "store"))
	if err != nil {
		b.Fatal(err)
	}
	d := digest.FromString("a layer")
	for i := 0; b.Loop(); i++ {
		l, err := s.Lease(fmt.Sprint("create-", i))
		if err != nil {
			b.Fatal(err)
		}
		unlock, err := s.Writer()
		if err != nil {
			b.Fatal(err)
		}
		if err := l.Add(d); err != nil {
			b.Fatal(err)
		}
		unlock()
		if err := l.Release(); err != nil {
			b.Fatal(err)
		}
	}
}

// TestSweepPartials: what an interrupted transfer kept goes once it is
// older than the age given and no transfer holds it; a fresh one, and a
// held one however old, stay.
func TestSweepPartials(t *testing.T) {
	s := open(t)
	old := time.Now().Add(-48 * time.Hour)
	kept := func(name string, age time.Time) *store.Ingest {
		in, err := s.ResumeIngest(digest.FromString(name))
		if err != nil {
			t.Fatal(err)
		}
		in.Write([]byte(name))
		if err := os.Chtimes(in.Name(), age, age); err != nil {
			t.Fatal(err)
		}
		return in
	}
	stale := kept("stale", old)
	stale.Abort()
	fresh := kept("fresh", time.Now())
	fresh.Abort()
	held := kept("held", old)
	defer held.Discard()
	if n, b := s.SweepPartials(24 * time.Hour); n != 1 || b != int64(len("stale")) {
		t.Errorf("swept %d (%d bytes), want the stale one (5 bytes)", n, b)
	}
	for in, want := range map[*store.Ingest]bool{stale: false, fresh: true, held: true} {
		if _, err := os.Stat(in.Name()); (err == nil) != want {
			t.Errorf("%s: there %v, want %v", filepath.Base(in.Name()), err == nil, want)
		}
	}
}
