package lower

import (
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestOf: one Mounts per root, however the root is spelt, and a root's
// Keep is its own.
func TestOf(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	wd, _ := os.Getwd()
	rel, err := filepath.Rel(wd, a)
	if err != nil {
		t.Fatal(err)
	}
	if Of(a) != Of(a+"/") || Of(a) != Of(rel) || Of(a) == Of(b) {
		t.Fatal("Of gave one root two Mounts, or two roots one")
	}
	Of(a).Keep(time.Minute)
	if Of(b).keepFor != 0 || Of(a).keepFor != time.Minute {
		t.Fatalf("keep: %v, %v", Of(a).keepFor, Of(b).keepFor)
	}
}
