package runtime_test

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/dsec-project/dsec/api"
	"golang.org/x/sys/unix"

	dsecrt "github.com/dsec-project/dsec/internal/runtime"
)

// TestDiskQuota: what a sandbox writes is bounded by its quota, for
// root too; a sandbox without one (the control) writes the same; the
// quota grows live, keeps the files across stop and start and packs.
func TestDiskQuota(t *testing.T) {
	f := newSnapFixture(t)
	ctx := context.Background()
	pol := func(disk string) *api.Policy {
		return &api.Policy{APIVersion: "dsec/v1", Kind: "Policy", Resources: &api.ResourcePolicy{Disk: disk}}
	}
	q := f.create(dsecrt.Options{Name: "quota", Layers: []string{"bb:1"}, Policy: pol("32M")})
	free := f.create(dsecrt.Options{Name: "free", Layers: []string{"bb:1"}})
	if d := q.Snapshot().Disk; d != 32<<20 {
		t.Fatalf("disk quota %d", d)
	}
	// Sparse: the image takes host disk as it is written, not its size.
	var st syscall.Stat_t
	if err := syscall.Stat(filepath.Join(q.Dir(), "disk.img"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Blocks*512 > 8<<20 {
		t.Errorf("a fresh 32 MiB disk takes %d bytes of the host's", st.Blocks*512)
	}

	const fill = "dd if=/dev/zero of=/tmp/fill bs=1M count=48 2>&1; echo rc=$?"
	out, _ := sh(t, q, "fill", fill)
	if !strings.Contains(out, "No space left on device") || strings.Contains(out, "rc=0") {
		t.Errorf("writing 48 MiB under a 32 MiB quota: %q", out)
	}
	if used := q.DiskUsed(); used < 24<<20 || used > 32<<20 {
		t.Errorf("disk used %d after filling the quota", used)
	}
	if out, _ := sh(t, free, "fill", fill); !strings.Contains(out, "rc=0") {
		t.Errorf("control: writing 48 MiB without a quota: %q", out)
	}
	// The host's disk is not what fills: removing the file frees it.
	if out, code := sh(t, q, "again", "rm /tmp/fill && echo kept > /work.keep && dd if=/dev/zero of=/tmp/f2 bs=1M count=16 2>&1"); code != 0 {
		t.Errorf("after freeing the quota: %q", out)
	}

	// Stop and start: the files stay, and stay readable while stopped.
	if err := q.Stop(); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(q.Upper(), "work.keep")); err != nil || string(b) != "kept\n" {
		t.Errorf("a stopped sandbox's upper: %q, %v", b, err)
	}
	if err := q.Start(ctx, f.m); err != nil {
		t.Fatal(err)
	}
	if out, _ := sh(t, q, "kept", "cat /work.keep"); out != "kept\n" {
		t.Errorf("after start: %q", out)
	}

	// Grow: online where the worker may (CAP_SYS_RESOURCE), else said
	// so, and offline on the stopped sandbox.
	if hasCap(t, unix.CAP_SYS_RESOURCE) {
		rep, err := q.ApplyPolicy(ctx, pol("96M"))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(strings.Join(rep.Now, "\n"), "disk quota grown to 100663296 bytes") {
			t.Errorf("report: %+v", rep)
		}
	} else {
		t.Log("no CAP_SYS_RESOURCE here: growing a running sandbox's quota must be refused, and work stopped")
		if _, err := q.ApplyPolicy(ctx, pol("96M")); err == nil || !strings.Contains(err.Error(), "takes CAP_SYS_RESOURCE") {
			t.Fatalf("growing online without CAP_SYS_RESOURCE: %v", err)
		}
		if err := q.Stop(); err != nil {
			t.Fatal(err)
		}
		if _, err := q.ApplyPolicy(ctx, pol("96M")); err != nil {
			t.Fatal(err)
		}
		if err := q.Start(ctx, f.m); err != nil {
			t.Fatal(err)
		}
		if out, _ := sh(t, q, "kept2", "cat /work.keep"); out != "kept\n" {
			t.Errorf("after growing offline: %q", out)
		}
	}
	if out, code := sh(t, q, "grown", "rm -f /tmp/f2; "+fill); code != 0 || !strings.Contains(out, "rc=0") {
		t.Errorf("48 MiB under the grown quota: %q", out)
	}
	out, _ = sh(t, q, "df", "df -k / | tail -1")
	if fs := strings.Fields(out); len(fs) < 2 || !within(fs[1], 88<<10, 96<<10) {
		t.Errorf("df in the sandbox after growing to 96 MiB: %q", out)
	}
	for what, p := range map[string]*api.Policy{"shrink": pol("64M"), "too small": pol("1M")} {
		if _, err := q.ApplyPolicy(ctx, p); err == nil {
			t.Errorf("%s: applied", what)
		}
	}
	if _, err := free.ApplyPolicy(ctx, pol("1G")); err == nil || !strings.Contains(err.Error(), "made without a disk quota") {
		t.Errorf("a quota added to a sandbox made without: %v", err)
	}
	if d := q.Snapshot().Disk; d != 96<<20 {
		t.Errorf("quota after refused changes: %d", d)
	}

	// Snapshots pack the upper on the disk; a branch gets its own quota.
	f.mustPack(q, "q:1")
	br := f.create(dsecrt.Options{Name: "branch", From: "q:1", Disk: 20 << 20})
	if out, _ := sh(t, br, "kept", "cat /work.keep; dd if=/dev/zero of=/tmp/x bs=1M count=24 2>&1"); !strings.HasPrefix(out, "kept\n") || !strings.Contains(out, "No space left") {
		t.Errorf("branch with a 20 MiB quota: %q", out)
	}
	if _, err := dsecrt.Create(ctx, f.root, dsecrt.Options{Name: "tiny", Layers: []string{"bb:1"}, Disk: 1 << 20, Mounter: f.m}); err == nil || !strings.Contains(err.Error(), "at least 16 MiB") {
		t.Errorf("a 1 MiB quota: %v", err)
	}
}

// hasCap reports whether this process has capability c in effect.
func hasCap(t *testing.T, c int) bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	_, v, _ := strings.Cut(string(b), "CapEff:")
	n, err := strconv.ParseUint(strings.Fields(v)[0], 16, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n&(1<<c) != 0
}

func within(kib string, lo, hi int64) bool {
	n, err := strconv.ParseInt(kib, 10, 64)
	return err == nil && n >= lo && n <= hi
}
