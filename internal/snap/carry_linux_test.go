package snap_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsec-project/dsec/internal/grade"
	"github.com/dsec-project/dsec/internal/layer/erofs"
	"github.com/dsec-project/dsec/internal/layer/layertest"
	"github.com/dsec-project/dsec/internal/mount"
	"github.com/dsec-project/dsec/internal/snap"
)

// TestCarry: what Carry takes of a hostile diff, stacked by the kernel's
// overlay over the pristine tree, shows the carried changes and the
// pristine rest: an opaque carried directory hides only its carried
// paths (not the tests below it), a carried removal hides, and a
// device node, an escaping symlink, a startup hook and every change out
// of the carry rules stay out and are reported.
func TestCarry(t *testing.T) {
	layertest.RequireRoot(t)
	base, diff := t.TempDir(), t.TempDir()
	write := func(dir, p, body string) {
		t.Helper()
		must(t, os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755))
		must(t, os.WriteFile(filepath.Join(dir, p), []byte(body), 0o644))
	}
	for p, body := range map[string]string{"work/repo/src/a.py": "A", "work/repo/src/old.py": "OLD", "work/repo/tests/t.py": "T",
		"work/repo/lib/x.py": "X", "work/repo/lib/tests/lt.py": "LT", "work/other.txt": "O", "etc/passwd": "root"} {
		write(base, p, body)
	}
	for p, body := range map[string]string{"work/repo/src/a.py": "A2", "work/repo/tests/t.py": "HACK", "work/repo/lib/new.py": "N",
		"work/other.txt": "HACK", "etc/passwd": "hacked", "work/repo/conftest.py": "HOOK"} {
		write(diff, p, body)
	}
	must(t, unix.Mknod(filepath.Join(diff, "work/repo/src/old.py"), unix.S_IFCHR, 0)) // removed
	must(t, unix.Mknod(filepath.Join(diff, "work/repo/src/mem"), unix.S_IFCHR|0o600, int(unix.Mkdev(1, 1))))
	must(t, unix.Lsetxattr(filepath.Join(diff, "work/repo/lib"), "trusted.overlay.opaque", []byte("y"), 0))
	must(t, os.Symlink("/etc/passwd", filepath.Join(diff, "work/repo/src/esc")))
	must(t, os.Symlink("a.py", filepath.Join(diff, "work/repo/src/ok")))

	rules, err := grade.Parse([]string{"/work/repo/**", "!/work/repo/tests/**", "!/work/repo/lib/tests/**"}, nil)
	must(t, err)
	img := filepath.Join(t.TempDir(), "carried.erofs")
	f, err := os.Create(img)
	must(t, err)
	w, err := erofs.NewWriter(f)
	must(t, err)
	c, err := snap.Carry(context.Background(), w, diff, snap.CarryOptions{Rules: rules, Base: base})
	must(t, err)
	_, err = w.Finish()
	c.Close()
	f.Close()
	must(t, err)

	top, merged := t.TempDir(), t.TempDir()
	must(t, mount.EROFS(img).Mount(top))
	t.Cleanup(func() { mount.Unmount(top) })
	must(t, mount.Overlay([]string{top, base}, "", "").Mount(merged))
	t.Cleanup(func() { mount.Unmount(merged) })
	for p, want := range map[string]string{"work/repo/src/a.py": "A2", "work/repo/tests/t.py": "T", "work/repo/lib/new.py": "N",
		"work/repo/lib/tests/lt.py": "LT", "work/other.txt": "O", "etc/passwd": "root", "work/repo/src/ok": "A2"} {
		if b, err := os.ReadFile(filepath.Join(merged, p)); err != nil || string(b) != want {
			t.Errorf("%s: %q, %v; want %q", p, b, err, want)
		}
	}
	for _, p := range []string{"work/repo/src/old.py", "work/repo/src/mem", "work/repo/lib/x.py", "work/repo/conftest.py", "work/repo/src/esc"} {
		if _, err := os.Lstat(filepath.Join(merged, p)); !os.IsNotExist(err) {
			t.Errorf("%s shows in the grader's view: %v", p, err)
		}
	}
	reported := map[string]string{}
	for _, ch := range c.Changes {
		reported[ch.Path] = ch.Group + "/" + ch.Change + "/" + ch.Type
	}
	for p, want := range map[string]string{"/work/repo/src/mem": "special/added/device", "/work/repo/tests/t.py": "/modified/file",
		"/work/other.txt": "/modified/file", "/etc/passwd": "/modified/file", "/work/repo/conftest.py": "/added/file",
		"/work/repo/src/esc": "links/added/symlink"} {
		if got := reported[p]; got != want {
			t.Errorf("the report of %s: %q, want %q (all: %v)", p, got, want, reported)
		}
	}
	for _, p := range []string{"/work/repo/src/a.py", "/work/repo/lib/new.py", "/work/repo/src/ok", "/work/repo/src/old.py"} {
		if _, ok := reported[p]; ok {
			t.Errorf("a carried path is reported: %s", p)
		}
	}
	if i := slices.IndexFunc(c.Changes, func(ch snap.Change) bool { return ch.Path == "/work/other.txt" }); i < 0 || c.Changes[i].Digest == "" || c.Changes[i].Size != 4 {
		t.Errorf("a reported file's size and digest: %+v", c.Changes)
	}
}
