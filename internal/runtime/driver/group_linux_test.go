package driver

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRootID: a new root draws an identity of its own and keeps it (in
// <root>/root-id): two roots differ, and so do two roots made one after
// the other at one path (as two pods' containers are); a root that
// already holds sandboxes keeps its path's hash, which their groups
// bear; a root not made yet answers its path's hash and keeps nothing.
func TestRootID(t *testing.T) {
	byPath := func(p string) string {
		abs, _ := filepath.Abs(p)
		h := sha256.Sum256([]byte(abs))
		return hex.EncodeToString(h[:4])
	}
	dir := t.TempDir()
	a, b := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	for _, r := range []string{a, b} {
		if err := os.Mkdir(r, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	ida, idb := RootID(a), RootID(b)
	if len(ida) != 8 || ida == byPath(a) || ida == idb {
		t.Errorf("two new roots: %q %q (by path %q)", ida, idb, byPath(a))
	}
	if kept, err := os.ReadFile(filepath.Join(a, "root-id")); err != nil || strings.TrimSpace(string(kept)) != ida || RootID(a) != ida {
		t.Errorf("a's identity kept: %q %v, asked again %q", kept, err, RootID(a))
	}
	if GroupSuffix(a) != "-"+ida || GroupName(a, "_x") != "sb-_x-"+ida {
		t.Errorf("a's groups: %s %s", GroupSuffix(a), GroupName(a, "_x"))
	}
	// Another root at a's path (a's gone): another identity.
	if err := os.Rename(a, a+".gone"); err != nil {
		t.Fatal(err)
	}
	rootIDs.Delete(a) // (another process's view: nothing read yet)
	if err := os.Mkdir(a, 0o700); err != nil {
		t.Fatal(err)
	}
	if again := RootID(a); again == ida || len(again) != 8 {
		t.Errorf("a new root at a's path: %q, the old one's %q", again, ida)
	}
	// A root from before identities, with sandboxes: its path's hash.
	old := filepath.Join(dir, "old")
	if err := os.MkdirAll(filepath.Join(old, "sandboxes", "_0123456789ab"), 0o700); err != nil {
		t.Fatal(err)
	}
	if id := RootID(old); id != byPath(old) {
		t.Errorf("a root with sandboxes: %q, want its path's hash %q", id, byPath(old))
	}
	// Not made yet: its path's hash, kept nowhere.
	later := filepath.Join(dir, "later")
	if id := RootID(later); id != byPath(later) {
		t.Errorf("a root not made: %q", id)
	}
	if err := os.Mkdir(later, 0o700); err != nil {
		t.Fatal(err)
	}
	if id := RootID(later); id == byPath(later) {
		t.Errorf("the root once made: %q, still its path's hash", id)
	}
}
