package rootdir

import (
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

// TestSecure: a new root is 0700; an open one, its directories and its
// files lose group and other access (set-id bits and the owner's kept),
// symlinks are left, and nothing deeper is touched.
func TestSecure(t *testing.T) {
	base := t.TempDir()
	root := filepath.Join(base, "new", "root")
	if fixed, err := Secure(root); err != nil || len(fixed) != 0 {
		t.Fatalf("a new root: %v %v", fixed, err)
	}
	if fi, _ := os.Stat(root); fi.Mode().Perm() != 0o700 {
		t.Fatalf("a new root is %v", fi.Mode())
	}

	old := filepath.Join(base, "old")
	for _, d := range []string{"store/blobs/sha256", "sandboxes/x", "uppers"} {
		if err := os.MkdirAll(filepath.Join(old, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(old, "uppers.img"), nil, 0o644)
	os.WriteFile(filepath.Join(old, "tokens.json"), nil, 0o600)
	os.Symlink("/etc", filepath.Join(old, "link"))
	for _, p := range []string{old, filepath.Join(old, "store"), filepath.Join(old, "sandboxes")} {
		os.Chmod(p, 0o755)
	}
	os.Chmod(filepath.Join(old, "uppers"), 0o775|fs.ModeSetgid)
	fixed, err := Secure(old)
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]fs.FileMode{
		old: 0o700, "store": 0o700, "sandboxes": 0o700, "uppers": 0o700 | fs.ModeSetgid, "uppers.img": 0o600, "tokens.json": 0o600,
		"store/blobs": 0o755, "sandboxes/x": 0o755, // below: unreachable, kept
	} {
		if !filepath.IsAbs(p) {
			p = filepath.Join(old, p)
		}
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if got := fi.Mode() & (fs.ModePerm | fs.ModeSetgid); got != want {
			t.Errorf("%s: %v, want %v", p, got, want)
		}
	}
	if slices.Contains(fixed, filepath.Join(old, "tokens.json")) || !slices.Contains(fixed, old) || len(fixed) != 5 {
		t.Errorf("repaired %v", fixed)
	}
	if fi, _ := os.Stat("/etc"); fi.Mode().Perm()&0o005 == 0 {
		t.Error("a symlink's target was changed")
	}
	if _, err := Secure(filepath.Join(old, "uppers.img")); err == nil {
		t.Error("a file as the root")
	}
}
