package lower

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestNew: a root's Mounts know it by its absolute path however it is
// spelt, and two Mounts share no state (each Keep is its own).
func TestNew(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	wd, _ := os.Getwd()
	rel, err := filepath.Rel(wd, a)
	if err != nil {
		t.Fatal(err)
	}
	if New(a).root != a || New(a+"/").root != a || New(rel).root != a {
		t.Fatalf("a root spelt three ways: %s %s %s, want %s", New(a).root, New(a+"/").root, New(rel).root, a)
	}
	ma, mb := New(a), New(b)
	ma.Keep(time.Minute)
	if mb.keepFor != 0 || ma.keepFor != time.Minute {
		t.Fatalf("keep: %v, %v", ma.keepFor, mb.keepFor)
	}
}
