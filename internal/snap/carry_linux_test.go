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

// carry is the image Carry makes of diff over base under the carry rules,
// and what it left out.
func carry(t *testing.T, diff, base string, rules ...string) (string, *snap.Carried) {
	t.Helper()
	r, err := grade.Parse(rules, nil)
	must(t, err)
	img := filepath.Join(t.TempDir(), "carried.erofs")
	f, err := os.Create(img)
	must(t, err)
	defer f.Close()
	w, err := erofs.NewWriter(f)
	must(t, err)
	c, err := snap.Carry(context.Background(), w, diff, snap.CarryOptions{Rules: r, Base: base})
	must(t, err)
	defer c.Close()
	_, err = w.Finish()
	must(t, err)
	return img, c
}

func writeFile(t *testing.T, dir, p, body string) {
	t.Helper()
	must(t, os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755))
	must(t, os.WriteFile(filepath.Join(dir, p), []byte(body), 0o644))
}

// TestCarry: what Carry takes of a hostile diff, stacked by the kernel's
// overlay over the pristine tree, shows the carried changes and the
// pristine rest: an opaque carried directory hides only its carried
// paths (not the tests below it), a carried removal hides, and a
// device node, an escaping symlink, a startup hook and every change out
// of the carry rules stay out and are reported.
func TestCarry(t *testing.T) {
	layertest.RequireRoot(t)
	base, diff := t.TempDir(), t.TempDir()
	write := func(dir, p, body string) { t.Helper(); writeFile(t, dir, p, body) }
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

	img, c := carry(t, diff, base, "/work/repo/**", "!/work/repo/tests/**", "!/work/repo/lib/tests/**")

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

// TestCarryLinks: the review's attacks on links. A chain of carried
// symlinks into the tests (t -> ../tests, answer -> t/expected), a
// target through a planted directory symlink and "..", a link to the
// tests directory itself: each left out and reported. A symlink of the
// pristine layers to a host directory is never followed: what the diff
// puts there is reported as added whatever the host holds, and no host
// entry becomes a whiteout. A carried directory holding the tests keeps
// the pristine attributes, not the agent's chmod.
func TestCarryLinks(t *testing.T) {
	layertest.RequireRoot(t)
	base, diff, host := t.TempDir(), t.TempDir(), t.TempDir()
	write := func(dir, p, body string) { t.Helper(); writeFile(t, dir, p, body) }
	write(base, "work/repo/tests/expected.txt", "42")
	write(base, "work/repo/src/a.py", "A")
	write(host, "secret", "host")
	write(host, "other", "host")
	must(t, os.Symlink(host, filepath.Join(base, "work/hostlink")))

	must(t, os.MkdirAll(filepath.Join(diff, "work/repo/src"), 0o755))
	must(t, os.Symlink("../tests", filepath.Join(diff, "work/repo/src/t")))
	must(t, os.Symlink("t/expected.txt", filepath.Join(diff, "work/repo/src/answer")))
	must(t, os.Symlink("/work/repo/z", filepath.Join(diff, "work/repo/src/s")))
	must(t, os.MkdirAll(filepath.Join(diff, "work/repo/z/a/b"), 0o755))
	must(t, os.Symlink("/work/repo/src/s/../../tests/expected.txt", filepath.Join(diff, "work/repo/src/dotdot")))
	must(t, os.Symlink("/work/repo/tests", filepath.Join(diff, "work/repo/src/tests-dir")))
	must(t, os.Symlink("a.py", filepath.Join(diff, "work/repo/src/fine")))
	write(diff, "work/hostlink/secret", "agent") // a directory over the pristine symlink
	must(t, unix.Lsetxattr(filepath.Join(diff, "work/hostlink"), "trusted.overlay.opaque", []byte("y"), 0))
	must(t, os.MkdirAll(filepath.Join(diff, "work/repo/tests"), 0o755))
	must(t, os.Chmod(filepath.Join(diff, "work/repo/tests"), 0))

	img, c := carry(t, diff, base, "/work/**", "!/work/repo/tests/**")
	reported := map[string]snap.Change{}
	for _, ch := range c.Changes {
		reported[ch.Path] = ch
	}
	for _, p := range []string{"/work/repo/src/t", "/work/repo/src/answer", "/work/repo/src/dotdot", "/work/repo/src/tests-dir"} {
		if ch, ok := reported[p]; !ok || ch.Group != "links" {
			t.Errorf("%s: %+v, want left out as links (all: %v)", p, ch, reported)
		}
	}
	if _, ok := reported["/work/repo/src/fine"]; ok {
		t.Errorf("a symlink within the carried paths was left out: %+v", reported["/work/repo/src/fine"])
	}
	img2 := layertest.ScanEROFS(t, img)
	if _, ok := img2["work/repo/src/fine"]; !ok {
		t.Error("the carried layer lacks the symlink within the carried paths")
	}
	for p := range img2 {
		if p == "work/hostlink/other" {
			t.Errorf("a host entry in the carried layer: %s", p)
		}
	}
	if e, ok := img2["work/repo/tests"]; !ok || e.Perm != 0o755 {
		t.Errorf("the tests directory in the carried layer: %+v, want the pristine mode 0755", e)
	}
}
