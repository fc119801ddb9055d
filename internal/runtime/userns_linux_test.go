package runtime_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsec-project/dsec/api"
	"github.com/dsec-project/dsec/internal/runtime"
	"github.com/dsec-project/dsec/internal/runtime/disk"
	"github.com/dsec-project/dsec/internal/runtime/runtimetest"
)

// TestUserNamespace: two sandboxes with user namespaces get disjoint host
// ids; in each, root owns the layers' files and the upper stores what it
// writes as the host's root would; a stop and start (other ids, maybe)
// keeps the files theirs; a disk quota's upper works the same; removal
// gives the ids back.
func TestUserNamespace(t *testing.T) {
	root, s := layers(t)
	ctx := context.Background()
	var sbs []*runtime.Sandbox
	// An upper in the sandbox's directory, on a disk image of its own,
	// and on the root's uppers file system.
	for i, disk := range []struct{ quota, bound int64 }{{0, 0}, {64 << 20, 0}, {0, 64 << 20}} {
		sb, err := (&runtime.Host{Root: root, Store: s, DiskBound: disk.bound}).Create(ctx, runtime.Spec{Name: fmt.Sprint("u", i), Layers: []string{"ws:1",
			"bb:1"}, UserNS: true, Disk: disk.quota, Policy: &api.Policy{APIVersion: api.PolicyVersion, Kind: "Policy",
			Files: &api.FilePolicy{ReadOnly: []string{"/etc"}, Hidden: []string{"/etc/answer"}}}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sb.Remove() })
		sbs = append(sbs, sb)
	}
	a, b := sbs[0].Current().IDs, sbs[1].Current().IDs
	if a == nil || b == nil || a.Size != 65536 || a.Host < 1<<31 || (a.Host < b.Host+b.Size && b.Host < a.Host+a.Size) {
		t.Fatalf("id ranges %+v and %+v: want two disjoint ranges of 65536 from 2^31", a, b)
	}
	for _, sb := range sbs {
		ids := sb.Current().IDs
		out, code := sh(t, sb, "1", `cat /proc/self/uid_map; id -u; stat -c %u:%g /bin/busybox /work/hello; `+
			`echo mine >/work/new; mkdir /work/d; stat -c %u /work/new; cat /work/hello`)
		want := fmt.Sprintf("0 %d 65536 0 0:0 0:0 0 from the workspace", ids.Host)
		if got := strings.Join(strings.Fields(out), " "); code != 0 || got != want {
			t.Fatalf("%s (exit %d): %q, want %q", sb.Name, code, got, want)
		}
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(sb.Upper(), "work", "new"), &st); err != nil {
			t.Fatal(err)
		}
		if st.Uid != 0 || st.Gid != 0 {
			t.Errorf("%s: the upper stores the sandbox root's file as %d:%d, want 0:0", sb.Name, st.Uid, st.Gid)
		}
		// The host sees the sandbox's processes as the mapped root.
		status, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", sb.Current().Pid))
		if !strings.Contains(string(status), fmt.Sprintf("\nUid:\t%d\t", ids.Host)) {
			t.Errorf("%s: the init on the host is not uid %d:\n%s", sb.Name, ids.Host, status)
		}
	}
	// The policy's mounts hold in the namespace too.
	if out, code := sh(t, sbs[0], "ro", `touch /etc/x || cat /etc/answer || echo held`); code != 0 || !strings.HasPrefix(out, "held\n") ||
		!strings.Contains(out, "Read-only file system") || !strings.Contains(out, "Permission denied") {
		t.Errorf("read-only /etc and hidden /etc/answer in a user namespace (exit %d): %q", code, out)
	}
	// Stopped, it holds no ids; started again, its files are still root's.
	for _, sb := range []*runtime.Sandbox{sbs[0], sbs[2]} {
		if err := sb.Stop(); err != nil {
			t.Fatal(err)
		}
		if st := sb.Current(); st.IDs != nil {
			t.Fatalf("a stopped sandbox holds ids %+v", st.IDs)
		}
		if err := sb.Start(ctx); err != nil {
			t.Fatal(err)
		}
		if out, _ := sh(t, sb, "2", `stat -c %u /work/new /work/d; cat /work/new`); strings.Join(strings.Fields(out), " ") != "0 0 mine" {
			t.Fatalf("%s after a restart: %q", sb.Name, out)
		}
	}
	// The disk image's first: the others, started (and started again)
	// while it was mounted, hold no copy of its mount (an init starts
	// from a namespace without the host's), so its loop device goes at
	// once, not when they do.
	for _, sb := range []*runtime.Sandbox{sbs[1], sbs[0], sbs[2]} {
		start := time.Now()
		if err := sb.Remove(); err != nil {
			t.Fatal(err)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("removing %s took %v", sb.Name, d)
		}
	}
	if err := disk.ReleaseUppers(root); err != nil {
		t.Fatal(err)
	}
	if l := runtimetest.Leftovers(root); len(l) > 0 {
		t.Fatalf("left behind: %v", l)
	}
}
