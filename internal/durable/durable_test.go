package durable

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestRecipe: WriteFile takes the store's recipe step by step (temp file,
// write, fsync, close, rename, directory fsync), leaves the new bytes with
// the mode asked for, and no temporary file.
func TestRecipe(t *testing.T) {
	var steps []string
	trace = func(s string) { steps = append(steps, s) }
	defer func() { trace = nil }()
	dir := t.TempDir()
	p := filepath.Join(dir, "result.json")
	os.WriteFile(p, []byte("old"), 0o600)
	if err := WriteFile(p, []byte("new"), 0o640); err != nil {
		t.Fatal(err)
	}
	if want := []string{"create", "write", "fsync", "close", "rename", "fsync dir"}; !slices.Equal(steps, want) {
		t.Fatalf("steps %v, want %v", steps, want)
	}
	if b, _ := os.ReadFile(p); string(b) != "new" {
		t.Fatalf("contents %q", b)
	}
	if fi, _ := os.Stat(p); fi.Mode().Perm() != 0o640 {
		t.Fatalf("mode %v", fi.Mode())
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 1 {
		t.Fatalf("left in the directory: %v", ents)
	}
}

// TestReplace: Replace is the recipe without its two fsyncs.
func TestReplace(t *testing.T) {
	var steps []string
	trace = func(s string) { steps = append(steps, s) }
	defer func() { trace = nil }()
	p := filepath.Join(t.TempDir(), "state.json")
	if err := Replace(p, []byte("creating"), 0o600); err != nil {
		t.Fatal(err)
	}
	if want := []string{"create", "write", "close", "rename"}; !slices.Equal(steps, want) {
		t.Fatalf("steps %v, want %v", steps, want)
	}
	if b, _ := os.ReadFile(p); string(b) != "creating" {
		t.Fatalf("contents %q", b)
	}
}

// TestFailureKeepsOld: a write that cannot finish (the target is a
// directory: the rename fails) leaves the old file as it was and no
// temporary file.
func TestFailureKeepsOld(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "state.json")
	os.Mkdir(p, 0o755)
	os.WriteFile(filepath.Join(p, "keep"), nil, 0o600)
	if err := WriteFile(p, []byte("new"), 0o600); err == nil {
		t.Fatal("replaced a non-empty directory")
	}
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if strings.Contains(e.Name(), ".tmp-") {
			t.Fatalf("a temporary file is left: %s", e.Name())
		}
	}
	if _, err := os.Stat(filepath.Join(p, "keep")); err != nil {
		t.Fatal("the old contents went")
	}
}
